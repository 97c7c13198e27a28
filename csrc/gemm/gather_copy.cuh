// The 16-byte copy that every gathered row goes through, in the CUTLASS-based
// gather mainloop and in the ping-pong fprop's producer.
#pragma once

#include <cutlass/cutlass.h>

#include <cstdint>

namespace moe_grouped::gemm {

// Copies `bytes` (16, or 0 for a zero fill) from global `src` to shared `dst`
// by cp.async, cached in L2 only (.cg). L2 hints (.L2::256B, evict_last)
// measured no different: docs/kernels.md, "Gathered mainloop".
CUTLASS_DEVICE void gather_copy16(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

}  // namespace moe_grouped::gemm
