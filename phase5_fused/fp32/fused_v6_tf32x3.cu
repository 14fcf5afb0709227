// Phase 5, FP32 fused attention, version 6: both matmuls on tensor cores in 3xTF32.
//
// Versions 1-5 run every product on the FP32 FFMA pipe, which the fast kernel keeps busy; at D=128
// that is not enough to reach sdpa_efficient, whose FP32 path is no FFMA kernel at all: it splits
// each FP32 operand into two TF32 numbers and runs three TF32 tensor-core MMAs per product
// (tf32x3.cuh). One TF32 m16n8k8 MMA does the multiply-adds of 32 FFMA instructions per lane, and
// the tensor pipe runs about seven times the FFMA pipe's FLOPs (the ceilings of utils/results):
// three MMAs per product still leave it more than twice ahead, in FP32 accuracy. This version does
// the same, with mma.sync (sm_80+: every GPU the course supports).
//
// What changes against version 4 (the same loop, steps and masking; README.md "Version 6"):
//   1. The block is 8 warps; warp w owns the 16 query rows 16w..16w+15 of Q_i (Br = 128), and each
//      thread holds its part of a warp's S (16 x Bc) and O (16 x D) in mma fragments (tf32x3.cuh
//      draws them): rows g and g+8 of the warp, g = lane / 4.
//   2. Q_i never enters shared memory: each thread loads its Q fragments from global memory once
//      and splits them (big + small) per use; shared memory holds K_j and V_j only, 71 KiB at D=128.
//   3. Free choice of the summation order. A sum over k may take its terms in any order, as long as
//      A and B agree: in S = Q K^T, k-slot t of a k8 step reads column 4t + 2s of a 16-column chunk
//      (s = 0, 1: the chunk's two steps) and slot t + 4 column 4t + 2s + 1, so one float4 per row
//      and chunk feeds two steps (LDS.128, not 4 LDS.32). In O = P V, k-slot t reads key 2t and
//      slot t + 4 key 2t + 1: exactly the keys whose P this thread holds in its S fragment (c0, c1),
//      so P goes from the S accumulators to the A operand without a shuffle or shared memory.
//      The n-columns of P V are permuted too: n-tile i of a pair reads V column 2g + i, so the two
//      n-tiles of a pair load one float2 of a V row, and each thread ends with 4 consecutive O
//      columns per row and pair, stored as one float4.
//   4. Row pitches that make those loads bank-conflict free: K rows of LDK floats with
//      LDK / 4 = 4 mod 8 (a quarter-warp reads rows g, g+1 at columns 4t: 8 distinct 16-byte bank
//      groups), V rows of D + 4 floats (a half-warp reads rows 2t at columns 2g: 16 distinct
//      8-byte slots).
//   5. O is no MMA accumulator across tiles: the tensor core does not round its additions to
//      nearest, and with 3 Bc / 8 of them per tile on O itself the output drifted by 3e-5 relative
//      at S=4096 (measured; 1.5 times the FP32 tolerance). Each pair of O n-tiles sums one tile's
//      keys in fresh accumulators, the big products in one and the two cross terms in another (two
//      MMA chains that do not wait for each other: 5% faster at D=128, measured), and
//      O = alpha O + P V is one FFMA per element, rounded to nearest.
// Heaviest query blocks first, as version 5; stride is masked per score (versions 1-4); no grouped
// heads, no window (the fast kernel's).
#include <cuda_runtime.h>
#include <math_constants.h>

#include "attention_mask.cuh"
#include "common.cuh"
#include "cp_async.cuh"
#include "fused.h"
#include "fused_tiles.cuh"
#include "tf32x3.cuh"

