// Phase 5, backward: FlashAttention-2's backward pass (Algorithm 2) in FP32 on tensor cores, every
// product in 3xTF32 (../../utils/csrc/tf32x3.cuh): the FP32 op's variant 1. Read bwd_tc.cu first:
// the same loop order, the same ownership and the same transposed scores, with the FP32 forward's
// version 6 (../fp32/fused_v6_tf32x3.cu) as the model for the FP32 operands.
//
// One thread block of 4 warps per (key block j of Bc = 64 keys, batch*head); warp w owns the 16
// keys 16w..16w+15 and keeps their dK, dV (16 x D, FP32) in registers for the whole loop. Per query
// block i (Br = 32 rows; 16 at D = 128, Tf32Tile):
//   S^T  = K_w Q_i^T       mma m16n8k8 in 3xTF32, k = head dim
//   dP^T = V_w dO_i^T      likewise
//   P^T  = 2^(S^T c + bias log2 e - L_i log2 e),  dS^T = P^T (dP^T - D_i)   on the accumulators
//   dV_w += P^T dO_i       P^T's accumulators are the A operand as they stand (split big + small)
//   dK_w += dS^T Q_i       likewise dS^T
//   dS -> shared memory;   barrier
//   dQ_i += dS K_j         each warp a 16-row slice of some columns, added to the FP32 dQ with atomics
//
// What changes against bwd_tc.cu (the ideas of fused_v6_tf32x3.cu, applied to five products):
//   1. No ldmatrix: it moves 16-bit elements. Each thread loads its FP32 operands itself, in an
//      order of the sum chosen so that one load serves several MMAs. A sum over k takes its terms
//      in any order as long as A and B agree: in S^T and dP^T (k = head dim) k-slot t of step s
//      reads column 16c + 4t + 2s and slot t + 4 column 16c + 4t + 2s + 1, so one float4 per row
//      feeds two k8 steps; in dV, dK (k = queries) and dQ (k = keys) slot t reads row 2t of the
//      k8 step and slot t + 4 row 2t + 1: exactly the C fragment columns a thread holds, so P^T
//      and dS^T go from accumulators to A operands with no shuffle. The n columns of dV, dK, dQ
//      are permuted the same way: n-tile i of a pair reads head column 16p + 2g + i, one float2
//      per row, and each thread ends with 4 consecutive columns per row and pair (float4 stores
//      and, on sm_90, float4 atomics).
//   2. Tiles of FP32 rows, swizzled: the 16-byte chunk c of row r sits at chunk c ^ f(r),
//      f(r) = 2 ((r / 2) % 4) ^ 4 (r % 2). A quarter-warp's float4 loads (rows g, g+1 at chunks
//      4c + t) and a half-warp's float2 loads (rows 2t at chunks 4p + g / 2) each hit distinct
//      bank groups, where no row padding serves both patterns.
//   3. dK and dV are no MMA accumulators across query blocks: the tensor core does not round its
//      additions to nearest, and summed over every query block they would drift (as O did in the
//      forward). Each pair of n-tiles sums one block's queries in fresh accumulators (the big
//      products in one, the cross terms in another), then dK, dV += that with one FADD.
//   4. One stage of Q_i, dO_i: FP32 tiles are twice bwd_tc.cu's bytes. The next block's tiles are
//      requested as soon as every warp is done with them (after step 3), so they land during
//      step 5 (dQ and its atomics); two blocks per SM hide the rest.
// Instances: D = 32, 64, 96, 128 (the swizzle needs rows of a multiple of 32 floats). Masks,
// causal, stride, key padding: the FP32 forward's semantics, through the same per-score test.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "bwd.h"
#include "common.cuh"
#include "bwd_key_block.cuh"
#include "cp_async.cuh"
#include "shared_memory_opt_in.h"
#include "tf32x3.cuh"

