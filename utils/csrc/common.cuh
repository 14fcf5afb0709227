// Shared helpers for every phase's CUDA code: error checks, integer helpers, warp and block
// reductions. Header-only; include it from any .cu file of the course.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

// Abort the host call with a readable message when a CUDA runtime call fails.
// In an extension prefer TORCH_CHECK / C10_CUDA_CHECK; this one is for plain CUDA code.
#define CUDA_CHECK(call)                                                                    \
  do {                                                                                      \
    cudaError_t err_ = (call);                                                              \
    if (err_ != cudaSuccess) {                                                              \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(err_), __FILE__,    \
              __LINE__, cudaGetErrorString(err_));                                          \
      abort();                                                                              \
    }                                                                                       \
  } while (0)

namespace course {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ceil(a / b) for positive integers, usable on host and device.
template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Sum of `value` over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_reduce_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

// Maximum of `value` over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_reduce_max(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

// Block-wide reduction built from warp reductions: each warp reduces, warp leaders write to
// shared memory, the first warp reduces the partials. Every thread of the block gets the result.
// `scratch` needs blockDim.x / 32 floats; blockDim.x must be a multiple of 32 (at most 1024).
// The trailing barrier lets the caller reuse `scratch` right away.
template <typename Op>
__device__ __forceinline__ float block_reduce(float value, float* scratch, Op warp_op,
                                              float identity) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  value = warp_op(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = (lane < num_warps) ? scratch[lane] : identity;
  value = warp_op(value);
  __syncthreads();
  return value;
}

__device__ __forceinline__ float block_reduce_sum(float value, float* scratch) {
  return block_reduce(value, scratch, [](float v) { return warp_reduce_sum(v); }, 0.0f);
}

__device__ __forceinline__ float block_reduce_max(float value, float* scratch) {
  return block_reduce(value, scratch, [](float v) { return warp_reduce_max(v); }, -INFINITY);
}

}  // namespace course
