// Phase 5, the teaching kernel: FlashAttention's forward pass in its clearest form.
//
// Dao et al. 2022, "FlashAttention", Algorithm 1 (with the FlashAttention-2 ordering: the output
// accumulator stays unnormalized and is divided by l once, at the end). Names follow the paper:
//   Q_i  : a block of Br query rows (one CUDA block, one thread per row)
//   K_j, V_j : a tile of Bc key / value rows, streamed through shared memory
//   S_ij = scale * Q_i K_j^T (+ mask),  m_i = running row max,  l_i = running row sum of exp,
//   O_i = running (unnormalized) output.
// No S x S matrix exists anywhere: each thread holds one row of S_ij (Bc floats) at a time, in
// shared memory; its output row O_i (D floats) stays in registers.
//
// Deliberately simple: one thread per query row, dot products one key at a time, expf. The fast
// kernel (fused_fast.cu) computes the same function; this one is the specification to read.
// Masking goes through course::mask_bias for every score (causal, stride, bool / additive mask),
// plus the per-batch key_lengths. Causal key tiles past the block's last row and tiles past
// key_lengths are skipped; strided attention is masked here (its cost does not fall with the
// stride: the fast kernel gathers the visible keys instead).
#include <cuda_runtime.h>
#include <math_constants.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include "attention_mask.cuh"
#include "common.cuh"
#include "fused.h"

namespace phase5 {
namespace {

constexpr int kBr = 64;  // query rows per block = threads per block
constexpr int kBc = 32;  // key / value rows per tile

template <int D>
struct TeachingSmem {
  static constexpr int kQPitch = D + 1;    // odd pitch: thread t reads row t without bank conflicts
  static constexpr int kSPitch = kBc + 1;  // the same for the rows of S_ij
  static constexpr int kFloats = kBr * kQPitch + 2 * kBc * D + kBr * kSPitch;
  static constexpr int kBytes = kFloats * 4;
};

template <int D>
__global__ void __launch_bounds__(kBr) fused_teaching_kernel(FusedParams p) {
  extern __shared__ float smem[];
  constexpr int kQPitch = TeachingSmem<D>::kQPitch;
  constexpr int kSPitch = TeachingSmem<D>::kSPitch;
  float* Qi = smem;                  // [Br][D+1]
  float* Kj = Qi + kBr * kQPitch;    // [Bc][D]
  float* Vj = Kj + kBc * D;          // [Bc][D]
  float* Sij = Vj + kBc * D;         // [Br][Bc+1]: row t is thread t's S_ij, then P~_ij

  const int64_t BH = p.B * p.H;
  const int64_t bh = blockIdx.x % BH;
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x / BH) * kBr;  // first row of Q_i
  const int tid = threadIdx.x;
  const int64_t i = i0 + tid;  // this thread's query row
  const bool row_valid = i < p.Sq;

  // Keys beyond kv_limit are padding; under causal masking no row of this block sees keys past
  // its last row, so the loop over tiles stops at kv_end.
  const int64_t kv_limit = p.key_lengths ? static_cast<int64_t>(p.key_lengths[b]) : p.Sk;
  const int64_t i_last = (i0 + kBr < p.Sq ? i0 + kBr : p.Sq) - 1;
  const int64_t kv_end = p.masking.causal && i_last + 1 < kv_limit ? i_last + 1 : kv_limit;

  // Load Q_i into shared memory (rows past Sq read as zeros).
  const float* q_head = p.q + bh * p.Sq * D;
  for (int idx = tid; idx < kBr * D; idx += kBr) {
    const int r = idx / D, d = idx % D;
    Qi[r * kQPitch + d] = (i0 + r < p.Sq) ? q_head[(i0 + r) * D + d] : 0.0f;
  }

  // Line 2 of Algorithm 1: O_i = 0, l_i = 0, m_i = -inf.
  float o[D];
#pragma unroll
  for (int d = 0; d < D; ++d) o[d] = 0.0f;
  float l = 0.0f;
  float m = -CUDART_INF_F;