namespace phase5_bwd {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarps = 4, kThreads = kWarps * course::kWarpSize;
constexpr int kBc = 16 * kWarps;  // keys per block: 16 per warp
constexpr int kLdS = kBc + 8;     // pitch of dS rows (floats): the dQ step's float2 loads are conflict free

// Br query rows per step: 32, or 16 at D = 128, where the warp's dK and dV alone take 128 registers
// and S^T, dP^T of 32 queries would take 32 more.
template <int D_>
struct Tf32Tile {
  static constexpr int D = D_;
  static constexpr int Br = D <= 96 ? 32 : 16;
  static constexpr int kMinBlocks = 2;
  // K_j, V_j; Q_i, dO_i; dS (queries x keys); L_i, D_i.
  static constexpr int kSmemFloats = 2 * kBc * D + 2 * Br * D + Br * kLdS + 2 * Br;
  static constexpr int kSmemBytes = kSmemFloats * 4;
  static_assert(D % 32 == 0, "the swizzle needs rows of a multiple of 32 floats (8 chunks)");
  static_assert(kSmemBytes * kMinBlocks <= 227 * 1024, "kMinBlocks blocks must fit an SM's shared memory");
};

// Idea 2: the float offset of element (r, col) of a swizzled tile of D floats per row.
template <int D>
__device__ __forceinline__ int at(int r, int col) {
  const int chunk = (col >> 2) ^ ((((r >> 1) & 3) << 1) ^ ((r & 1) << 2));
  return r * D + (chunk << 2) + (col & 3);
}

// Rows [row0, row0 + kRows) of a row-major [rows, D] FP32 matrix into a swizzled tile with cp.async;
// rows at or beyond row_limit are zero-filled, never read.
template <int D, int kRows>
__device__ __forceinline__ void load_tile(float* tile, const float* src, int64_t row0, int64_t row_limit) {
  constexpr int kChunks = D / 4, kTotal = kRows * kChunks;
  const float* rows = src + row0 * D;
  const int64_t rows_left = row_limit - row0;
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
    if (kTotal % kThreads == 0 || idx < kTotal) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool valid = r < rows_left;
      course::cp_async_16(course::smem_u32(tile + at<D>(r, 4 * c)), valid ? rows + r * D + 4 * c : src, valid);
    }
  }
}

// Rows r and r + 8 of a swizzled tile at columns 16c + 4t..: the A operand (or, row r alone, the B
// operand) of the two k8 steps of chunk c in S^T and dP^T (idea 1).
template <int D>
__device__ __forceinline__ float4 load4(const float* tile, int r, int c, int t) {
  return *reinterpret_cast<const float4*>(tile + at<D>(r, 16 * c + 4 * t));
}

// Columns 16p + 2g, + 1 of row r: b0 (or b1) of n-tiles 2p and 2p + 1 in dV, dK, dQ (idea 1).
template <int D>
__device__ __forceinline__ float2 load2(const float* tile, int r, int p, int g) {
  return *reinterpret_cast<const float2*>(tile + at<D>(r, 16 * p + 2 * g));
}

__device__ __forceinline__ void add_to_global(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), v);  // one vector atomic (sm_90)
#else
  atomicAdd(dst, v.x);
  atomicAdd(dst + 1, v.y);
  atomicAdd(dst + 2, v.z);
  atomicAdd(dst + 3, v.w);
#endif
}

// acc = A B for the pair p of n8 tiles (16 rows x head columns 16p..16p+15, idea 1), k = the first
// 8 kSteps rows of a swizzled tile: A given per k8 step as split fragments, B read by load2 from rows
// 8s + 2t and 8s + 2t + 1. Fresh accumulators (idea 3): the caller adds them to its sums.
template <int D, int kSteps>
__device__ __forceinline__ void multiply_pair(float (&acc)[2][4], const uint32_t (&a_big)[kSteps][4],
                                              const uint32_t (&a_small)[kSteps][4], const float* tile, int p,
                                              int g, int t) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const float2 b0 = load2<D>(tile, 8 * s + 2 * t, p, g);
    const float2 b1 = load2<D>(tile, 8 * s + 2 * t + 1, p, g);
    course::mma_1688_3xtf32(acc[0], a_big[s], a_small[s], course::split_tf32(b0.x), course::split_tf32(b1.x));
    course::mma_1688_3xtf32(acc[1], a_big[s], a_small[s], course::split_tf32(b0.y), course::split_tf32(b1.y));
  }
}

