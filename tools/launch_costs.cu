// Usage: nvcc -O2 -std=c++17 -arch=sm_90a -o .devbuild/launch_costs tools/launch_costs.cu (here), then on
//        the GPU machine (carry .devbuild/launch_costs): .devbuild/launch_costs [calls per round]
// The host cost of the CUDA calls a core entry point makes (launches, memsets, the device guard's
// queries, a tensor map encode), µs per call, on the calling thread and on a second thread (autograd
// runs a backward on its own device thread). docs/host-overhead.md has a run.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

namespace {

__global__ void empty_kernel(int) {}
__global__ void __cluster_dims__(1, 2, 1) empty_cluster_kernel(int) {}

struct Params {  // a CUTLASS-sized kernel parameter block (a few hundred bytes)
  char bytes[640];
};
__global__ void big_params_kernel(Params) {}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median over rounds of the per-call host time of `call`, issued `calls` times per round; the stream
// is drained between rounds so that the launch queue never fills.
double per_call_us(const std::function<void()>& call, int calls, cudaStream_t stream) {
  std::vector<double> rounds;
  for (int r = 0; r < 9; ++r) {
    cudaStreamSynchronize(stream);
    const double start = now_us();
    for (int i = 0; i < calls; ++i) call();
    rounds.push_back((now_us() - start) / calls);
  }
  cudaStreamSynchronize(stream);
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

void measure(const char* thread_name, int calls, void* device_buffer, cudaStream_t stream, EncodeTiled encode) {
  struct Case {
    const char* name;
    std::function<void()> call;
  };
  int device = 0;
  cudaPointerAttributes attributes{};
  Params params{};
  CUtensorMap map{};
  const cuuint64_t dims[2] = {4096, 8192};
  const cuuint64_t strides[1] = {4096 * 2};
  const cuuint32_t box[2] = {64, 128};
  const cuuint32_t elem_strides[2] = {1, 1};
  const std::vector<Case> cases = {
      {"cudaGetDevice", [&] { cudaGetDevice(&device); }},
      {"cudaSetDevice (same device)", [&] { cudaSetDevice(0); }},
      {"cudaPointerGetAttributes", [&] { cudaPointerGetAttributes(&attributes, device_buffer); }},
      {"cudaThreadExchangeStreamCaptureMode x2",
       [&] {
         cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
         cudaThreadExchangeStreamCaptureMode(&mode);
         cudaThreadExchangeStreamCaptureMode(&mode);
       }},
      {"cudaGetLastError", [&] { cudaGetLastError(); }},
      {"empty kernel <<<1, 32>>>", [&] { empty_kernel<<<1, 32, 0, stream>>>(0); }},
      {"kernel with a 640-byte parameter block", [&] { big_params_kernel<<<132, 384, 0, stream>>>(params); }},
      {"cudaLaunchKernelEx, cluster 1x2",
       [&] {
         cudaLaunchConfig_t config{};
         config.gridDim = dim3(1, 2, 1);
         config.blockDim = dim3(32);
         config.stream = stream;
         cudaLaunchKernelEx(&config, empty_cluster_kernel, 0);
       }},
      {"cudaMemsetAsync 4 KB", [&] { cudaMemsetAsync(device_buffer, 0, 4096, stream); }},
      {"cuTensorMapEncodeTiled (bf16, 2-D)",
       [&] {
         encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, device_buffer, dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
       }},
  };
  for (const Case& c : cases) {
    std::printf("%-8s %-42s %7.2f us\n", thread_name, c.name, per_call_us(c.call, calls, stream));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int calls = argc > 1 ? std::atoi(argv[1]) : 400;
  void* buffer = nullptr;
  if (cudaMalloc(&buffer, 64 << 20) != cudaSuccess) {
    std::printf("no GPU\n");
    return 1;
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found{};
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found);
  auto encode = reinterpret_cast<EncodeTiled>(entry);
  measure("caller", calls, buffer, stream, encode);  // warms everything up first
  measure("caller", calls, buffer, stream, encode);
  std::thread other([&] {
    cudaSetDevice(0);
    measure("thread", calls, buffer, stream, encode);
  });
  other.join();
  return 0;
}
