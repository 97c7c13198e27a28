/*
 * moe_grouped core: the C ABI.
 *
 * This header is the whole contract between the CUDA core and its callers
 * (the Python package loads the shared library with ctypes). It knows nothing
 * of Python or torch: tensors are raw device pointers, streams are
 * cudaStream_t passed as void*.
 *
 * Conventions
 *  - Every function returns mg_status. On failure, mg_last_error() returns a
 *    sentence describing what went wrong, with the offending values; the
 *    message is thread-local and valid until the next call on that thread.
 *  - Nothing here synchronises with the host. Tokens per expert (m_splits)
 *    are read only by kernels; the host never sees them.
 *  - Nothing here allocates while `stream` is being captured into a CUDA
 *    graph. Scratch memory comes from the workspace manager, which grows only
 *    outside capture; a capture that would need more returns
 *    MG_ERROR_CAPTURE with the number of bytes to reserve beforehand.
 *  - Matrices are row-major and contiguous unless a stride says otherwise.
 *
 * Grouped GEMM shapes, per expert e with m_e tokens (sum of m_e = M):
 *    fprop: Y_e[m_e, N]  = X_e[m_e, K] . W_e[N, K]^T   (+ bias_e[N])
 *    dgrad: dX_e[m_e, K] = dY_e[m_e, N] . W_e[N, K]
 *    wgrad: dW_e[N, K]  (+)= dY_e[m_e, N]^T . X_e[m_e, K]
 */
#ifndef MOE_GROUPED_H_
#define MOE_GROUPED_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MG_API __declspec(dllexport)
#else
#define MG_API __attribute__((visibility("default")))
#endif

/* Bumped whenever a declaration below changes meaning. */
#define MG_ABI_VERSION 1

typedef enum mg_status {
  MG_OK = 0,
  MG_ERROR_INVALID_ARGUMENT = 1, /* a bad pointer, shape, dtype or slot */
  MG_ERROR_CAPTURE = 2,          /* would allocate or grow during capture */
  MG_ERROR_CUDA = 3,             /* the CUDA runtime reported an error */
  MG_ERROR_UNSUPPORTED = 4,      /* not built in, or not on this device */
  MG_ERROR_OUT_OF_MEMORY = 5,
  MG_ERROR_INTERNAL = 6
} mg_status;

typedef enum mg_dtype {
  MG_FLOAT32 = 0,
  MG_FLOAT16 = 1,
  MG_BFLOAT16 = 2,
  MG_INT32 = 3,
  MG_INT64 = 4,
  MG_FLOAT8_E4M3 = 5,
  MG_FLOAT8_E5M2 = 6
} mg_dtype;

typedef enum mg_gemm_kind {
  MG_GEMM_FPROP = 0,
  MG_GEMM_DGRAD = 1,
  MG_GEMM_WGRAD = 2
} mg_gemm_kind;

/* Workspace slots: two GEMMs that can sit in one graph never share one. */
#define MG_SLOT_FPROP_DGRAD 0
#define MG_SLOT_WGRAD 1
#define MG_MAX_SLOTS 8

/* ---- library ----------------------------------------------------------- */

MG_API const char* mg_last_error(void);
MG_API int mg_abi_version(void);
/* One line: version, CUDA runtime it was built with, target architectures,
 * kernel families compiled in. */
MG_API const char* mg_build_info(void);
/* Bitmask of MG_CAP_* for what this build contains. */
#define MG_CAP_SETUP 1u
#define MG_CAP_GROUPED_GEMM_16BIT 2u
#define MG_CAP_GROUPED_GEMM_FP8_BLOCKWISE 4u
#define MG_CAP_PERMUTE 8u
#define MG_CAP_FP8_QUANTIZE 16u
MG_API uint32_t mg_capabilities(void);

/* ---- workspace manager, keyed by (device, slot) -------------------------
 * One persistent allocation per key. It grows only outside capture. A grown
 * entry keeps its old blocks alive until mg_workspace_release, because a
 * graph captured earlier still reads them. Thread-safe.                     */

/* Ensure at least `bytes` on (device, slot). Never call while capturing. */
MG_API mg_status mg_workspace_reserve(int device, int slot, size_t bytes);
/* The slot's buffer, at least `bytes` long. Grows outside capture; while
 * `stream` is capturing and the buffer is too small, fails with
 * MG_ERROR_CAPTURE naming the bytes to reserve. */
MG_API mg_status mg_workspace_get(int device, int slot, size_t bytes,
                                  void* stream, void** out_ptr);
