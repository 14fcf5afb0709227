// Phase 5, FP32 fused attention, version 4 of 6: version 3 plus exp2 with the softmax scale folded
// in, and per-thread partial row sums.
//
// The versions of this lesson, each one idea further than the one before (README.md, "Versions";
// `diff` two neighbours to see the idea):
//   v1 fused_teaching.cu           one thread per query row, Algorithm 1 as written: the reference
//   v2 fused_v2_register_tiles.cu  register tiles of S and O, float4 Q K^T from padded rows: each
//                                  shared-memory load feeds TM or TN FMAs instead of one
//   v3 fused_v3_cp_async.cu        cp.async, K and V double-buffered: the loads overlap the math
//   v4 fused_v4_exp2.cu            exp2f with the scale folded into log2(e), per-thread partial row
//                                  sums: fewer instructions per score
//   v5 fused_fast.cu               a mask-free branch for the tiles that need no mask, strided keys
//                                  gathered, heaviest query blocks first
//   v6 fused_v6_tf32x3.cu          both matmuls on tensor cores in 3xTF32 (mma.sync m16n8k8): a new
//                                  structure, warp fragments instead of register tiles
//
// What this version adds (ideas 4 and 5 of fused_fast.cu's header):
//   4. exp2f with the softmax scale folded into log2(e): x = s * scale * log2(e) is one FMUL (one
//      FFMA with the mask's bias), and exp(s*scale - m) = exp2(x - m') with m' the running max in
//      log2 units: one MUFU.EX2, where expf also multiplies by log2(e) first.
//   5. The row sum l stays a per-thread partial (each of the 16 threads of a row sums its own
//      columns): the 16 partials are added once, after the last tile, not once per tile.
// Everything else is version 3's: 16 x 16 threads, TM x TN scores per thread, cp.async with K and
// V double-buffered, every score masked through course::mask_bias (causal, stride, the user's
// mask), key tiles past the block's last causal row or past key_lengths[b] skipped.
//
// The pieces versions 2-5 share are in fused_tiles.cuh: the tile configuration (one per D for
// this version: with_version_tiles), the loaders, the Q K^T and P V products, the launch.
#include <cuda_runtime.h>
#include <math_constants.h>

#include "attention_mask.cuh"
#include "common.cuh"
#include "cp_async.cuh"
#include "fused.h"
#include "fused_tiles.cuh"

namespace phase5 {
namespace {

// ------------------------------------------------------------------------------------------------
// The kernel. Grid: one block per (query block, batch*head), query blocks in order.

template <typename Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) fused_v4_kernel(FusedParams p) {
  constexpr int D = Cfg::D, Br = Cfg::Br, Bc = Cfg::Bc, TM = Cfg::TM, TN = Cfg::TN;
  constexpr int VW = Cfg::VW, OC = Cfg::OC, LDQ = Cfg::LDQ;

  extern __shared__ float4 smem_f4[];
  float* Qs = reinterpret_cast<float*>(smem_f4);  // [Br][LDQ]  Q_i
  float* Ks = Qs + Br * LDQ;                      // [Bc][LDQ]  K_j
  float* Vs = Ks + Bc * LDQ;                      // [Bc][LDQ]  V_j
  float* Ps = Vs + Bc * LDQ;                      // [Br][LDP]  P_ij = exp(S_ij - m_i)

  const int tx = threadIdx.x % kTX;
  const int ty = threadIdx.x / kTX;

  // Which query block and head.
  const int64_t BH = p.B * p.H;
  const int64_t bh = blockIdx.x % BH;
  const int64_t qblock = static_cast<int64_t>(blockIdx.x) / BH;
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qblock * Br;

  const float* q_head = p.q + bh * p.Sq * D;
  const float* k_head = p.k + bh * p.Sk * D;
  const float* v_head = p.v + bh * p.Sk * D;

  // The keys this block can see: j < kv_limit (padding) and, under causal masking, j <= its last
  // row, so the loop over tiles stops at kv_end. Stride and the user's mask are masked per score.
  const int64_t kv_limit =
      p.key_lengths ? static_cast<int64_t>(p.key_lengths[b]) : p.Sk;  // clamped on the host
  const int64_t i_last = (i0 + Br < p.Sq ? i0 + Br : p.Sq) - 1;
  const int64_t kv_end = p.masking.causal && i_last + 1 < kv_limit ? i_last + 1 : kv_limit;
  const int64_t n_tiles = course::ceil_div<int64_t>(kv_end, Bc);
  const float scale_log2 = p.scale * kLog2e;

  // Per-thread state: O accumulators (unnormalized), running max m (log2 units), partial sum l.
  float o[TM][OC * VW];
  float m[TM], l[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < OC * VW; ++c) o[i][c] = 0.0f;
  }

  if (n_tiles > 0) {
    // Prologue: Q_i and K_0 in one group.
    load_rows_async<D, Br, LDQ>(Qs, q_head, i0, 1, p.Sq);
    load_rows_async<D, Bc, LDQ>(Ks, k_head, 0, 1, kv_end);
    course::cp_async_commit();
  }

