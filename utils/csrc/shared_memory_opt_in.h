// Dynamic shared memory above 48 KB per block: a kernel must opt in (cudaFuncSetAttribute) on each
// device before its first launch there. Host code for the course's torch extensions.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <atomic>
#include <cstdint>

namespace course {

// Opt kKernel in to `bytes` of dynamic shared memory on `device` (the current one), once: a flag per
// kernel and device (devices past 63 opt in on every call). Call it before every launch.
template <auto kKernel>
void opt_in_shared_memory(int device, int bytes) {
  static std::atomic<uint64_t> opted_in{0};  // bit d: done on device d
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit == 0 || (opted_in.load() & bit) == 0) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    opted_in.fetch_or(bit);
  }
}

}  // namespace course