namespace phase5 {
namespace {

constexpr int kWarps = kThreads / course::kWarpSize;

// The tile configuration: Br = 16 rows per warp, Bc = 64 keys, K and V pitches of (4) above, W = 2
// n-tiles of O per V load (3).
template <int D_>
struct Tf32Config {
  static constexpr int D = D_, Br = 16 * kWarps, Bc = 64;
  static constexpr int LDK = D + (12 - (D / 4) % 8) % 8 * 4;  // LDK / 4 = 4 mod 8
  static constexpr int LDV = D + 4;                            // LDV = 4 mod 8 (D % 8 == 0)
  static constexpr int W = 2;                                  // O n-tiles per V load (a float2)
  // One block per SM: Q, O and the pre-split P take up to 255 registers (ptxas -v, CUDA 13.0: at
  // D=128 72 bytes of O spill to local memory, loaded and stored once per key tile, beside 768
  // MMAs; D=96 4 bytes).
  static constexpr int kMinBlocks = 1;
  static constexpr int kSmemBytes = Bc * (LDK + LDV) * 4;
  static_assert(D % 16 == 0 && D % (8 * W) == 0, "D must be a multiple of 16 (chunks of two k8 steps)");
  static_assert(2 * W == 4, "a thread's O columns of a row and pair are one float4");
  static_assert((LDK / 4) % 8 == 4 && LDV % 8 == 4, "the pitches of (4) above");
  static_assert(kSmemBytes * kMinBlocks <= kSmemPerSM, "kMinBlocks blocks must fit in shared memory");
};

template <typename Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) fused_tf32x3_kernel(FusedParams p) {
  constexpr int D = Cfg::D, Br = Cfg::Br, Bc = Cfg::Bc, LDK = Cfg::LDK, LDV = Cfg::LDV, W = Cfg::W;
  constexpr int kChunks = D / 16;  // 16-column chunks of D in Q K^T (two k8 steps each)
  constexpr int kSn = Bc / 8;      // n8 tiles of S (keys)
  constexpr int kOn = D / 8;       // n8 tiles of O (head dim)

  extern __shared__ float4 smem_f4[];
  float* Ks = reinterpret_cast<float*>(smem_f4);  // [Bc][LDK]  K_j
  float* Vs = Ks + Bc * LDK;                      // [Bc][LDV]  V_j

  const int warp = threadIdx.x / course::kWarpSize;
  const int g = threadIdx.x % course::kWarpSize / 4;  // fragment row (and n column of B)
  const int t = threadIdx.x % 4;                      // fragment k slot (and column pair of C)

  // Which query block and head: blocks with the most key tiles (last rows, causal) start first.
  const int64_t BH = p.B * p.H;
  const int64_t n_qblocks = course::ceil_div<int64_t>(p.Sq, Br);
  const int64_t bh = blockIdx.x % BH;
  const int64_t qblock = n_qblocks - 1 - static_cast<int64_t>(blockIdx.x) / BH;
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qblock * Br;
  const int64_t rows[2] = {i0 + 16 * warp + g, i0 + 16 * warp + g + 8};  // this thread's two rows

  const float* k_head = p.k + bh * p.Sk * D;
  const float* v_head = p.v + bh * p.Sk * D;

  // The keys this block can see: j < kv_limit (padding) and, under causal masking, j <= its last
  // row, so the loop over tiles stops at kv_end. Stride and the user's mask are masked per score.
  const int64_t kv_limit =
      p.key_lengths ? static_cast<int64_t>(p.key_lengths[b]) : p.Sk;  // clamped on the host
  const int64_t i_last = (i0 + Br < p.Sq ? i0 + Br : p.Sq) - 1;
  const int64_t kv_end = p.masking.causal && i_last + 1 < kv_limit ? i_last + 1 : kv_limit;
  const int64_t n_tiles = course::ceil_div<int64_t>(kv_end, Bc);
  const bool plain = p.masking.mask.kind == course::MaskKind::kNone && p.masking.stride == 1;
  const float scale_log2 = p.scale * kLog2e;

  // Q_i fragments, from global memory once: q[c][0..3] = Q[row g][16c + 4t ..], q[c][4..7] = row g+8
  // (zeros past Sq).
  float q[kChunks][8];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float* q_row = p.q + (bh * p.Sq + rows[r]) * D;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const float4 x = rows[r] < p.Sq ? *reinterpret_cast<const float4*>(q_row + 16 * c + 4 * t)
                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      q[c][4 * r] = x.x;
      q[c][4 * r + 1] = x.y;
      q[c][4 * r + 2] = x.z;
      q[c][4 * r + 3] = x.w;
    }
  }

  // Per-thread state: O fragments (unnormalized), running max m (log2 units) and partial sum l of
  // rows g and g+8.
  float o[kOn][4];
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < kOn; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;

  if (n_tiles > 0) {
    // Prologue: K_0.
    load_rows_async<D, Bc, LDK>(Ks, k_head, 0, 1, kv_end);
    course::cp_async_commit();
  }

  for (int64_t tile = 0; tile < n_tiles; ++tile) {
    const int64_t t0 = tile * Bc;  // first key of this tile

    // Step 1: K_j landed; every thread has finished P_{j-1} V_{j-1}, so V is free.
    course::cp_async_wait<0>();
    __syncthreads();
    // Step 2: start V_j; it lands while S_j and its softmax are computed.
    load_rows_async<D, Bc, LDV>(Vs, v_head, t0, 1, kv_end);
    course::cp_async_commit();

    // Step 3: S_ij = Q_i K_j^T in 3xTF32: per 16-column chunk, one float4 of a K row per n-tile
    // feeds two k8 steps (idea 3), three MMAs each.
    float s[kSn][4];
#pragma unroll
    for (int n = 0; n < kSn; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      uint32_t a_big[2][4], a_small[2][4];
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const float a[4] = {q[c][2 * step], q[c][4 + 2 * step], q[c][2 * step + 1], q[c][4 + 2 * step + 1]};
        course::split_fragment(a, a_big[step], a_small[step]);
      }
#pragma unroll
      for (int n = 0; n < kSn; ++n) {
        const float4 kv = *reinterpret_cast<const float4*>(Ks + (8 * n + g) * LDK + 16 * c + 4 * t);
        course::mma_1688_3xtf32(s[n], a_big[0], a_small[0], course::split_tf32(kv.x), course::split_tf32(kv.y));
        course::mma_1688_3xtf32(s[n], a_big[1], a_small[1], course::split_tf32(kv.z), course::split_tf32(kv.w));
      }
    }

    // Step 4: scale into log2 units, and mask where this tile needs it. A tile needs no test when
    // there is no user mask or stride, all its keys are before kv_limit and (causal) all are <= the
    // block's first row. Score s[n][2r + e] is (row rows[r], key t0 + 8n + 2t + e).
    const int64_t last_key = t0 + Bc - 1;
    if (plain && last_key < kv_limit && !(p.masking.causal && last_key > i0)) {
#pragma unroll
      for (int n = 0; n < kSn; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
    } else {
#pragma unroll
      for (int n = 0; n < kSn; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t row = rows[e / 2];
          const int64_t key = t0 + 8 * n + 2 * t + e % 2;
          float x = -CUDART_INF_F;
          if (row < p.Sq && key < kv_limit) {
            const float bias = course::mask_bias(p.masking, b, h, row, key);
            if (bias != -CUDART_INF_F) x = fmaf(s[n][e], scale_log2, bias * kLog2e);
          }
          s[n][e] = x;
        }
    }

    float alpha[2];  // O's rescaling per row, exp2(m - m_new): set in step 5, applied in step 7
    // BEGIN SOLUTION: Port of fused_teaching.cu's online-softmax TODO (Lines 10-13) as Step 5 here, once the teaching kernel's tests pass: for this thread's two rows g and g+8 (r = 0, 1), with the scores in log2 units (exp2f), a row's max shared by the 4 threads of the row (shuffles), l kept as a per-thread partial sum, and alpha[r] left for step 7 to rescale O (README: Version 6)
    // Step 5: online softmax per row (r = 0: row g, r = 1: row g+8). m_new = max(m, rowmax(S_ij))
    // over this thread's scores and the 3 other threads of the row; P = exp2(S_ij - m_new); l is
    // rescaled by alpha = exp2(m - m_new) here, O in step 7.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float row_max = -CUDART_INF_F;
#pragma unroll
      for (int n = 0; n < kSn; ++n) row_max = fmaxf(row_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, 1));
      row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, 2));
      const float m_new = fmaxf(m[r], row_max);
      const float m_use = m_new == -CUDART_INF_F ? 0.0f : m_new;  // all hidden so far: no NaN
      alpha[r] = exp2f(m[r] - m_use);
      float row_sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kSn; ++n)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[n][e] = exp2f(s[n][e] - m_use);
          row_sum += s[n][e];
        }
      l[r] = fmaf(l[r], alpha[r], row_sum);
      m[r] = m_new;
    }
    // END SOLUTION

    __syncthreads();  // every thread is done with K_j
    // Step 6: start K_{j+1}; it lands while P V runs. (An empty group keeps the count uniform.)
    if (tile + 1 < n_tiles) load_rows_async<D, Bc, LDK>(Ks, k_head, t0 + Bc, 1, kv_end);
    course::cp_async_commit();
    course::cp_async_wait<1>();  // everything but K_{j+1}: V_j has landed
    __syncthreads();

    // Step 7: O_i = alpha O_i + P_ij V_j, P V in 3xTF32, one k8 step per n-tile of S: P from this
    // thread's own S fragment (k slots t, t+4 = keys 2t, 2t+1), V rows 8n + 2t and 8n + 2t + 1, W
    // n-tiles of O per float2 of a V row (idea 3), summed in fresh accumulators per group (idea 5).
    uint32_t p_big[kSn][4], p_small[kSn][4];
