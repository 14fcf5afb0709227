// Phase 2, kernel 2 of 3: P = softmax(S + mask) row by row, one thread per row, no shared memory.
//
// Thread r owns row r = (b, h, i) and makes three passes over its Sk scores:
//   1. m = max_j (S[i][j] + bias(i, j))          bias: 0, -inf (causal / bool mask) or additive
//   2. l = sum_j exp(S[i][j] + bias(i, j) - m)
//   3. P[i][j] = exp(S[i][j] + bias(i, j) - m) / l
// A row whose keys are all hidden (m = -inf) is written as zeros, as utils/reference.py defines.
// Consecutive threads of a warp own consecutive rows, Sk floats apart: every load of the warp
// touches 32 different cache lines, and the row is read three times.
#include "common.cuh"
#include "naive_kernels.h"

namespace phase2_naive {
namespace {

constexpr int kThreads = 256;

// No __restrict__: the attention op runs this kernel in place (p == s).
__global__ void naive_softmax_kernel(const float* s, float* p, int64_t B, int64_t H, int64_t Sq,
                                     int64_t Sk, course::AttentionMasking masking) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= B * H * Sq) return;
  const int64_t i = row % Sq;
  const int64_t h = (row / Sq) % H;
  const int64_t b = row / (Sq * H);
  const float* s_row = s + row * Sk;
  float* p_row = p + row * Sk;

  // BEGIN SOLUTION: the softmax of this thread's whole row of masked scores (the mask through course::mask_bias), in three passes over the row: its maximum, the sum of the exponentials shifted by it, the normalized row; a row whose keys are all hidden is all zeros, as utils/reference.py defines (README: The concept)
  // Pass 1: the row maximum m of the masked scores.
  float m = -INFINITY;
  for (int64_t j = 0; j < Sk; ++j) m = fmaxf(m, s_row[j] + course::mask_bias(masking, b, h, i, j));

  // Every key hidden: the output row is zeros (no exp(-inf - -inf) = NaN).
  if (m == -INFINITY) {
    for (int64_t j = 0; j < Sk; ++j) p_row[j] = 0.0f;
    return;
  }

  // Pass 2: the normalizer l = sum_j exp(x_j - m).
  float l = 0.0f;
  for (int64_t j = 0; j < Sk; ++j) l += expf(s_row[j] + course::mask_bias(masking, b, h, i, j) - m);

  // Pass 3: P = exp(x_j - m) / l (hidden keys give exp(-inf) = 0).
  const float inv_l = 1.0f / l;
  for (int64_t j = 0; j < Sk; ++j)
    p_row[j] = expf(s_row[j] + course::mask_bias(masking, b, h, i, j) - m) * inv_l;
  // END SOLUTION
}

}  // namespace

void launch_naive_softmax(const float* s, float* p, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                          const course::AttentionMasking& masking, cudaStream_t stream) {
  const int64_t rows = B * H * Sq;
  const auto blocks = static_cast<unsigned>(course::ceil_div<int64_t>(rows, kThreads));
  naive_softmax_kernel<<<blocks, kThreads, 0, stream>>>(s, p, B, H, Sq, Sk, masking);
}

}  // namespace phase2_naive