// S^T = K_w Q_i^T and dP^T = V_w dO_i^T (the warp's 16 key rows from row kw, kN n8 tiles of query
// rows) in 3xTF32, k = the D columns: chunk ch of 16 columns is two k8 steps, slot t of step st
// reading column 16ch + 4t + 2st and slot t + 4 the next one (idea 1); the warp's K and V rows split
// once per chunk, one float4 of a Q or dO row per two steps. The two products in one pass: two
// independent MMA chains.
template <int D, int kN>
__device__ __forceinline__ void scores_transposed(float (&s)[kN][4], float (&dp)[kN][4], const float* sK,
                                                  const float* sV, const float* sQ, const float* sdO, int kw,
                                                  int g, int t) {
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
  for (int ch = 0; ch < D / 16; ++ch) {
    uint32_t k_big[2][4], k_small[2][4], v_big[2][4], v_small[2][4];
    {
      const float4 k_lo = load4<D>(sK, kw + g, ch, t), k_hi = load4<D>(sK, kw + g + 8, ch, t);
      const float4 v_lo = load4<D>(sV, kw + g, ch, t), v_hi = load4<D>(sV, kw + g + 8, ch, t);
      const float ka[2][4] = {{k_lo.x, k_hi.x, k_lo.y, k_hi.y}, {k_lo.z, k_hi.z, k_lo.w, k_hi.w}};
      const float va[2][4] = {{v_lo.x, v_hi.x, v_lo.y, v_hi.y}, {v_lo.z, v_hi.z, v_lo.w, v_hi.w}};
#pragma unroll
      for (int st = 0; st < 2; ++st) {
        course::split_fragment(ka[st], k_big[st], k_small[st]);
        course::split_fragment(va[st], v_big[st], v_small[st]);
      }
    }
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float4 q = load4<D>(sQ, 8 * n + g, ch, t);
      const float4 o = load4<D>(sdO, 8 * n + g, ch, t);
      course::mma_1688_3xtf32(s[n], k_big[0], k_small[0], course::split_tf32(q.x), course::split_tf32(q.y));
      course::mma_1688_3xtf32(s[n], k_big[1], k_small[1], course::split_tf32(q.z), course::split_tf32(q.w));
      course::mma_1688_3xtf32(dp[n], v_big[0], v_small[0], course::split_tf32(o.x), course::split_tf32(o.y));
      course::mma_1688_3xtf32(dp[n], v_big[1], v_small[1], course::split_tf32(o.z), course::split_tf32(o.w));
    }
  }
}

// dX (16 rows x 16 kPairs columns, pairs of C fragments) += C B, where the kSteps n8 tiles of the C
// fragments c are the A operand of kSteps k8 steps (slot t and t + 4: its columns 2t and 2t + 1)
// and B is rows 8s + 2t (+1) of a swizzled tile (idea 1); each pair summed fresh, then added (idea 3).
template <int D, int kSteps, int kPairs>
__device__ __forceinline__ void accumulate_product(float (&dx)[kPairs][2][4], const float (&c)[kSteps][4],
                                                   const float* tile, int g, int t) {
  uint32_t a_big[kSteps][4], a_small[kSteps][4];
#pragma unroll
  for (int n = 0; n < kSteps; ++n) {
    const float a[4] = {c[n][0], c[n][2], c[n][1], c[n][3]};
    course::split_fragment(a, a_big[n], a_small[n]);
  }
#pragma unroll
  for (int pr = 0; pr < kPairs; ++pr) {
    float acc[2][4];
    multiply_pair<D, kSteps>(acc, a_big, a_small, tile, pr, g, t);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dx[pr][i][e] += acc[i][e];
  }
}

