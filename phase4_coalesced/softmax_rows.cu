// Phase 4's row softmax: P[row, :] = softmax(S[row, :] + bias), the row held in registers.
//
// Versions (the launcher picks by row length Sk):
//   softmax_rows_kernel<32, kItems>     a warp per row, 8 rows per block, Sk <= 1024: the row's
//                                       max and sum are warp-shuffle reductions, no shared memory.
//   softmax_rows_kernel<256|512, kItems> a block per row, Sk <= 32768: warp shuffles, then one
//                                       shared-memory exchange between warps per reduction.
//   softmax_stream_kernel               Sk > 32768: a block per row that streams the row twice
//                                       (online max and sum, then the write).
// What changed since phase 3: each row is read from DRAM exactly once (float4, lane-consecutive:
// a warp reads 512 contiguous bytes per instruction), kept in registers through the max, the
// exponentials and the sum, and written once; hidden entries (causal j > i) are never read.
// The scalar path (Sk not a multiple of 4) reads one float per access, still lane-consecutive.
#include <cuda_runtime.h>
#include <math_constants.h>

#include "coalesced_kernels.h"
#include "common.cuh"

namespace phase4_coalesced {
namespace {

constexpr int kRowsPerWarpBlock = 8;  // rows per block in the warp-per-row version (256 threads)

// Max (then sum) over the threads that share a row: the warp, or the block.
template <int kThreads>
__device__ __forceinline__ float row_max(float v, float* scratch) {
  if constexpr (kThreads == course::kWarpSize) return course::warp_reduce_max(v);
  else return course::block_reduce_max(v, scratch);
}
template <int kThreads>
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  if constexpr (kThreads == course::kWarpSize) return course::warp_reduce_sum(v);
  else return course::block_reduce_sum(v, scratch);
}

// kThreads threads share a row; each holds kItems * 4 of its entries in registers (as kItems
// float4 when kVec, else 4 * kItems floats), so a row of up to kThreads * kItems * 4 fits.
template <int kThreads, int kItems, bool kVec>
__global__ void __launch_bounds__(kThreads == course::kWarpSize ? kThreads * kRowsPerWarpBlock : kThreads)
    softmax_rows_kernel(const float* S, float* P, int64_t rows, int64_t Sq, int64_t Sk, int64_t H,
                        course::AttentionMasking masking) {
  static_assert(kThreads % course::kWarpSize == 0 && kThreads <= 1024,
                "a row is shared by whole warps of one block");
  constexpr bool kWarpPerRow = kThreads == course::kWarpSize;
  constexpr int kRowsPerBlock = kWarpPerRow ? kRowsPerWarpBlock : 1;
  constexpr int W = kVec ? 4 : 1;             // floats per access
  constexpr int kSlots = kItems * 4 / W;      // accesses per thread
  __shared__ float scratch[kThreads / course::kWarpSize];

  const int lane = threadIdx.x % kThreads;  // the thread's place in its row
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreads;
  if (row >= rows) return;  // only whole warps of the warp-per-row version leave here
  const int64_t bh = row / Sq, i = row - bh * Sq, b = bh / H, h = bh - b * H;
  const float* s = S + row * Sk;
  float* p = P + row * Sk;

  // BEGIN SOLUTION: this row's softmax with the row read from global memory once, into this thread's registers: lane-consecutive accesses (float4 when kVec) so every warp request is coalesced, the mask bias added, entries the causal mask hides not read; the row's max and sum through row_max and row_sum; P written once, with the same access pattern; a row whose keys are all hidden is all zeros (README: The concept, softmax)
  // Step 1: read the row once, coalesced (access t of lane l covers entries (l + t*kThreads)*W..),
  // add the mask bias (-inf where hidden, hidden entries not read) and keep the running max m.
  float x[kSlots][W];
  float m = -CUDART_INF_F;
#pragma unroll
  for (int t = 0; t < kSlots; ++t) {
    const int64_t j0 = static_cast<int64_t>(lane + t * kThreads) * W;
    const bool load = j0 < Sk && !(masking.causal && j0 > i);
    float v[W];
    if constexpr (kVec) {
      const float4 f = load ? *reinterpret_cast<const float4*>(s + j0) : make_float4(0.f, 0.f, 0.f, 0.f);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      v[0] = load ? s[j0] : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const float bias = load ? course::mask_bias(masking, b, h, i, j0 + e) : -CUDART_INF_F;
      x[t][e] = bias == -CUDART_INF_F ? -CUDART_INF_F : v[e] + bias;
      m = fmaxf(m, x[t][e]);
    }
  }
  m = row_max<kThreads>(m, scratch);
  // A row with every key hidden has m = -inf: use 0 so every exp below is exp(-inf) = 0.
  if (m == -CUDART_INF_F) m = 0.0f;

  // Step 2: x <- exp(x - m) and the row sum l.
  float l = 0.0f;
#pragma unroll
  for (int t = 0; t < kSlots; ++t)
#pragma unroll
    for (int e = 0; e < W; ++e) {
      x[t][e] = expf(x[t][e] - m);
      l += x[t][e];
    }
  l = row_sum<kThreads>(l, scratch);
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // 0 for a fully hidden row: it gives zeros

  // Step 3: write P = x / l once, with the same coalesced float4 pattern.
#pragma unroll
  for (int t = 0; t < kSlots; ++t) {
    const int64_t j0 = static_cast<int64_t>(lane + t * kThreads) * W;
    if (j0 >= Sk) continue;
    if constexpr (kVec) {
      *reinterpret_cast<float4*>(p + j0) =
          make_float4(x[t][0] * inv_l, x[t][1] * inv_l, x[t][2] * inv_l, x[t][3] * inv_l);
    } else {
      p[j0] = x[t][0] * inv_l;
    }
  }
  // END SOLUTION
}

constexpr int kStreamThreads = 512;

// Rows longer than any register version holds: pass 1 keeps a per-thread online (max, sum),
// the block combines them, pass 2 re-reads the row and writes it. Scalar, lane-consecutive.
__global__ void __launch_bounds__(kStreamThreads)
    softmax_stream_kernel(const float* S, float* P, int64_t Sq, int64_t Sk, int64_t H,
                          course::AttentionMasking masking) {
  __shared__ float scratch[kStreamThreads / course::kWarpSize];
  const int64_t row = blockIdx.x;
  const int64_t bh = row / Sq, i = row - bh * Sq, b = bh / H, h = bh - b * H;
  const float* s = S + row * Sk;
  float* p = P + row * Sk;
  auto value = [&](int64_t j) {
    const float bias = course::mask_bias(masking, b, h, i, j);
    return bias == -CUDART_INF_F ? -CUDART_INF_F : s[j] + bias;
  };

  // BEGIN SOLUTION: a row too long for registers: the block strides along it, each thread keeping a running max and a running sum of exponentials rescaled when its max grows (value(j) has the mask), the block combines them, and a second pass writes P; a row whose keys are all hidden is all zeros (README: The concept, softmax)
  // Pass 1: online max m and sum l of exp(x - m) over this thread's entries.
  float m = -CUDART_INF_F, l = 0.0f;
  for (int64_t j = threadIdx.x; j < Sk; j += kStreamThreads) {
    const float x = value(j);
    if (x == -CUDART_INF_F) continue;
    if (x > m) {
      l = l * expf(m - x) + 1.0f;
      m = x;
    } else {
      l += expf(x - m);
    }
  }
  // Combine: the row max M, then l = sum of l_t * exp(m_t - M).
  float row_m = course::block_reduce_max(m, scratch);
  if (row_m == -CUDART_INF_F) row_m = 0.0f;  // fully hidden row: every term below is 0
  l = course::block_reduce_sum(m == -CUDART_INF_F ? 0.0f : l * expf(m - row_m), scratch);
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;

  // Pass 2: write P.
  for (int64_t j = threadIdx.x; j < Sk; j += kStreamThreads) p[j] = expf(value(j) - row_m) * inv_l;
  // END SOLUTION
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int kThreads, int kItems>
void launch_rows(const float* s, float* p, int64_t rows, int64_t Sq, int64_t Sk, int64_t H,
                 const course::AttentionMasking& masking, bool vec, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kThreads == course::kWarpSize ? kRowsPerWarpBlock : 1;
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(rows, kRowsPerBlock)));
  const int threads = kThreads * kRowsPerBlock;
  if (vec)
    softmax_rows_kernel<kThreads, kItems, true><<<grid, threads, 0, stream>>>(s, p, rows, Sq, Sk, H, masking);
  else
    softmax_rows_kernel<kThreads, kItems, false><<<grid, threads, 0, stream>>>(s, p, rows, Sq, Sk, H, masking);
}

}  // namespace

void launch_softmax(const float* s, float* p, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                    const course::AttentionMasking& masking, cudaStream_t stream) {
  const int64_t rows = B * H * Sq;
  const bool vec = Sk % 4 == 0 && aligned16(s) && aligned16(p);
  // The smallest version whose registers hold the row (capacity kThreads * kItems * 4).
  if (Sk <= 128) launch_rows<32, 1>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else if (Sk <= 256) launch_rows<32, 2>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else if (Sk <= 512) launch_rows<32, 4>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else if (Sk <= 1024) launch_rows<32, 8>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else if (Sk <= 2048) launch_rows<256, 2>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else if (Sk <= 4096) launch_rows<256, 4>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else if (Sk <= 8192) launch_rows<256, 8>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else if (Sk <= 16384) launch_rows<512, 8>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else if (Sk <= 32768) launch_rows<512, 16>(s, p, rows, Sq, Sk, H, masking, vec, stream);
  else softmax_stream_kernel<<<static_cast<unsigned>(rows), kStreamThreads, 0, stream>>>(s, p, Sq, Sk, H, masking);
}

}  // namespace phase4_coalesced
