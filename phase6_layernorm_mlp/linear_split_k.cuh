// Split-K, shared by linear.cu's staged kernel and linear_tf32x3.cu. With a grid of less than one
// wave of blocks (a few hundred rows: M / 128 x N / 128 blocks), each block would walk all of K
// while most SMs idle. plan_split_k then cuts the k-tiles into gridDim.z ranges; each block writes
// its raw partial tile to a workspace and linear_split_reduce_kernel sums the ranges and applies
// the epilogue.
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>

#include "common.cuh"
#include "gelu.cuh"
#include "launchers.h"

namespace phase6 {
namespace {  // each .cu file that includes this gets its own copy of the kernel

// Split-K's second step: C = act(sum of the splits' partials + bias) + residual, elementwise.
template <Activation ACT>
__global__ void linear_split_reduce_kernel(const float* __restrict__ partials, int splits,
                                           const float* __restrict__ bias, const float* __restrict__ residual,
                                           float* __restrict__ C, int64_t M, int64_t N) {
  const int64_t size = M * N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < size;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = bias != nullptr ? bias[i % N] : 0.0f;
    for (int s = 0; s < splits; ++s) v += partials[s * size + i];
    v = activate<ACT>(v);
    if (residual != nullptr) v += residual[i];
    C[i] = v;
  }
}

}  // namespace

// Split-K count: a grid of fewer blocks than one wave (blocks_per_sm per SM) leaves SMs idle
// while each block walks all of K. Double the splits while the grid still fits one wave and each
// split keeps kMinTilesPerSplit k-tiles.
constexpr int64_t kMinTilesPerSplit = 8;
constexpr int kMaxSplits = 32;

// One launch's split: gridDim.z ranges of tiles_per_split k-tiles (none empty), and the workspace
// of their partial sums (undefined when unsplit).
struct SplitK {
  int64_t tiles_per_split;
  at::Tensor partials;  // [grid.z, M, N] FP32
  bool split() const { return partials.defined(); }
  float* workspace() const { return split() ? partials.data_ptr<float>() : nullptr; }
};

// Sets grid.z to the number of splits for `tiles` k-tiles (left alone when unsplit) and allocates
// the workspace: grid.z slices of M x N floats from the caching allocator, on the current stream
// (freed after the launches; reused only by work queued after them).
inline SplitK plan_split_k(dim3& grid, int64_t tiles, int blocks_per_sm, const LinearArgs& p) {
  const int64_t slots = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y;
  int splits = 1;
  while (splits < kMaxSplits && blocks * splits * 2 <= slots && tiles >= 2 * splits * kMinTilesPerSplit) splits *= 2;
  if (splits == 1) return {tiles, at::Tensor()};
  const int64_t tiles_per_split = course::ceil_div<int64_t>(tiles, splits);
  grid.z = static_cast<unsigned>(course::ceil_div<int64_t>(tiles, tiles_per_split));
  return {tiles_per_split,
          at::empty({static_cast<int64_t>(grid.z), p.M, p.N},
                    at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()))};
}

// After the split kernel: C from the partial sums of every split, with the epilogue.
template <Activation ACT>
void reduce_split_k(const SplitK& s, const LinearArgs& p) {
  const int64_t blocks = std::min<int64_t>(course::ceil_div<int64_t>(p.M * p.N, 256), 65535);
  linear_split_reduce_kernel<ACT><<<static_cast<unsigned>(blocks), 256, 0, p.stream>>>(
      s.workspace(), static_cast<int>(s.partials.size(0)), p.bias, p.residual, p.C, p.M, p.N);
}

}  // namespace phase6