#pragma unroll
    for (int n = 0; n < kSn; ++n) {
      const float a[4] = {s[n][0], s[n][2], s[n][1], s[n][3]};
      course::split_fragment(a, p_big[n], p_small[n]);
    }
#pragma unroll
    for (int grp = 0; grp < kOn / W; ++grp) {
      float pv[W][4], pv_cross[W][4];
#pragma unroll
      for (int i = 0; i < W; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) pv[i][e] = pv_cross[i][e] = 0.0f;
#pragma unroll
      for (int n = 0; n < kSn; ++n) {
        const float* v_rows = Vs + (8 * n + 2 * t) * LDV + W * g + 8 * W * grp;
        float b0[W], b1[W];
        load_vec<W>(b0, v_rows);
        load_vec<W>(b1, v_rows + LDV);
#pragma unroll
        for (int i = 0; i < W; ++i)
          course::mma_1688_3xtf32(pv[i], pv_cross[i], p_big[n], p_small[n], course::split_tf32(b0[i]), course::split_tf32(b1[i]));
      }
#pragma unroll
      for (int i = 0; i < W; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[W * grp + i][e] = fmaf(o[W * grp + i][e], alpha[e / 2], pv[i][e] + pv_cross[i][e]);
    }
  }
  course::cp_async_wait<0>();  // nothing may be left in flight when the block exits

  // BEGIN SOLUTION: Port of fused_teaching.cu's Line 15 TODO as Step 8 here, once the teaching kernel's tests pass: for this thread's two rows, the 4 partial sums of a row added first, then O / l stored a float4 per pair of O n-tiles (the columns the comment below names), and the logsumexp (one thread per row) brought back from log2 units (README: Version 6)
  // Step 8: O_i = O_i / l_i (zeros for fully masked rows), logsumexp = (m + log2 l) * ln 2. Group grp
  // of this thread holds columns 8W grp + 2W t + i (c0/c2 of n-tile W grp + i) and + W + i (c1/c3).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l_total = l[r];
    l_total += __shfl_xor_sync(course::kFullMask, l_total, 1);
    l_total += __shfl_xor_sync(course::kFullMask, l_total, 2);
    if (rows[r] >= p.Sq) continue;
    const float inv = l_total > 0.0f ? 1.0f / l_total : 0.0f;
    float* o_row = p.o + (bh * p.Sq + rows[r]) * D;
