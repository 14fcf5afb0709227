// cp.async (sm_80+): asynchronous global -> shared copies that bypass registers, grouped and waited
// on in commit order. Shared by the phase 5 kernels (16-byte copies) and phase 6's SGEMM (4-byte
// copies, which may land anywhere in shared memory: the GEMM transposes its tiles with them).
#pragma once

#include <cstdint>

namespace course {

// The 32-bit shared-window address that cp.async (and ldmatrix) take.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Copies 16 bytes (L2 only: .cg), or writes 16 zero bytes when !valid (src-size 0: nothing is
// read). `src` must be a valid address either way: callers pass the tensor's start when out of range.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

// Copies 4 bytes through L1 (.ca: the rest of the sector is read by the next copies), or writes
// 4 zero bytes when !valid. Same rule for `src`.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace course