  for (int64_t tile = 0; tile < n_tiles; ++tile) {
    const int64_t t0 = tile * Bc;  // first key of this tile

    // Step 1: K_j (and Q_i) landed; every thread has finished P_{j-1} V_{j-1}, so V and P are free.
    course::cp_async_wait<0>();
    __syncthreads();
    // Step 2: start V_j; it lands while S_j and its softmax are computed.
    load_rows_async<D, Bc, LDQ>(Vs, v_head, t0, 1, kv_end);
    course::cp_async_commit();

    // Step 3: S_ij = Q_i K_j^T, TM x TN per thread, float4 steps along D.
    float s[TM][TN];
    float4 kf[TN];  // one step's K_j operands (the kernel owns its register arrays)
    qk_tile<Cfg>(s, kf, Qs, Ks, tx, ty);

    // Step 4: scale into log2 units and mask every score: -inf for rows past Sq, keys past
    // kv_limit, and whatever course::mask_bias hides (causal, stride, the user's mask).
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int64_t row = i0 + ty + kTY * i;
#pragma unroll
      for (int n = 0; n < TN; ++n) {
        const int64_t key = t0 + tx + kTX * n;
        float x = -CUDART_INF_F;
        if (row < p.Sq && key < kv_limit) {
          const float bias = course::mask_bias(p.masking, b, h, row, key);
          if (bias != -CUDART_INF_F) x = fmaf(s[i][n], scale_log2, bias * kLog2e);
        }
        s[i][n] = x;
      }
    }

    // BEGIN SOLUTION: Port of fused_teaching.cu's online-softmax TODO (Lines 10-13) as Step 5 here, once the teaching kernel's tests pass: for this thread's TM rows, with the scores in log2 units (exp2f), a row's max shared by the kTX threads of the row (shuffles), and l kept as a per-thread partial sum (idea 5 above) (README: Versions)
    // Step 5: online softmax per row. m_new = max(m, rowmax(S_ij)); P = exp2(S_ij - m_new);
    // the old O and l are rescaled by alpha = exp2(m - m_new).
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float row_max = s[i][0];
#pragma unroll
      for (int n = 1; n < TN; ++n) row_max = fmaxf(row_max, s[i][n]);
#pragma unroll
      for (int offset = kTX / 2; offset > 0; offset >>= 1)  // the 16 threads of this row
        row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, offset));
      const float m_new = fmaxf(m[i], row_max);
      const float m_use = m_new == -CUDART_INF_F ? 0.0f : m_new;  // all hidden so far: no NaN
      const float alpha = exp2f(m[i] - m_use);
      float row_sum = 0.0f;
#pragma unroll
      for (int n = 0; n < TN; ++n) {
        s[i][n] = exp2f(s[i][n] - m_use);
        row_sum += s[i][n];
      }
      l[i] = fmaf(l[i], alpha, row_sum);
#pragma unroll
      for (int c = 0; c < OC * VW; ++c) o[i][c] *= alpha;
      m[i] = m_new;
    }
    // END SOLUTION

    // Step 6: P_ij to shared memory (every thread needs whole rows of P for P V).
    store_p<Cfg>(Ps, s, tx, ty);
    __syncthreads();  // P visible; every thread is done with K_j

    // Step 7: start K_{j+1}; it lands while P V runs. (An empty group keeps the count uniform.)
    if (tile + 1 < n_tiles) load_rows_async<D, Bc, LDQ>(Ks, k_head, t0 + Bc, 1, kv_end);
    course::cp_async_commit();
    course::cp_async_wait<1>();  // everything but K_{j+1}: V_j has landed
    __syncthreads();

    // Step 8: O_i += P_ij V_j: per 4 keys, TM float4 of P and OC vectors of V per key.
    float4 pf[TM];     // P_ij operands
    float vf[OC][VW];  // V_j operands
    pv_tile<Cfg>(o, pf, vf, Ps, Vs, tx, ty);
  }
  course::cp_async_wait<0>();  // nothing may be left in flight when the block exits

  // BEGIN SOLUTION: Port of fused_teaching.cu's Line 15 TODO as Step 9 here, once the teaching kernel's tests pass: for this thread's TM rows, the kTX partial sums of a row added first, then O / l stored VW floats at a time, and the logsumexp (one thread per row) brought back from log2 units (README: Versions)
  // Step 9: O_i = O_i / l_i (zeros for fully masked rows), logsumexp = (m + log2 l) * ln 2.
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    float l_total = l[i];
#pragma unroll
    for (int offset = kTX / 2; offset > 0; offset >>= 1)
      l_total += __shfl_xor_sync(course::kFullMask, l_total, offset);
    const int64_t row = i0 + ty + kTY * i;
    if (row >= p.Sq) continue;
    const float inv = l_total > 0.0f ? 1.0f / l_total : 0.0f;
    float out[OC * VW];
#pragma unroll
    for (int c = 0; c < OC * VW; ++c) out[c] = o[i][c] * inv;
    float* o_row = p.o + (bh * p.Sq + row) * D;
#pragma unroll
    for (int c = 0; c < OC; ++c) store_vec<VW>(o_row + (c * kTX + tx) * VW, out + c * VW);
    if (p.lse != nullptr && tx == 0)
      p.lse[bh * p.Sq + row] = l_total > 0.0f ? (m[i] + log2f(l_total)) * kLn2 : -CUDART_INF_F;
  }
  // END SOLUTION
}

}  // namespace

void launch_v4(const FusedParams& p, int D, cudaStream_t stream) {
  with_version_tiles(D, [&](auto cfg) {
    using Cfg = decltype(cfg);
    launch_tiles<Cfg, fused_v4_kernel<Cfg>>(p, stream);
  });
}

}  // namespace phase5