typedef struct mg_workspace_stats {
  size_t capacity;       /* bytes of the live buffer */
  size_t high_water;     /* largest request seen */
  size_t retired_bytes;  /* older buffers kept alive for earlier graphs */
  uint64_t grow_count;   /* allocations made for this key */
} mg_workspace_stats;
MG_API mg_status mg_workspace_stats_get(int device, int slot,
                                        mg_workspace_stats* out);
/* Free the key's buffers (slot -1: every slot of the device; device -1:
 * every device). Graphs that used them must not be replayed afterwards. */
MG_API mg_status mg_workspace_release(int device, int slot);

/* ---- setup kernel ---------------------------------------------------------
 * m_splits (int32 or int64, num_groups entries, on the device) ->
 *   offsets[num_groups + 1]: exclusive prefix sum, offsets[0] = 0, as int64;
 *   problem_shapes[num_groups][3] (int32, may be NULL): the GEMM problem of
 *   each group for `kind` in CUTLASS (M, N, K) order:
 *     fprop (m_e, n, k), dgrad (m_e, k, n), wgrad (n, k, m_e).
 * Counts are clamped to [0, total_rows - offset] so that no kernel reads past
 * the static buffer even when m_splits is wrong; validating the counts is the
 * caller's business (it would need a host sync).                           */
MG_API mg_status mg_grouped_setup(const void* m_splits, mg_dtype splits_dtype,
                                  int num_groups, int64_t total_rows,
                                  int64_t n, int64_t k, mg_gemm_kind kind,
                                  int64_t* offsets, int32_t* problem_shapes,
                                  void* stream);

/* ---- grouped GEMMs (bf16 / fp16 operands, fp32 accumulation) ------------
 * A grouped operand is either one contiguous [E, rows, cols] tensor (base,
 * group_stride in elements) or a device array of E pointers, each to a
 * contiguous [rows, cols] matrix (ptrs, base NULL).                        */
typedef struct mg_group_operand {
  const void* base;
  int64_t group_stride;
  const void* const* ptrs; /* device memory; used when base is NULL */
} mg_group_operand;

typedef struct mg_grouped_problem {
  int num_groups;         /* E */
  int64_t total_rows;     /* M = sum of m_splits, the static token count */
  int64_t n;              /* out_features */
  int64_t k;              /* in_features */
  const void* m_splits;   /* device, num_groups entries */
  mg_dtype splits_dtype;  /* MG_INT32 or MG_INT64 */
  mg_dtype dtype;         /* MG_BFLOAT16 or MG_FLOAT16: tokens and weights */
  int device;
  int workspace_slot;     /* MG_SLOT_FPROP_DGRAD or MG_SLOT_WGRAD */
} mg_grouped_problem;

/* Bytes of workspace `kind` needs for this problem (reserve before capture). */
MG_API mg_status mg_grouped_gemm_workspace_size(const mg_grouped_problem* p,
                                                mg_gemm_kind kind,
                                                size_t* out_bytes);

/* y[M, N] (y_dtype: bf16, fp16 or fp32) = x[M, K] . W^T (+ bias[E, N]).
 * bias has the operand dtype, or is NULL. */
MG_API mg_status mg_grouped_fprop(const mg_grouped_problem* p, const void* x,
                                  mg_group_operand weight, const void* bias,
                                  void* y, mg_dtype y_dtype, void* stream);
/* dx[M, K] (dx_dtype: bf16, fp16 or fp32) = dy[M, N] . W */
MG_API mg_status mg_grouped_dgrad(const mg_grouped_problem* p, const void* dy,
                                  mg_group_operand weight, void* dx,
                                  mg_dtype dx_dtype, void* stream);
/* dW_e[N, K] = dy_e^T . x_e, or += when accumulate != 0 (then dw_dtype is
 * usually fp32, Megatron's main_grad). A group with m_e = 0 gets zeros, or
 * is left untouched when accumulating. */
MG_API mg_status mg_grouped_wgrad(const mg_grouped_problem* p, const void* dy,
                                  const void* x, mg_group_operand dw,
                                  mg_dtype dw_dtype, int accumulate,
                                  void* stream);
/* dbias[E, N] (dbias_dtype: fp32 or the operand dtype) = per-group column
 * sums of dy[M, N]; zero for empty groups. */
MG_API mg_status mg_grouped_dbias(const mg_grouped_problem* p, const void* dy,
                                  void* dbias, mg_dtype dbias_dtype,
                                  void* stream);

/* ---- FP8 block quantization (1x128) --------------------------------------
 * Scales follow TransformerEngine's block-scaling rules: per block
 * amax' = max(amax, amax_epsilon); scale = fp8_max / amax' (1 when amax' is 0,
 * inf or NaN; FLT_MAX when the quotient overflows); with pow2_scales the
 * scale is rounded down to a power of two. Stored: fp8(x * scale) (round to
 * nearest, saturating) and scale_inv = 1 / scale.                          */
