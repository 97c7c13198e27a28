// The C entry points of the FP8 block-scaled grouped GEMMs. Same order as the
// 16-bit ones: validate -> return early when there is nothing to compute ->
// find the kernel -> take the workspace -> launch; no allocation, host sync
// or host copy, so every call can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "core/workspace.h"
#include "fp8_gemm/fp8_gemm.h"
#include "gemm/api_common.h"

namespace moe_grouped::fp8_gemm {
namespace {

using gemm::check_aligned;
using gemm::check_operand;
using gemm::check_problem;
using gemm::kind_name;

const Fp8KernelList& all_kernels(int index) {
  static const Fp8KernelList lists[] = {sm90_fp8_fprop_kernels(), sm90_fp8_dgrad_kernels(),
                                        sm90_fp8_wgrad_e4m3_kernels(),
                                        sm90_fp8_wgrad_e5m2_kernels(), sm90_fp8_narrow_kernels()};
  return lists[index];
}
constexpr int kKernelLists = 5;

// The schedules in the order the heuristic prefers them, fixed by shapes known
// before capture; the first one built for the call's dtypes runs
// (docs/kernels.md, "FP8 GEMMs"):
//  - the cooperative 128x256 tile; but where N leaves more of the cluster's
//    pairs of 256-column tiles empty than of 128-column ones
//    (round_up(N, 512) > round_up(N, 256), e.g. N = 768: three tiles in two
//    pairs, a quarter of the CTAs idle) the 128x128 tile comes first (built
//    for E4M3 wgrad and dgrad; fprop has none, and runs the 128x256 tile).
// MOE_GROUPED_FP8_SCHEDULE=cooperative|narrow puts that schedule first where
// a kernel of it is built (tests and measurements; auto or unset: none); any
// other value fails the call, so that a forced measurement is never silently
// the heuristic's.
constexpr const char* kScheduleEnv = "MOE_GROUPED_FP8_SCHEDULE";

struct SchedulePreference {
  Fp8Schedule order[3];
  int count = 0;
  void add(Fp8Schedule s) { order[count++] = s; }
};

mg_status preferred_schedules(int64_t n, SchedulePreference* out) {
  SchedulePreference p;
  int forced = 0;
  MG_RETURN_IF_ERROR(gemm::env_choice(kScheduleEnv, {"auto", "cooperative", "narrow"}, &forced));
  if (forced == 1) p.add(Fp8Schedule::kCooperative);
  if (forced == 2) p.add(Fp8Schedule::kNarrow);
  const bool half_empty_pairs = (n + 511) / 512 * 512 > (n + 255) / 256 * 256;
  if (half_empty_pairs) p.add(Fp8Schedule::kNarrow);
  p.add(Fp8Schedule::kCooperative);
  *out = p;
  return MG_OK;
}

template <class Visit>
void for_each_kernel(Visit visit) {
  for (int l = 0; l < kKernelLists; ++l) {
    const Fp8KernelList& list = all_kernels(l);
    for (int i = 0; i < list.count; ++i) visit(list.entries[i]);
  }
}

// The kernel of the first preferred schedule built for (kind, dtypes), or
// else any kernel built for them.
const Fp8KernelEntry* find_kernel(mg_gemm_kind kind, mg_dtype a_dtype, mg_dtype out_dtype,
                                  const SchedulePreference& preferred) {
  const Fp8KernelEntry* found = nullptr;
  int rank = preferred.count;  // of `found`'s schedule in the preference; count: not in it
  for_each_kernel([&](const Fp8KernelEntry& e) {
    if (e.kind != kind || e.a_dtype != a_dtype || e.out_dtype != out_dtype) return;
    int r = 0;
    while (r < preferred.count && preferred.order[r] != e.schedule) ++r;
    if (found == nullptr || r < rank) {
      found = &e;
      rank = r;
    }
  });
  return found;
}

// The largest workspace of any kernel of `kind`, so that a reservation does
// not depend on the fp8 formats or the output dtype.
size_t workspace_bytes(mg_gemm_kind kind, int num_groups, int sms) {
  size_t bytes = 0;
  for_each_kernel([&](const Fp8KernelEntry& e) {
    if (e.kind != kind) return;
    size_t need = e.workspace_bytes(num_groups, sms);
    if (need > bytes) bytes = need;
  });
  return bytes;
}

// Shapes TMA can read as fp8 (16-byte rows) and write as bf16; bf16 outputs.
mg_status check_fp8_problem(const mg_grouped_problem* p, const char* op) {
  MG_RETURN_IF_ERROR(check_problem(p, op));
  if (p->dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "%s: FP8 grouped GEMMs produce bfloat16 (p->dtype), got %s", op,
                dtype_name(p->dtype));
  }
  return gemm::check_row_multiple(p, op, 16, "fp8 rows");
}

mg_status check_fp8_operand(const char* op, const char* name, const mg_fp8_operand& operand,
                            bool allow_e5m2, bool allow_null) {
  if (operand.dtype != MG_FLOAT8_E4M3 && !(allow_e5m2 && operand.dtype == MG_FLOAT8_E5M2)) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s must be %s, got %s", op, name,
                allow_e5m2 ? "float8_e4m3fn or float8_e5m2" : "float8_e4m3fn",
                dtype_name(operand.dtype));
  }
  MG_RETURN_IF_ERROR(check_aligned(op, name, operand.data, allow_null));
  if (operand.scale_inv == nullptr && !allow_null) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s.scale_inv must be a device pointer, got NULL",
                op, name);
  }
  if (reinterpret_cast<uintptr_t>(operand.scale_inv) % 4 != 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s.scale_inv must be 4-byte aligned, got %p", op,
                name, static_cast<const void*>(operand.scale_inv));
  }
  return MG_OK;
}

