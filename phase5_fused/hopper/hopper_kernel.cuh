// The pieces every version of the Hopper kernel shares: the shared-memory layout, the per-warpgroup
// steps of FlashAttention's inner loop (S = Q K^T on wgmma, mask, online softmax, O += P V on
// wgmma) and the epilogue. The versions differ in who issues the TMA copies, how the warps wait
// for them, and in what order a warpgroup issues and waits for its matmuls (hopper_v1_wgmma_tma.cu,
// hopper_v2_warp_specialized.cu, hopper_v3_intra_overlap.cu, hopper_v4_pingpong.cu and
// hopper_v5_tiles.cu; v2-v5 share hopper_pipeline.cuh). The tile is a template parameter (TileShape):
// v1-v4 run kBaseTile, v5 a tile per head dim.
//
// Paper notation (Shah et al., "FlashAttention-3", Algorithm 1): a block of kBM query rows Q_i
// stays in shared memory; for each block j of kBN keys: S = Q_i K_j^T, m_new = max(m, rowmax(S)),
// P = exp(S - m_new), l = e^(m - m_new) l + rowsum(P), O = e^(m - m_new) O + P V_j; finally O / l.
// Each consumer warpgroup (4 warps) owns 64 of the kBM rows; every warp of it 16 rows, and every
// thread two rows (g and g + 8, g = lane / 4) of S and O, as in the mma.sync kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdint>

#include "../tensor_cores/tc_mma.cuh"  // tc::pack2 (FP32 pair -> FP16/BF16 pair), tc::exp2_approx
#include "hopper_attention.h"
#include "hopper_ptx.cuh"

namespace hopper {

constexpr int kWarpgroup = 128;         // threads of a warpgroup (4 warps)
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kPanelBytes = 128;        // a swizzle panel row: 64 FP16/BF16 elements

// A CTA's tile (hopper_attention.h, TileSize) as compile-time constants.
template <int kRows, int kKeys>
struct TileShape {
  static constexpr int kBM = kRows;              // query rows of a CTA
  static constexpr int kBN = kKeys;              // keys of a K/V block
  static constexpr int kConsumers = kRows / 64;  // consumer warpgroups: 64 query rows each
  static_assert(kRows % 64 == 0, "64 query rows per consumer warpgroup");
  static_assert(kKeys % 16 == 0, "O += P V takes 16 keys per wgmma");
};
using BaseTile = TileShape<kBaseTile.rows, kBaseTile.keys>;  // v1-v4

// Shared memory, as TMA writes it (hopper_ptx.cuh, make_desc): a tile of R rows x D columns is
// D / 64 panels of R rows x 128 bytes, each panel 1024-byte aligned.
//   Q        kBM x D                 (reused for the output tile at the end)
//   K, V     kStages x (kBN x D) each
//   barriers full_q, full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages], zeroed_v
//   scratch  2 floats per consumer thread (v3 stores its row sums there to pin the softmax)
template <int D, int kStages, class Tile>
struct Smem {
  static constexpr int kPanels = D / 64;
  static constexpr int kQPanel = Tile::kBM * kPanelBytes;   // bytes of one Q panel
  static constexpr int kKVPanel = Tile::kBN * kPanelBytes;  // bytes of one K or V panel
  static constexpr int kQBytes = kPanels * kQPanel;
  static constexpr int kKVBytes = kPanels * kKVPanel;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQBytes;
  static constexpr int kV = kK + kStages * kKVBytes;
  static constexpr int kBarriers = kV + kStages * kKVBytes;
  static constexpr int kBarrierCount = 2 + 4 * kStages;
  static constexpr int kScratch = kBarriers + ((kBarrierCount * 8 + 15) / 16) * 16;
  // + 1024: the dynamic shared memory is only 16-byte aligned; the kernel rounds its base up.
  static constexpr int kBytes = kScratch + 2 * Tile::kConsumers * kWarpgroup * 4 + 1024;
  static_assert(kQPanel % 1024 == 0 && kKVPanel % 1024 == 0, "every panel on a 1024-byte boundary");
};

// The 1024-byte aligned base of the dynamic shared memory.
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  const uint32_t addr = smem_addr(raw);
  return raw + ((1024 - (addr & 1023)) & 1023);
}