#pragma unroll
    for (int grp = 0; grp < kOn / W; ++grp) {
      float out[2 * W];
#pragma unroll
      for (int i = 0; i < W; ++i) {
        out[i] = o[W * grp + i][2 * r] * inv;
        out[W + i] = o[W * grp + i][2 * r + 1] * inv;
      }
      store_vec<2 * W>(o_row + 8 * W * grp + 2 * W * t, out);
    }
    if (p.lse != nullptr && t == 0)
      p.lse[bh * p.Sq + rows[r]] = l_total > 0.0f ? (m[r] + log2f(l_total)) * kLn2 : -CUDART_INF_F;
  }
  // END SOLUTION
}

}  // namespace

void launch_tf32x3(const FusedParams& p, int D, cudaStream_t stream) {
  switch (D) {
    case 32: return launch_tiles<Tf32Config<32>, fused_tf32x3_kernel<Tf32Config<32>>>(p, stream);
    case 64: return launch_tiles<Tf32Config<64>, fused_tf32x3_kernel<Tf32Config<64>>>(p, stream);
    case 80: return launch_tiles<Tf32Config<80>, fused_tf32x3_kernel<Tf32Config<80>>>(p, stream);
    case 96: return launch_tiles<Tf32Config<96>, fused_tf32x3_kernel<Tf32Config<96>>>(p, stream);
    case 128: return launch_tiles<Tf32Config<128>, fused_tf32x3_kernel<Tf32Config<128>>>(p, stream);
    default: TORCH_CHECK(false, "q: head dim D=", D, " has no instance in the tf32x3 kernel (kVersionD)");
  }
}

}  // namespace phase5
