// Arrival counters that are already zero, without a memset before every launch. Host code for the
// course's torch extensions.
//
// A kernel whose CTAs count themselves on a counter, the last to arrive doing a final step (the
// Hopper lesson's v7 merges a split tile that way), needs its counters at zero when it starts.
// Zeroing them on every call costs a memset on the stream before the kernel. Instead each (device,
// stream) keeps one buffer, zeroed once when it is allocated, under a contract: every kernel that
// counts on it leaves each counter it touched at zero when it ends (the last arrival resets its
// counter). Calls on one stream run in order, so each finds zeros; calls on different streams get
// different buffers. While the stream is being captured into a CUDA graph nothing runs, so a
// captured call gets its own zeroed counters (a memset node in the graph) instead.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace course {

// At least `count` int32 counters at zero for a kernel launched on `stream` of `device` (the current
// stream, which any allocation here is ordered on). Keep the tensor alive until the launch.
inline at::Tensor zeroed_counters(int64_t count, int device, cudaStream_t stream) {
  const auto options = at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return at::zeros({count}, options);
  static std::mutex mutex;
  // Never destroyed: the buffers outlive the process's last call, and freeing device memory while
  // the CUDA runtime shuts down fails.
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& buffer = (*buffers)[{device, stream}];
  if (!buffer.defined() || buffer.numel() < count) buffer = at::zeros({count}, options);
  return buffer;
}

}  // namespace course