// Byte offset of 16-byte chunk `chunk` (0 .. D/8 - 1) of row `row` in a swizzled tile whose
// panels are `panel_bytes` apart: what TMA's 128-byte swizzle does to an address.
__device__ __forceinline__ uint32_t swizzled_chunk(int row, int chunk, int panel_bytes) {
  return static_cast<uint32_t>((chunk / 8) * panel_bytes + row * kPanelBytes + (((chunk % 8) ^ (row % 8)) * 16));
}

// Issue the TMA copies of one [rows x D] tile (D / 64 boxes of 64 columns) at row `row0` of head
// `head` of batch `batch`, announcing their bytes on `bar` first. One thread calls this.
template <int D>
__device__ __forceinline__ void load_tile(unsigned char* dst, int panel_bytes, const CUtensorMap* map, uint64_t* bar,
                                          int row0, int head, int batch) {
  mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>((D / 64) * panel_bytes));
#pragma unroll
  for (int p = 0; p < D / 64; ++p) tma_load_4d(dst + p * panel_bytes, map, bar, p * 64, row0, head, batch);
}

// Where a block's keys stop being visible to a warpgroup. key_lengths padding: keys at or past
// kv_len are hidden; causal: key j is hidden from row i when j > i.
struct Visibility {
  int kv_len;  // valid keys of this batch
  int causal;
};

// Which query rows and which K/V a block works on, and how many key blocks it visits.
struct Block {
  int m0;         // first query row of the CTA's tile
  int batch;
  int head;       // query head: of q, o and lse
  int kv_head;    // the head's K/V head (grouped-query attention: head / (H / H_kv))
  Visibility vis;
  int j0;         // first key block visited: 0, except in v7's pieces of a tile
  int n_blocks;   // key blocks visited from j0: up to the last visible key
};

// The tile of query block m_block of (head, batch).
template <class Tile>
__device__ __forceinline__ Block block_at(const Params& p, int m_block, int head, int batch) {
  constexpr int kBM = Tile::kBM, kBN = Tile::kBN;
  Block b;
  b.m0 = m_block * kBM;
  b.batch = batch;
  b.head = head;
  b.kv_head = head / (p.H / p.H_kv);
  b.vis = Visibility{p.key_lengths != nullptr ? p.key_lengths[batch] : p.Sk, p.causal};
  const int kv_end = p.causal ? min(b.vis.kv_len, b.m0 + kBM) : b.vis.kv_len;
  b.j0 = 0;
  b.n_blocks = (kv_end + kBN - 1) / kBN;
  return b;
}

// Tile i of v5's grid in launch order (tile_grid: query blocks of one (head, batch) side by side,
// the last query block first), for the kernels that number their tiles themselves (v6, v7).
template <class Tile>
__device__ __forceinline__ Block tile_in_grid_order(const Params& p, int m_blocks, int i) {
  return block_at<Tile>(p, m_blocks - 1 - i % m_blocks, (i / m_blocks) % p.H, i / (m_blocks * p.H));
}

// One CTA per tile: the grid is (query blocks, heads, batches), the last query block first (long
// causal rows start first).
template <class Tile>
__device__ __forceinline__ Block block_of(const Params& p) {
  return block_at<Tile>(p, static_cast<int>(gridDim.x - 1 - blockIdx.x), blockIdx.y, blockIdx.z);
}

// True when key block j (of kBN keys) holds keys past the batch's key_lengths that are still
// inside Sk: rows that TMA read from memory (anything, even NaN) and that must be zeroed before
// O += P V_j.
template <int kBN>
__device__ __forceinline__ bool holds_padding(const Visibility& vis, int Sk, int j) {
  return vis.kv_len < Sk && j * kBN + kBN > vis.kv_len;
}

