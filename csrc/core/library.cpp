// Library-level entry points: version, build description, capabilities.
#include <cuda_runtime.h>

#include <string>

#include "error.h"

#ifndef MG_VERSION
#define MG_VERSION "unknown"
#endif
#ifndef MG_CUDA_ARCHS
#define MG_CUDA_ARCHS "unknown"
#endif

namespace {

uint32_t capabilities() {
  uint32_t caps = MG_CAP_SETUP;
#ifdef MG_HAVE_GROUPED_GEMM_16BIT
  caps |= MG_CAP_GROUPED_GEMM_16BIT | MG_CAP_GATHERED_GEMM | MG_CAP_DGRAD_SWIGLU;
#endif
#ifdef MG_HAVE_GROUPED_GEMM_FP8_BLOCKWISE
  caps |= MG_CAP_GROUPED_GEMM_FP8_BLOCKWISE;
#endif
#ifdef MG_HAVE_PERMUTE
  caps |= MG_CAP_PERMUTE;
#endif
#ifdef MG_HAVE_FP8_QUANTIZE
  caps |= MG_CAP_FP8_QUANTIZE;
#endif
#ifdef MG_HAVE_SWIGLU
  caps |= MG_CAP_SWIGLU;
#endif
#if defined(MG_HAVE_GROUPED_GEMM_16BIT) && defined(MG_HAVE_SWIGLU)
  caps |= MG_CAP_FPROP_SWIGLU;
#endif
#ifdef MG_HAVE_EP_TRANSPORT
  caps |= MG_CAP_EP_TRANSPORT;
#endif
#ifdef MG_HAVE_EXPERTS_SEQUENCE
  caps |= MG_CAP_EXPERTS_SEQUENCE;
#endif
#ifdef MG_HAVE_EXPERTS_SEQUENCE_FP8
  caps |= MG_CAP_EXPERTS_SEQUENCE_FP8;
#endif
  return caps;
}

std::string describe() {
  std::string info = "moe_grouped core " MG_VERSION "; CUDA runtime ";
  info += std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  info += "; archs " MG_CUDA_ARCHS "; kernels: setup";
  uint32_t caps = capabilities();
  if (caps & MG_CAP_GROUPED_GEMM_16BIT) info += ", grouped_gemm_bf16_fp16";
  if (caps & MG_CAP_GATHERED_GEMM) info += ", gathered_gemm_bf16";
  if (caps & MG_CAP_GROUPED_GEMM_FP8_BLOCKWISE) info += ", grouped_gemm_fp8_blockwise";
  if (caps & MG_CAP_PERMUTE) info += ", permute";
  if (caps & MG_CAP_FP8_QUANTIZE) info += ", fp8_quantize";
  if (caps & MG_CAP_SWIGLU) info += ", swiglu";
  if (caps & MG_CAP_FPROP_SWIGLU) info += ", fprop_swiglu_bf16";
  if (caps & MG_CAP_EP_TRANSPORT) info += ", ep_transport";
  if (caps & MG_CAP_EXPERTS_SEQUENCE) info += ", experts_sequence";
  if (caps & MG_CAP_EXPERTS_SEQUENCE_FP8) info += ", experts_sequence_fp8";
  return info;
}

}  // namespace

extern "C" {

int mg_abi_version(void) { return MG_ABI_VERSION; }

const char* mg_build_info(void) {
  static const std::string info = describe();
  return info.c_str();
}

uint32_t mg_capabilities(void) { return capabilities(); }

}  // extern "C"