template <typename Cfg, bool kMaskOrWindow>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) tf32x3_backward_kernel(const BwdParams p) {
  constexpr int D = Cfg::D, kBr = Cfg::Br;
  constexpr int kN = kBr / 8;       // n8 tiles of S^T (queries); k8 steps of dV, dK
  constexpr int kPairs = D / 16;    // pairs of n8 tiles of dK, dV (head dim)
  // dQ_i over the warps: kRowGroups groups of 16 rows x kColGroups slices of kDqPairs column pairs.
  constexpr int kRowGroups = kBr / 16, kColGroups = kWarps / kRowGroups, kDqPairs = kPairs / kColGroups;
  static_assert(kWarps % kRowGroups == 0 && kPairs % kColGroups == 0, "dQ_i splits evenly over the warps");

  extern __shared__ float4 smem_f4[];
  float* sK = reinterpret_cast<float*>(smem_f4);  // [Bc][D]   swizzled
  float* sV = sK + kBc * D;                       // [Bc][D]
  float* sQ = sV + kBc * D;                       // [Br][D]
  float* sdO = sQ + kBr * D;                      // [Br][D]
  float* sdS = sdO + kBr * D;                     // [Br][kLdS] dS (queries as rows), plain
  float* sL = sdS + kBr * kLdS;                   // [Br]  L_i log2(e)
  float* sDelta = sL + kBr;                       // [Br]  D_i

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / course::kWarpSize;
  const int lane = tid % course::kWarpSize;
  const int g = lane >> 2, t = lane & 3;  // fragment row group and k slot (tf32x3.cuh)
  // The block's keys, its query blocks and its head's rows (bwd_key_block.cuh).
  const KeyBlock<float> w = key_block<float, kBc, kBr>(p, D);
  const int64_t bh = w.bh, b = w.b, h = w.h, k0 = w.k0, kv_len = w.kv_len, qb_first = w.qb_first;
  const int64_t n_steps = w.n_steps;
  const float *Q = w.Q, *K = w.K, *V = w.V, *dO = w.dO;
  const float *lse = w.lse, *delta = w.delta;
  float* dQ = w.dQ;
  const bool causal = p.masking.causal;

  // Q_i, dO_i (rows past Sq zero-filled) and L_i log2(e), D_i of query block qb (rows past Sq:
  // L = -inf, which hides them).
  auto load_query_block = [&](int64_t qb) {
    load_tile<D, kBr>(sQ, Q, qb * kBr, p.Sq);
    load_tile<D, kBr>(sdO, dO, qb * kBr, p.Sq);
    course::cp_async_commit();
    if (tid < 2 * kBr) {
      const int r = tid % kBr;
      const int64_t row = qb * kBr + r;
      if (tid < kBr) sL[r] = row < p.Sq ? lse[row] * kLog2e : -CUDART_INF_F;
      else sDelta[r] = row < p.Sq ? delta[row] : 0.0f;
    }
  };

  // Prologue: K_j, V_j (padding keys zero-filled) and the first query block.
  if (n_steps > 0) {
    load_tile<D, kBc>(sK, K, k0, kv_len);
    load_tile<D, kBc>(sV, V, k0, kv_len);
    load_query_block(qb_first);
  }

  // dK_w, dV_w: the warp's 16 keys x D; pair pr, tile i, element e: key g + 8 (e / 2), head column
  // 16 pr + 4t + 2 (e % 2) + i (idea 1).
  float dk[kPairs][2][4], dv[kPairs][2][4];
#pragma unroll
  for (int pr = 0; pr < kPairs; ++pr)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[pr][i][e] = dv[pr][i][e] = 0.0f;
  const int64_t warp_k0 = k0 + 16 * warp;
  const int kw = 16 * warp;  // the warp's first key row in sK, sV

  for (int64_t step = 0; step < n_steps; ++step) {
    const int64_t q0 = (qb_first + step) * kBr;

    // Wait for Q_i, dO_i, L_i, D_i (and K_j, V_j); the barrier also says every warp is done with
    // step - 1's dS.
    course::cp_async_wait<0>();
    __syncthreads();

    // Step 1: S^T = K_w Q_i^T and dP^T = V_w dO_i^T in 3xTF32, k = head dim.
    float s[kN][4], dp[kN][4];
    scores_transposed<D, kN>(s, dp, sK, sV, sQ, sdO, kw, g, t);

    // Step 2: P^T = 2^(S^T scale log2(e) + bias log2(e) - L_i log2(e)) and dS^T = P^T (dP^T - D_i),
    // in place (s becomes P^T, dp becomes dS^T). Element e of n8 tile n: key g + 8 (e / 2) of the
    // warp, query 8n + 2t + e % 2 of the block. With the per-score test only in the blocks that
    // need it (bwd_tc.cu's two loops).
    const bool need_mask = (kMaskOrWindow && p.masking.mask.kind != course::MaskKind::kNone) ||
                           p.masking.stride > 1 || q0 + kBr > p.Sq || k0 + kBc > kv_len ||
                           (causal && k0 + kBc - 1 > q0) || (kMaskOrWindow && crosses_window(p, q0, kBr, k0));
    const float scale_log2 = p.scale * kLog2e;
    auto probabilities_and_grads = [&](auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        const float2 l2 = *reinterpret_cast<const float2*>(sL + 8 * n + 2 * t);
        const float2 di = *reinterpret_cast<const float2*>(sDelta + 8 * n + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float li = (e & 1) ? l2.y : l2.x;
          float x = fmaf(s[n][e], scale_log2, -li);
          bool visible = li != -CUDART_INF_F;  // a row with no visible key (or past Sq): no gradient
          if constexpr (kMasked) {
            const int64_t key = warp_k0 + g + 8 * (e >> 1);
            const int64_t row = q0 + 8 * n + 2 * t + (e & 1);
            visible = visible && row < p.Sq && key < kv_len && (!kMaskOrWindow || in_window(p, row, key));
            if (visible) {
              const float bias = course::mask_bias(p.masking, b, h, row, key);
              visible = bias != -CUDART_INF_F;
              x = fmaf(bias, kLog2e, x);
            }
          }
          const float pij = visible ? exp2f(x) : 0.0f;
          s[n][e] = pij;
          dp[n][e] = visible ? pij * (dp[n][e] - ((e & 1) ? di.y : di.x)) : 0.0f;
        }
      }
    };
    if (need_mask) {
      probabilities_and_grads(std::true_type{});
    } else {
      probabilities_and_grads(std::false_type{});
    }

    // Step 3: dS to shared memory with queries as rows (the transposed store of dS^T): dQ
    // contracts over all Bc keys, every warp's.
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) sdS[(8 * n + 2 * t + (e & 1)) * kLdS + kw + g + 8 * (e >> 1)] = dp[n][e];

    // Step 4: dV_w += P^T dO_i, then dK_w += dS^T Q_i, k = queries: n8 tile n of P^T (dS^T) is the
    // A fragment of k8 step n, split; per pair of head-column tiles, fresh accumulators (idea 3).
    accumulate_product<D, kN, kPairs>(dv, s, sdO, g, t);
    accumulate_product<D, kN, kPairs>(dk, dp, sQ, g, t);
    __syncthreads();  // dS complete; every warp is done with Q_i, dO_i, L_i, D_i

    // Idea 4: the next query block's tiles, landing while dQ and its atomics run.
    if (step + 1 < n_steps) load_query_block(qb_first + step + 1);

    // Step 5: dQ_i += scale dS K_j for this warp's 16 query rows (row group warp % kRowGroups) and
    // column pairs (slice warp / kRowGroups), k = keys: slot t of k8 step s reads key 8s + 2t, slot
    // t + 4 key 8s + 2t + 1 (idea 1), dS by float2 and K_j by load2.
    {
      const int r0 = 16 * (warp % kRowGroups), slice = warp / kRowGroups;
      float acc[kDqPairs][2][4];
#pragma unroll
      for (int pq = 0; pq < kDqPairs; ++pq)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[pq][i][e] = 0.0f;
      // k8 steps outside, the warp's column pairs inside: one step's dS split at a time.
#pragma unroll
      for (int st = 0; st < kBc / 8; ++st) {
        const float2 lo = *reinterpret_cast<const float2*>(sdS + (r0 + g) * kLdS + 8 * st + 2 * t);
        const float2 hi = *reinterpret_cast<const float2*>(sdS + (r0 + g + 8) * kLdS + 8 * st + 2 * t);
        const float a[4] = {lo.x, hi.x, lo.y, hi.y};
        uint32_t a_big[4], a_small[4];
        course::split_fragment(a, a_big, a_small);
#pragma unroll
        for (int pq = 0; pq < kDqPairs; ++pq) {
          const float2 b0 = load2<D>(sK, 8 * st + 2 * t, slice * kDqPairs + pq, g);
          const float2 b1 = load2<D>(sK, 8 * st + 2 * t + 1, slice * kDqPairs + pq, g);
          course::mma_1688_3xtf32(acc[pq][0], a_big, a_small, course::split_tf32(b0.x), course::split_tf32(b1.x));
          course::mma_1688_3xtf32(acc[pq][1], a_big, a_small, course::split_tf32(b0.y), course::split_tf32(b1.y));
        }
      }
      // The FP32 dQ, shared with every other key block: atomics. Row r0 + g (e = 0, 1) and
      // r0 + g + 8 (e = 2, 3), columns 16 pr + 4t.. (idea 1).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = q0 + r0 + g + 8 * r;
        if (row >= p.Sq) continue;
#pragma unroll
        for (int pq = 0; pq < kDqPairs; ++pq) {
          const int pr = slice * kDqPairs + pq;
          add_to_global(dQ + row * D + 16 * pr + 4 * t,
                        make_float4(p.scale * acc[pq][0][2 * r], p.scale * acc[pq][1][2 * r],
                                    p.scale * acc[pq][0][2 * r + 1], p.scale * acc[pq][1][2 * r + 1]));
        }
      }
    }
  }
  course::cp_async_wait<0>();  // nothing may be left in flight when the block exits

  // Epilogue: dK_w = scale * dK_w and dV_w for the warp's keys that exist (padding keys and keys no
  // query sees get zeros), a float4 per row and pair.
  float* dK = static_cast<float*>(p.dk) + bh * p.Sk * D;
  float* dV = static_cast<float*>(p.dv) + bh * p.Sk * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = warp_k0 + g + 8 * r;
    if (key >= p.Sk) continue;