// S = Q K^T for this warpgroup's 64 rows and the kBN keys of a stage: D / 16 wgmmas (k = 16 each),
// the first one overwriting S (scale_d = 0), issued but neither committed nor waited for.
// q_base: the warpgroup's first row in the Q tile.
template <typename T, int D, class Tile>
__device__ __forceinline__ void qk_issue(float (&s)[Tile::kBN / 2], uint32_t q_base, uint32_t k_base) {
  constexpr int kBM = Tile::kBM, kBN = Tile::kBN;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    // k-step kk: panel kk / 4, bytes 32 (kk % 4) inside the 128-byte rows
    const uint32_t offset_q = (kk / 4) * (kBM * kPanelBytes) + (kk % 4) * 32;
    const uint32_t offset_k = (kk / 4) * (kBN * kPanelBytes) + (kk % 4) * 32;
    wgmma_ss<T, kBN>(s, desc_k_major(q_base + offset_q), desc_k_major(k_base + offset_k), kk > 0 ? 1 : 0);
  }
}

// S = Q K^T, issued and waited for.
template <typename T, int D, class Tile>
__device__ __forceinline__ void qk_gemm(float (&s)[Tile::kBN / 2], uint32_t q_base, uint32_t k_base) {
  fence_operand(s);
  wgmma_fence();
  qk_issue<T, D, Tile>(s, q_base, k_base);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operand(s);
}

// Where the block needs it (keys past kv_len, the causal diagonal), hidden scores become -inf.
// row0: the sequence row of this thread's first row (g); n0: the block's first key.
template <int kScores>
__device__ __forceinline__ void mask_scores(float (&s)[kScores], int row0, int n0, const Visibility& vis,
                                            bool need_mask) {
  constexpr int kBN = 2 * kScores;  // a thread holds 2 of a block's kBN scores per n8 tile
  if (!need_mask) return;
  const int t = static_cast<int>(threadIdx.x % 4);
#pragma unroll
  for (int idx = 0; idx < kBN / 2; ++idx) {
    const int i = row0 + ((idx % 4) / 2) * 8;             // row g or g + 8
    const int j = n0 + (idx / 4) * 8 + 2 * t + idx % 2;   // n8 tile idx / 4, column 2t or 2t + 1
    if (j >= vis.kv_len || (vis.causal && j > i)) s[idx] = -CUDART_INF_F;
  }
}

// The first step j >= 1 of b's key loop (block b.j0 + j; step 0 is the loop's prologue) that may
// hide a score of some row of the tile. Steps 1 .. j - 1 hide none (every key valid and, with
// causal, at or left of the tile's first row b.m0): the loops run them through a copy of their step
// without mask_scores, whose tests the compiler would otherwise issue, predicated, in every block.
// The tile's bound, not the warpgroup's: every consumer runs the same loops.
template <int kBN>
__device__ __forceinline__ int first_masked_step(const Block& b) {
  const int unmasked_blocks = (b.vis.causal ? min(b.vis.kv_len, b.m0 + 1) : b.vis.kv_len) / kBN;
  return max(1, min(unmasked_blocks - b.j0, b.n_blocks));
}

