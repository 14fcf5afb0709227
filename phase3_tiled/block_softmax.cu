// Phase 3, kernel 2 of 3: P = softmax(S + mask), one thread block per row.
//
// The threads of a block stride along one row together (thread t reads j = t, t + blockDim, ...:
// consecutive threads, consecutive addresses, coalesced) and combine their partial results with
// warp shuffles and shared memory (course::block_reduce_max / block_reduce_sum in common.cuh).
// Two passes over the row instead of phase 2's three:
//   1. each thread keeps a running maximum m_t and a running sum l_t = sum exp(x_j - m_t) of its
//      own elements x_j = S[i][j] + bias(i, j) (the sum is rescaled when m_t grows);
//      block max:  m = max_t m_t;  block sum:  l = sum_t l_t * exp(m_t - m)
//   2. P[i][j] = exp(x_j - m) / l
// A row whose keys are all hidden (m = -inf) is written as zeros, as utils/reference.py defines.
#include <algorithm>

#include "common.cuh"
#include "tiled_kernels.h"

namespace phase3_tiled {
namespace {

constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGrid = 1 << 30;

// No __restrict__: the attention op runs this kernel in place (p == s); each element is read and
// then written by the same thread, so in place is safe.
__global__ void __launch_bounds__(kMaxThreads)
    block_softmax_kernel(const float* s, float* p, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                         course::AttentionMasking masking) {
  static_assert(kMaxThreads % course::kWarpSize == 0 && kMaxThreads <= 1024,
                "block_reduce_* needs a whole number of warps, at most 1024 threads");
  __shared__ float scratch[kMaxThreads / course::kWarpSize];
  const int64_t rows = B * H * Sq;
  // Grid-stride over rows; `row` is the same for the whole block, so all threads reach the
  // barriers inside the block reductions.
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t i = row % Sq;
    const int64_t h = (row / Sq) % H;
    const int64_t b = row / (Sq * H);
    const float* s_row = s + row * Sk;
    float* p_row = p + row * Sk;

    // BEGIN SOLUTION: the softmax of row `row` by the whole block: the threads stride along the row together (coalesced), each keeps a running max and a running sum of exponentials rescaled when its max grows, the block combines them with the reductions of common.cuh, and a second pass writes the normalized row; a row whose keys are all hidden is all zeros (README: The concept, "The softmax")
    // Pass 1: this thread's running max m_t and rescaled running sum l_t.
    float m_t = -INFINITY, l_t = 0.0f;
    for (int64_t j = threadIdx.x; j < Sk; j += blockDim.x) {
      const float x = s_row[j] + course::mask_bias(masking, b, h, i, j);
      if (x > m_t) {
        l_t = l_t * expf(m_t - x) + 1.0f;  // exp(-inf) = 0 when m_t was still -inf
        m_t = x;
      } else if (x != -INFINITY) {
        l_t += expf(x - m_t);
      }
    }
    // Block reductions: m = max_t m_t, then l = sum_t l_t * exp(m_t - m).
    const float m = course::block_reduce_max(m_t, scratch);
    if (m == -INFINITY) {
      // Every key hidden: zeros (the test is uniform across the block: all threads see m).
      for (int64_t j = threadIdx.x; j < Sk; j += blockDim.x) p_row[j] = 0.0f;
      continue;
    }
    const float l = course::block_reduce_sum(m_t == -INFINITY ? 0.0f : l_t * expf(m_t - m), scratch);

    // Pass 2: normalize (hidden keys give exp(-inf) = 0).
    const float inv_l = 1.0f / l;
    for (int64_t j = threadIdx.x; j < Sk; j += blockDim.x)
      p_row[j] = expf(s_row[j] + course::mask_bias(masking, b, h, i, j) - m) * inv_l;
    // END SOLUTION
  }
}

}  // namespace

void launch_block_softmax(const float* s, float* p, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                          const course::AttentionMasking& masking, cudaStream_t stream) {
  // A whole number of warps, no more threads than the row has elements (at most kMaxThreads).
  const int threads = static_cast<int>(std::min<int64_t>(
      kMaxThreads, course::ceil_div<int64_t>(Sk, course::kWarpSize) * course::kWarpSize));
  const auto blocks = static_cast<unsigned>(std::min(B * H * Sq, kMaxGrid));
  block_softmax_kernel<<<blocks, threads, 0, stream>>>(s, p, B, H, Sq, Sk, masking);
}

}  // namespace phase3_tiled
