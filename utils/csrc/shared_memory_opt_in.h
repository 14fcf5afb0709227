// Dynamic shared memory above 48 KB per block: a kernel must opt in (cudaFuncSetAttribute) on each
// device before its first launch there. Host code for the course's torch extensions.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>

namespace course {

// The most dynamic shared memory a block may opt in to on every GPU the course's kernels run on:
// 99 KiB on sm_86 and sm_89 (sm_80 allows 163 KiB, sm_90 227 KiB).
constexpr int kSmemPerBlockEverywhere = 101376;

// The most dynamic shared memory a block may opt in to on `device`, asked once per device (devices
// past 63 are asked on every call): a launcher that has tiles of several sizes picks the largest
// that fits.
inline int shared_memory_per_block(int device) {
  static std::atomic<int> known[64] = {};  // 0: not asked yet
  if (device < 64 && known[device].load() > 0) return known[device].load();
  int limit = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (device < 64) known[device].store(limit);
  return limit;
}

// Opt kKernel in to `bytes` of dynamic shared memory on `device` (the current one), once: a flag per
// kernel and device (devices past 63 opt in on every call). Call it before every launch. A device
// that allows a block less than `bytes` gets a clear error, not the driver's "invalid argument".
template <auto kKernel>
void opt_in_shared_memory(int device, int bytes) {
  static std::atomic<uint64_t> opted_in{0};  // bit d: done on device d
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit == 0 || (opted_in.load() & bit) == 0) {
    const int limit = shared_memory_per_block(device);
    TORCH_CHECK(bytes <= limit, "this kernel's tiles need ", bytes, " bytes of shared memory per block, but GPU ",
                device, " allows at most ", limit, ": use a smaller tile configuration (or head dim)");
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    opted_in.fetch_or(bit);
  }
}

}  // namespace course