// Online softmax in FP32 on this thread's two rows (h = 0: row g, h = 1: row g + 8), in log2 units
// (c = scale log2 e > 0, m in those units): m_new = max(m, c rowmax(S)), P = 2^(c S - m_new) in
// place of S (one FFMA and one ex2 per score: the scale is folded into the exponent's argument),
// l = alpha l + rowsum(P) with alpha = 2^(m - m_new), returned for the O rescale. c > 0 lets the
// max run on the unscaled scores (the host turns scale <= 0 into that case). A row's kBN scores are spread over the 4 lanes of its
// quad: the max needs two shuffles; l stays the lane's partial sum until the end. A row with no
// visible key so far keeps m = -inf and subtracts 0 instead, so P = 0 and alpha = 0, never NaN.
template <int kScores>
__device__ __forceinline__ void softmax_step(float (&s)[kScores], float c, float (&m)[2], float (&l)[2],
                                             float (&alpha)[2]) {
  constexpr int kBN = 2 * kScores;
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax TODO (Lines 10-13) as Step 3 here, once the teaching kernel's tests pass: on this thread's two rows (h = 0: row g, h = 1: row g + 8) of the wgmma S fragment, whose kBN scores are spread over the 4 lanes of a quad (a row's max needs two shuffles); the scale c = scale log2 e > 0 is folded into the exponent (P = 2^(c S - m), m in log2 units, tc::exp2_approx), P replaces S in place, l stays the lane's partial sum, and the rescale factor alpha is returned instead of applied to O (rescale_o below does that; v3 calls it later) (README: Design)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float row_max = -CUDART_INF_F;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) row_max = fmaxf(row_max, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    const float m_new = fmaxf(m[h], row_max * c);
    const float m_use = m_new == -CUDART_INF_F ? 0.0f : m_new;
    alpha[h] = tc::exp2_approx(m[h] - m_use);
    m[h] = m_new;
    float row_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) {
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        s[4 * j + e] = tc::exp2_approx(fmaf(s[4 * j + e], c, -m_use));
        row_sum += s[4 * j + e];
      }
    }
    l[h] = l[h] * alpha[h] + row_sum;
  }
  // END SOLUTION
}

// O = alpha O, row by row.
template <int D>
__device__ __forceinline__ void rescale_o(float (&o)[D / 2], const float (&alpha)[2]) {
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax TODO (Lines 10-13), its rescale of O, as the end of Step 3 here, once the teaching kernel's tests pass: O = alpha O on this thread's wgmma O fragment, in which element 4j + e (n8 tile j) belongs to row g when e < 2 and to row g + 8 otherwise (README: Design)
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[4 * j + e] *= alpha[e / 2];
  }
  // END SOLUTION
}

// The softmax step and the O rescale together (v1, v2).
template <int D, int kScores>
__device__ __forceinline__ void online_softmax(float (&s)[kScores], float c, float (&m)[2], float (&l)[2],
                                               float (&o)[D / 2]) {
  float alpha[2];
  softmax_step(s, c, m, l, alpha);
  rescale_o<D>(o, alpha);
}

// P rounded to T in registers: the accumulator fragments of n8 tiles 2kk and 2kk + 1 are exactly
// wgmma's A fragment for keys 16kk .. 16kk + 15.
template <typename T, int kScores>
__device__ __forceinline__ void pack_p(const float (&p)[kScores], uint32_t (&a)[kScores / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kScores / 8; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) a[kk][r] = tc::pack2<T>(p[8 * kk + 2 * r], p[8 * kk + 2 * r + 1]);
    fence_operand(a[kk]);
  }
}

// O += P V: kBN / 16 wgmmas, P from registers, V MN-major from the stage; issued, not committed.
template <typename T, int D, int kSteps>
__device__ __forceinline__ void pv_issue(float (&o)[D / 2], const uint32_t (&a)[kSteps][4], uint32_t v_base) {
  constexpr int kBN = 16 * kSteps;
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) {
    // 16 keys = two 1024-byte groups of 8 rows; the panels (64 columns of D) are kBN rows apart
    wgmma_rs<T, D>(o, a[kk], desc_mn_major(v_base + kk * 2048, kBN * kPanelBytes));
  }
}

// O += P V, issued and waited for.
template <typename T, int D, int kScores>
__device__ __forceinline__ void pv_gemm(float (&o)[D / 2], const float (&p)[kScores], uint32_t v_base) {
  uint32_t a[kScores / 8][4];
  pack_p<T>(p, a);
  fence_operand(o);
  wgmma_fence();
  pv_issue<T, D>(o, a, v_base);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operand(o);
}