  const float* k_head = p.k + bh * p.Sk * D;
  const float* v_head = p.v + bh * p.Sk * D;
  // Line 5: for each tile j of Bc keys.
  for (int64_t j0 = 0; j0 < kv_end; j0 += kBc) {
    // Line 6: load K_j, V_j from HBM to on-chip SRAM (rows past Sk read as zeros).
    __syncthreads();  // every thread is done with the previous K_j, V_j
    for (int idx = tid; idx < kBc * D; idx += kBr) {
      const int64_t key = j0 + idx / D;
      const int d = idx % D;
      Kj[idx] = key < p.Sk ? k_head[key * D + d] : 0.0f;
      Vj[idx] = key < p.Sk ? v_head[key * D + d] : 0.0f;
    }
    __syncthreads();  // K_j, V_j (and Q_i on the first tile) are visible to every thread

    if (row_valid) {
      // Line 9: S_ij = scale * Q_i K_j^T, plus the mask (-inf hides a key). This thread's row of
      // S_ij lives in shared memory (Bc floats), later overwritten by P~_ij.
      float* s_row = Sij + tid * kSPitch;
      float m_tilde = -CUDART_INF_F;  // Line 10: m~_ij = rowmax(S_ij)
      for (int c = 0; c < kBc; ++c) {
        const int64_t key = j0 + c;
        const float bias =
            key < kv_limit ? course::mask_bias(p.masking, b, h, i, key) : -CUDART_INF_F;
        float score = -CUDART_INF_F;
        if (bias != -CUDART_INF_F) {
          float dot = 0.0f;
#pragma unroll 8
          for (int d = 0; d < D; ++d) dot = fmaf(Qi[tid * kQPitch + d], Kj[c * D + d], dot);
          score = fmaf(dot, p.scale, bias);
        }
        s_row[c] = score;
        m_tilde = fmaxf(m_tilde, score);
      }

      // BEGIN SOLUTION: Lines 10-13 of Algorithm 1 for this thread's row, the online softmax: the new running max from m and this tile's m_tilde; P~, the exponentials of s_row taken against it (in place in s_row); l and o, which were summed under the old max, brought to the new one before this tile's row sum and P~ V_j are added; m updated. A row with no visible key yet must give zeros, never NaN (README: The teaching kernel)
      // Line 11: m_new = max(m_i, m~_ij). While every key so far is hidden, m_new is -inf: use 0
      // as the reference instead, so exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
      const float m_new = fmaxf(m, m_tilde);
      const float m_ref = m_new == -CUDART_INF_F ? 0.0f : m_new;

      // Line 10: P~_ij = exp(S_ij - m_new), l~_ij = rowsum(P~_ij).
      float l_tilde = 0.0f;
      for (int c = 0; c < kBc; ++c) {
        s_row[c] = expf(s_row[c] - m_ref);
        l_tilde += s_row[c];
      }

      // Line 11-12: rescale what was accumulated under the old max by exp(m_i - m_new), then add
      // this tile: l_i = e^(m_i - m_new) l_i + l~_ij,  O_i = e^(m_i - m_new) O_i + P~_ij V_j.
      const float alpha = expf(m - m_ref);
      l = fmaf(alpha, l, l_tilde);
#pragma unroll
      for (int d = 0; d < D; ++d) o[d] *= alpha;
      for (int c = 0; c < kBc; ++c) {
        const float p_c = s_row[c];
#pragma unroll
        for (int d = 0; d < D; ++d) o[d] = fmaf(p_c, Vj[c * D + d], o[d]);
      }
      // Line 13: m_i = m_new.
      m = m_new;
      // END SOLUTION
    }
  }

  // Line 15: O_i = O_i / l_i (a row with every key hidden has l_i = 0: its output is zeros), and
  // the logsumexp L_i = m_i + log(l_i) (-inf for such a row).
  if (!row_valid) return;
  // BEGIN SOLUTION: Line 15 for this thread's row: the normalized output O_i / l_i into p.o and, when p.lse is set, the row's logsumexp, with the values the comment above gives a row whose keys were all hidden (README: The teaching kernel)
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
  float* o_row = p.o + (bh * p.Sq + i) * D;
#pragma unroll
  for (int d = 0; d < D; ++d) o_row[d] = o[d] * inv_l;
  if (p.lse != nullptr) p.lse[bh * p.Sq + i] = l > 0.0f ? m + logf(l) : -CUDART_INF_F;
  // END SOLUTION
}

template <int D>
void launch_teaching_d(const FusedParams& p, cudaStream_t stream) {
  constexpr int kBytes = TeachingSmem<D>::kBytes;
  auto kernel = fused_teaching_kernel<D>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  const int64_t blocks = course::ceil_div<int64_t>(p.Sq, kBr) * p.B * p.H;
  TORCH_CHECK(blocks <= 0x7fffffff, "q: too many query blocks (B*H*ceil(Sq/64)) for one grid");
  kernel<<<static_cast<unsigned>(blocks), kBr, kBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_teaching(const FusedParams& p, int D, cudaStream_t stream) {
  switch (D) {
    case 32: return launch_teaching_d<32>(p, stream);
    case 64: return launch_teaching_d<64>(p, stream);
    case 80: return launch_teaching_d<80>(p, stream);
    case 96: return launch_teaching_d<96>(p, stream);
    case 128: return launch_teaching_d<128>(p, stream);
    default: TORCH_CHECK(false, "q: head dim D=", D, " is not supported (32, 64, 80, 96, 128)");
  }
}

}  // namespace phase5