typedef struct mg_quantize_config {
  mg_dtype fp8_dtype;  /* MG_FLOAT8_E4M3 or MG_FLOAT8_E5M2 */
  int pow2_scales;     /* non-zero: power-of-two scales */
  float amax_epsilon;
} mg_quantize_config;

/* Row-wise: x[rows, cols] (bf16, fp16 or fp32) -> q[rows, cols] fp8 and
 * scale_inv[rows, ceil(cols / 128)] fp32, one scale per row per 128 columns. */
MG_API mg_status mg_quantize_rowwise_1x128(const void* x, mg_dtype x_dtype, int64_t rows,
                                           int64_t cols, mg_quantize_config config, void* q,
                                           float* scale_inv, void* stream);

/* Column-wise per group, the operand layout of a wgrad GEMM that reduces over
 * the tokens: for group e (rows [o_e, o_e + m_e) of x[rows, cols]) the
 * transposed X_e^T is quantized in 1x128 blocks along its tokens, blocks
 * restarting at the group's first row.
 *   qt[cols, rows] fp8: group e in columns [o_e, o_e + m_e);
 *   scale_inv_t[cols, scale_columns] fp32 with
 *   scale_columns = ceil(rows / 128) + num_groups: group e's blocks in
 *   columns [b_e, b_e + ceil(m_e / 128)), b_e = sum_{j<e} ceil(m_j / 128);
 *   columns past the last block are left untouched.
 * Offsets come from device m_splits (clamped like mg_grouped_setup) through
 * the (device, workspace_slot) workspace.                                  */
MG_API mg_status mg_quantize_columnwise_grouped_1x128(
    const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols, const void* m_splits,
    mg_dtype splits_dtype, int num_groups, mg_quantize_config config, void* qt,
    float* scale_inv_t, int device, int workspace_slot, void* stream);

/* ---- token permutation (MoE dispatch and combine) ------------------------
 * Token copy i = t * top_k + j is token t's j-th routing choice; there are
 * n = num_tokens * top_k copies and the permuted buffer has n rows (static).
 * row_id_map[n] (int64) gives each copy's row in the permuted buffer, -1 for
 * a copy that has none (an expert index outside [0, num_experts)). Rows are
 * ordered by (expert, copy index): a stable sort, deterministic.           */
#define MG_SLOT_PERMUTE 2 /* the workspace slot Python uses for permutation */

/* experts[num_tokens, top_k] (int32 or int64) -> row_id_map[n] and
 * m_splits[num_experts] (int64 token copies per expert). Scratch of
 * 4 * num_experts * ceil(n / 256) bytes comes from the (device,
 * workspace_slot) workspace. num_experts <= 1024.                         */
MG_API mg_status mg_permute_index(const void* experts, mg_dtype experts_dtype,
                                  int64_t num_tokens, int top_k, int num_experts,
                                  int64_t* row_id_map, int64_t* m_splits,
                                  int device, int workspace_slot, void* stream);
/* permuted[row_id_map[t * top_k + j], :] = x[t, :]. x and permuted have
 * `dtype` (fp32, fp16 or bf16), hidden columns; rows no copy maps to are
 * left untouched.                                                          */
MG_API mg_status mg_permute_rows(const void* x, mg_dtype dtype, int64_t num_tokens,
                                 int64_t hidden, int top_k, const int64_t* row_id_map,
                                 void* permuted, void* stream);
/* out[t, :] = sum_j weights[t, j] * y[row_id_map[t * top_k + j], :] summed in
 * fp32 in j order; weights [num_tokens, top_k] are fp32 or `dtype`, or NULL
 * for a plain sum (the backward of mg_permute_rows). Unmapped copies add 0. */
MG_API mg_status mg_unpermute_rows(const void* y, mg_dtype dtype, int64_t num_tokens,
                                   int64_t hidden, int top_k, const int64_t* row_id_map,
                                   const void* weights, mg_dtype weights_dtype, void* out,
                                   void* stream);
/* Backward of mg_unpermute_rows for copy (t, j) with row r:
 *   dy[r, :] = weights[t, j] * dout[t, :]   (rows no copy maps to: untouched)
 *   dweights[t, j] = <dout[t, :], y[r, :]>  (0 for unmapped copies; dweights
 *   has weights_dtype and may be NULL).                                    */
MG_API mg_status mg_unpermute_rows_backward(const void* dout, const void* y, mg_dtype dtype,
                                            int64_t num_tokens, int64_t hidden, int top_k,
                                            const int64_t* row_id_map, const void* weights,
                                            mg_dtype weights_dtype, void* dy, void* dweights,
                                            void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_GROUPED_H_ */