mg_status run_gemm(const mg_grouped_problem* p, Fp8GemmCall call, mg_dtype out_dtype,
                   void* stream) {
  DeviceGuard guard;
  MG_RETURN_IF_ERROR(guard.enter(p->device));
  int sms = 0;
  MG_RETURN_IF_ERROR(gemm::sm_count(p->device, &sms));
  // The GEMM's N: the output columns (fprop n, dgrad k, wgrad k: dW is [n, k]).
  const int64_t gemm_n = call.kind == MG_GEMM_FPROP ? p->n : p->k;
  SchedulePreference preferred;
  MG_RETURN_IF_ERROR(preferred_schedules(gemm_n, &preferred));
  const Fp8KernelEntry* entry = find_kernel(call.kind, call.a.dtype, out_dtype, preferred);
  if (entry == nullptr) {
    return fail(MG_ERROR_UNSUPPORTED, "no FP8 grouped %s kernel is built for %s x float8_e4m3fn -> %s",
                kind_name(call.kind), dtype_name(call.a.dtype), dtype_name(out_dtype));
  }
  MG_RETURN_IF_ERROR(gemm::forced_tile_order(false, &call.raster_along_n));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  void* workspace = nullptr;
  MG_RETURN_IF_ERROR(workspace_get(p->device, p->workspace_slot,
                                   workspace_bytes(call.kind, p->num_groups, sms), cuda_stream,
                                   &workspace));
  gemm::set_problem(call, p, sms, workspace);
  MG_RETURN_IF_ERROR(entry->run(call, cuda_stream));
  return ok();
}

}  // namespace
}  // namespace moe_grouped::fp8_gemm

using namespace moe_grouped;
using namespace moe_grouped::fp8_gemm;

extern "C" {

mg_status mg_grouped_fp8_workspace_size(const mg_grouped_problem* p, mg_gemm_kind kind,
                                        size_t* out_bytes) {
  const char* op = "mg_grouped_fp8_workspace_size";
  if (out_bytes == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: out_bytes must not be NULL", op);
  MG_RETURN_IF_ERROR(gemm::check_kind(op, kind));
  MG_RETURN_IF_ERROR(check_fp8_problem(p, op));
  int sms = 0;
  MG_RETURN_IF_ERROR(gemm::sm_count(p->device, &sms));
  *out_bytes = workspace_bytes(kind, p->num_groups, sms);
  return ok();
}

mg_status mg_grouped_fp8_fprop(const mg_grouped_problem* p, mg_fp8_operand x, mg_fp8_operand w,
                               const void* bias, void* y, void* stream) {
  const char* op = "mg_grouped_fp8_fprop";
  MG_RETURN_IF_ERROR(check_fp8_problem(p, op));
  bool empty = p->total_rows == 0;
  MG_RETURN_IF_ERROR(check_fp8_operand(op, "x", x, false, empty));
  MG_RETURN_IF_ERROR(check_fp8_operand(op, "w", w, false, false));
  MG_RETURN_IF_ERROR(check_aligned(op, "y", y, empty));
  if (empty) return ok();
  Fp8GemmCall call{};
  call.kind = MG_GEMM_FPROP;
  call.a = x;
  call.b = w;
  call.bias = bias;
  call.out = y;
  return run_gemm(p, call, p->dtype, stream);
}

mg_status mg_grouped_fp8_dgrad(const mg_grouped_problem* p, mg_fp8_operand dy, mg_fp8_operand wt,
                               void* dx, void* stream) {
  const char* op = "mg_grouped_fp8_dgrad";
  MG_RETURN_IF_ERROR(check_fp8_problem(p, op));
  bool empty = p->total_rows == 0;
  MG_RETURN_IF_ERROR(check_fp8_operand(op, "dy", dy, true, empty));
  MG_RETURN_IF_ERROR(check_fp8_operand(op, "wt", wt, false, false));
  MG_RETURN_IF_ERROR(check_aligned(op, "dx", dx, empty));
  if (empty) return ok();
  Fp8GemmCall call{};
  call.kind = MG_GEMM_DGRAD;
  call.a = dy;
  call.b = wt;
  call.out = dx;
  return run_gemm(p, call, p->dtype, stream);
}

mg_status mg_grouped_fp8_wgrad(const mg_grouped_problem* p, mg_fp8_operand dyt, mg_fp8_operand xt,
                               mg_group_operand dw, mg_dtype dw_dtype, int accumulate,
                               void* stream) {
  const char* op = "mg_grouped_fp8_wgrad";
  MG_RETURN_IF_ERROR(check_fp8_problem(p, op));
  if (dw_dtype != MG_FLOAT32 && dw_dtype != p->dtype) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: dw_dtype must be float32 or %s, got %s", op,
                dtype_name(p->dtype), dtype_name(dw_dtype));
  }
  // With no tokens at all the GEMM has no tiles; the zero fill still runs.
  bool empty = p->total_rows == 0;
  MG_RETURN_IF_ERROR(check_fp8_operand(op, "dyt", dyt, true, empty));
  MG_RETURN_IF_ERROR(check_fp8_operand(op, "xt", xt, false, empty));
  MG_RETURN_IF_ERROR(check_operand(op, "dw", dw, gemm::dtype_bytes(dw_dtype)));
  Fp8GemmCall call{};
  call.kind = MG_GEMM_WGRAD;
  call.a = dyt;
  call.b = xt;
  call.dw = dw;
  call.accumulate = accumulate != 0;
  return run_gemm(p, call, dw_dtype, stream);
}

}  // extern "C"