// Key padding: rows [first_row, kRows) of a V stage may hold anything (even NaN) that TMA read from
// the padded keys, and 0 * NaN = NaN in the P V product. The `threads` threads calling this zero
// those rows, then make the writes visible to wgmma (async proxy) and wait for each other on
// named barrier `barrier`. Zeroing whole 128-byte rows needs no swizzle: a row stays a row.
template <int D, int kRows>
__device__ __forceinline__ void zero_padded_rows(unsigned char* v_stage, int first_row, int thread, int threads,
                                                 int barrier) {
  constexpr int kChunks = (D / 64) * kRows * 8;  // 16-byte chunks of the stage
  for (int c = thread; c < kChunks; c += threads) {
    const int row = (c / 8) % kRows;
    if (row >= first_row) *reinterpret_cast<uint4*>(v_stage + c * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_barrier_sync(barrier, threads);
}

// The end of the online softmax for this thread's two rows (h = 0: row g, h = 1: row g + 8): 1 / l
// (0 where l = 0: no visible key) and the row's logsumexp in log2 units, m + log2 l (-inf where
// l = 0).
__device__ __forceinline__ void finish_rows(const float (&m)[2], const float (&l)[2], float (&inv)[2],
                                            float (&lse2)[2]) {
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's Line 15 TODO as the epilogue's first step here, once the teaching kernel's tests pass: for this thread's two rows (h = 0: row g, h = 1: row g + 8), the 4 lanes' partial sums l of a row added, then inv = 1 / l (0 when l = 0) and the logsumexp in log2 units lse2 = m + log2 l (-inf when l = 0) (README: Design)
  // STUB: inv[0] = inv[1] = lse2[0] = lse2[1] = 0.0f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = l[h];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    inv[h] = total > 0.0f ? __frcp_rn(total) : 0.0f;
    lse2[h] = total > 0.0f ? m[h] + log2f(total) : -CUDART_INF_F;
  }
  // END SOLUTION
}

// Epilogue of one warpgroup for rows already finished: O inv, rounded to T, staged in the
// warpgroup's own rows of a tile laid out as Q's (swizzled, no bank conflicts) and stored as
// coalesced 16-byte chunks; lse = lse2 ln 2 (natural log) when asked. `barrier`: a named barrier of
// the warpgroup's 128 threads.
template <typename T, int D, class Tile>
__device__ __forceinline__ void store_rows(const float (&o)[D / 2], const float (&inv)[2], const float (&lse2)[2],
                                           unsigned char* sO, int wg, const Params& p, const Block& b,
                                           int barrier) {
  constexpr int kBM = Tile::kBM;
  const int m0 = b.m0;
  const int tid = static_cast<int>(threadIdx.x % kWarpgroup);
  const int lane = tid % 32;
  const int tile_row = wg * 64 + (tid / 32) * 16 + lane / 4;  // row g in the kBM tile
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = tile_row + 8 * h;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      unsigned char* dst = sO + swizzled_chunk(row, j, kBM * kPanelBytes) + (lane % 4) * 4;
      *reinterpret_cast<uint32_t*>(dst) = tc::pack2<T>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
    }
    if (p.lse != nullptr && lane % 4 == 0 && m0 + row < p.Sq)
      p.lse[(static_cast<int64_t>(b.batch) * p.H + b.head) * p.Sq + m0 + row] = lse2[h] * kLn2;
  }
  named_barrier_sync(barrier, kWarpgroup);
  T* out = static_cast<T*>(p.o) + b.batch * p.o_stride_b + b.head * p.o_stride_h;
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int n = 0; n < 64 * kChunks / kWarpgroup; ++n) {
    const int idx = n * kWarpgroup + tid;
    const int row = wg * 64 + idx / kChunks;
    const int c = idx % kChunks;
    if (m0 + row < p.Sq) {
      const uint4 val = *reinterpret_cast<const uint4*>(sO + swizzled_chunk(row, c, kBM * kPanelBytes));
      *reinterpret_cast<uint4*>(out + (m0 + row) * p.o_stride_s + c * 8) = val;
    }
  }
}

// Epilogue of one warpgroup: finish_rows, then store_rows through sO (the Q tile, or v6's own).
template <typename T, int D, class Tile>
__device__ __forceinline__ void store_output(const float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                             unsigned char* sO, int wg, const Params& p, const Block& b,
                                             int barrier) {
  float inv[2], lse2[2];
  finish_rows(m, l, inv, lse2);
  store_rows<T, D, Tile>(o, inv, lse2, sO, wg, p, b, barrier);
}

}  // namespace hopper
