// The 16-byte copy that every gathered row goes through, in the CUTLASS-based
// gather mainloop and in the ping-pong fprop's producer.
#pragma once

#include <cutlass/cutlass.h>

#include <cstdint>

namespace moe_grouped::gemm {

// Copies `bytes` (16, or 0 for a zero fill) from global `src` to shared `dst`
// by cp.async, cached in L2 only (.cg). L2 hints measured no different (H100,
// 2026-11-27, the gathered fc1/fc2 GEMMs and fused fc1+SwiGLU, Qwen3- and
// OLMoE-like, one process per build, two rounds, bitwise equal): the .L2::256B
// prefetch size, an evict_last policy, or both, all within the rounds' spread
// of today's copy (fc1 wgrad 0.67-0.75x of the plain kernel in every build, fc2
// wgrad 0.78-0.82x).
CUTLASS_DEVICE void gather_copy16(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

}  // namespace moe_grouped::gemm