#pragma unroll
    for (int pr = 0; pr < kPairs; ++pr) {
      const int col = 16 * pr + 4 * t;
      *reinterpret_cast<float4*>(dK + key * D + col) =
          make_float4(p.scale * dk[pr][0][2 * r], p.scale * dk[pr][1][2 * r], p.scale * dk[pr][0][2 * r + 1],
                      p.scale * dk[pr][1][2 * r + 1]);
      *reinterpret_cast<float4*>(dV + key * D + col) =
          make_float4(dv[pr][0][2 * r], dv[pr][1][2 * r], dv[pr][0][2 * r + 1], dv[pr][1][2 * r + 1]);
    }
  }
}

template <typename Cfg, bool kMaskOrWindow>
void launch(const BwdParams& p, int device, cudaStream_t stream) {
  constexpr auto kernel = tf32x3_backward_kernel<Cfg, kMaskOrWindow>;
  course::opt_in_shared_memory<kernel>(device, Cfg::kSmemBytes);
  const int64_t blocks = course::ceil_div<int64_t>(p.Sk, kBc) * p.B * p.H;
  TORCH_CHECK(blocks <= 0x7fffffff, "k: too many key blocks (B*H*ceil(Sk/", kBc, ")) for one grid");
  kernel<<<static_cast<unsigned>(blocks), kThreads, Cfg::kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int D>
void launch_for_mask(const BwdParams& p, int device, cudaStream_t stream) {
  if (uses_mask_or_window(p)) {
    launch<Tf32Tile<D>, true>(p, device, stream);
  } else {
    launch<Tf32Tile<D>, false>(p, device, stream);
  }
}

}  // namespace

void launch_tf32x3_backward(const BwdParams& p, int D, cudaStream_t stream) {
  const int device = c10::cuda::current_device();
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TORCH_CHECK(major >= 8, "the 3xTF32 attention backward needs compute capability 8.0 or newer (mma.sync "
              "TF32, cp.async); this GPU has ", major, ".x: use variant 0");
  switch (D) {
    case 32: return launch_for_mask<32>(p, device, stream);
    case 64: return launch_for_mask<64>(p, device, stream);
    case 96: return launch_for_mask<96>(p, device, stream);
    case 128: return launch_for_mask<128>(p, device, stream);
    default: TORCH_CHECK(false, "q: head dim D=", D, " has no instance in the 3xTF32 backward (kTf32x3SupportedD)");
  }
}

}  // namespace phase5_bwd
