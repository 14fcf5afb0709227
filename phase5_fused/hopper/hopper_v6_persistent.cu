// Phase 5, Hopper v6: v5 with persistent CTAs (FlashAttention-3's tile scheduler, in a static
// form); non-causal calls at D = 64 run v5.
//
// v1-v5 launch one CTA per tile of query rows: each CTA initializes its barriers, loads Q and its
// first K/V blocks while its tensor cores wait, and ends with an epilogue during which nothing
// loads. v6 launches one CTA per SM (at most one per tile), and each CTA works on one tile after
// another (the schedule: tile_of_round). Three things then carry over from one tile to the next
// instead of starting again:
//   - the K/V ring: the producer's block counter g runs on across tiles (stage g % kStages, phase
//     g / kStages), so it loads the next tile's first blocks while the consumers still work on the
//     last ones of this tile, and during their epilogue;
//   - Q: released (empty_q) as soon as the tile's last S = Q K^T has landed, so the next tile's Q
//     loads during the tail's P V and the epilogue; the output is staged in its own tile (sO);
//   - the turn: it passes on across tiles; warpgroup 0 takes the last one after the last tile.
// Padded V rows: the producer zeroes them as in v4, and announces every V stage it fills on
// zeroed_v[s] as well (at once when nothing needs zeroing), so that a consumer waiting for a
// zeroed block sees the phase of that use of the stage, never one a tile later.
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>

#include "hopper_launch.cuh"
#include "hopper_pipeline.cuh"

namespace hopper {
namespace {

template <int D>
using Tile = TileShape<tile_size(6, D).rows, tile_size(6, D).keys>;

// v5's shared memory (Smem) followed by the output tile and v6's own barriers:
//   sO        kBM x D, the epilogue's staging (Q's panels layout)
//   empty_q   one arrival per consumer warp: every S = Q K^T of the tile landed
//   zeroed_v  [kStages], one arrival (the producer's) per fill of the stage
template <int D>
struct PersistentSmem {
  using Base = Smem<D, kStages, Tile<D>>;
  static constexpr int kO = (Base::kBytes - 1024 + 1023) / 1024 * 1024;
  static constexpr int kEmptyQ = kO + Base::kQBytes;
  static constexpr int kZeroedV = kEmptyQ + 8;
  static constexpr int kBytes = kZeroedV + 8 * kStages + 1024;  // + 1024: aligning the base
};

// The schedule: CTA c of G takes one tile per round r, tile index r G + c (none where that index is
// past the last tile).
//   non-causal: every tile is equally long; index i is v5's grid order (query blocks of one
//               (head, batch) side by side, so that the CTAs of a round share K/V in L2);
//   causal:     tiles sorted longest first (index i is query block m_blocks - 1 - i / (H B) of
//               (head, batch) i % (H B)), and in odd rounds CTA c takes r G + G - 1 - c instead: a
//               CTA that got one of the longest tiles of a round gets one of the shortest of the
//               next. (In v5's order with G a multiple of the query blocks per head, CTA c would
//               get the same query block, as long or as short, in every round.)
__device__ __forceinline__ int tile_of_round(const Params& p, int r, int tiles) {
  const int c = static_cast<int>(blockIdx.x), G = static_cast<int>(gridDim.x);
  const int i = r * G + (p.causal && r % 2 == 1 ? G - 1 - c : c);
  return i < tiles ? i : -1;
}

template <int D>
__device__ __forceinline__ Block tile_block(const Params& p, int m_blocks, int i) {
  if (!p.causal) return tile_in_grid_order<Tile<D>>(p, m_blocks, i);
  const int bh = i % (p.H * p.B);
  return block_at<Tile<D>>(p, m_blocks - 1 - i / (p.H * p.B), bh % p.H, bh / p.H);
}

template <typename T, int D>
__global__ void __launch_bounds__(threads_of(Tile<D>::kConsumers), 1)
    hopper_v6_kernel(const __grid_constant__ Params p) {
  using Tl = Tile<D>;
  using L = PersistentSmem<D>;
  using LB = typename L::Base;
  constexpr int kBN = Tl::kBN, kConsumers = Tl::kConsumers;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  unsigned char* sQ = smem + LB::kQ;
  unsigned char* sO = smem + L::kO;
  uint64_t* empty_q = reinterpret_cast<uint64_t*>(smem + L::kEmptyQ);
  uint64_t* zeroed_v = reinterpret_cast<uint64_t*>(smem + L::kZeroedV);
  if (threadIdx.x == 0) {
    mbarrier_init(empty_q, kConsumers * 4);  // one arrival per consumer warp
    for (int s = 0; s < kStages; ++s) mbarrier_init(&zeroed_v[s], 1);
  }
  const Pipeline pipe = init_pipeline<D, Tl>(smem);  // initializes the rest, then __syncthreads
  const int m_blocks = (p.Sq + Tl::kBM - 1) / Tl::kBM;
  const int tiles = m_blocks * p.H * p.B;
  auto stage_k = [&](int g) { return smem + LB::kK + (g % kStages) * LB::kKVBytes; };
  auto stage_v = [&](int g) { return smem + LB::kV + (g % kStages) * LB::kKVBytes; };

  const int warpgroup = static_cast<int>(threadIdx.x) / kWarpgroup;  // 0: producer, 1..: consumers
  if (warpgroup == 0) {
    // Producer: one warp follows the ring, its lane 0 issues every copy, and the warp zeroes the
    // padded V rows; the other three warps of the warpgroup have nothing to do.
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x >= 32) return;
    if (threadIdx.x == 0) {
      tma_prefetch_map(&p.q_map);
      tma_prefetch_map(&p.k_map);
      tma_prefetch_map(&p.v_map);
    }
    // Every lane follows the ring (waits on the empty barriers), so that the whole warp knows which
    // fill of a stage it zeroes; lane 0 alone issues.
    const bool issuer = threadIdx.x == 0;
    int g = 0, n = 0;  // blocks and tiles (with a visible key) loaded so far
    for (int r = 0; r * static_cast<int>(gridDim.x) < tiles; ++r) {
      const int t = tile_of_round(p, r, tiles);
      if (t < 0) continue;
      const Block b = tile_block<D>(p, m_blocks, t);
      if (b.n_blocks == 0) continue;
      if (issuer) {
        mbarrier_wait(empty_q, (n & 1) ^ 1);
        load_tile<D>(sQ, LB::kQPanel, &p.q_map, pipe.full_q, b.m0, b.head, b.batch);
      }
      for (int j = 0; j < b.n_blocks; ++j, ++g) {
        const int s = g % kStages;
        const bool padded = holds_padding<kBN>(b.vis, p.Sk, j);
        const uint32_t released = ((g / kStages) & 1) ^ 1;  // the stage's fill g - kStages consumed
        mbarrier_wait(&pipe.empty_k[s], released);
        if (issuer) load_tile<D>(stage_k(g), LB::kKVPanel, &p.k_map, &pipe.full_k[s], j * kBN, b.kv_head, b.batch);
        mbarrier_wait(&pipe.empty_v[s], released);
        if (issuer) {
          // Nothing to zero: zeroed_v's phase for this fill completes before its copy is issued.
          if (!padded) mbarrier_arrive(&zeroed_v[s]);
          load_tile<D>(stage_v(g), LB::kKVPanel, &p.v_map, &pipe.full_v[s], j * kBN, b.kv_head, b.batch);
        }
        if (padded) {
          mbarrier_wait(&pipe.full_v[s], (g / kStages) & 1);
          zero_padded_rows<D, kBN>(stage_v(g), b.vis.kv_len - j * kBN, static_cast<int>(threadIdx.x), 32,
                                   kZeroBarrier);
          if (issuer) mbarrier_arrive(&zeroed_v[s]);
        }
      }
      ++n;
    }
    return;
  }

  // Consumers: take the registers, then v4's loop on each tile, the counters running on.
  setmaxnreg_inc<consumer_regs(kConsumers)>();
  const int wg = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) - kWarpgroup;  // 0 .. 64 kConsumers - 1 over the consumers
  const int warp_row = (tid % kWarpgroup) / 32 * 16 + (tid % 32) / 4;
  const uint32_t q_base = smem_addr(sQ) + wg * 64 * kPanelBytes;
  volatile float* scratch = reinterpret_cast<volatile float*>(smem + LB::kScratch);  // 2 floats per consumer thread
  auto wait_turn = [&] { named_barrier_sync(kTurnBarrier + wg, 2 * kWarpgroup); };
  auto pass_turn = [&] { named_barrier_arrive(kTurnBarrier + (wg + 1) % kConsumers, 2 * kWarpgroup); };
  const bool last_wg = wg == kConsumers - 1;
  bool started = false;  // the turn has been handed to warpgroup 0 once
  int g = 0, n = 0;      // the producer's counters

  for (int r = 0; r * static_cast<int>(gridDim.x) < tiles; ++r) {
    const int t = tile_of_round(p, r, tiles);
    if (t < 0) continue;
    const Block b = tile_block<D>(p, m_blocks, t);
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
    float l[2] = {0.0f, 0.0f};
    const int wg_row0 = b.m0 + wg * 64;
    const int row0 = wg_row0 + warp_row;
    auto need_mask = [&](int n0) { return n0 + kBN > b.vis.kv_len || (b.vis.causal && n0 + kBN - 1 > wg_row0); };
    // V of global block gj (block j of the tile) landed, and zeroed where it holds padding.
    auto wait_v = [&](int gj, int j) {
      if (holds_padding<kBN>(b.vis, p.Sk, j)) {
        mbarrier_wait(&zeroed_v[gj % kStages], (gj / kStages) & 1);
      } else {
        mbarrier_wait(&pipe.full_v[gj % kStages], (gj / kStages) & 1);
      }
    };

    float sc[kBN / 2];
    uint32_t pa[kBN / 16][4];  // P of the previous block, rounded, the A operand of its P V
    float alpha[2];
    if (b.n_blocks > 0) {
      // Block 0: S_0 = Q K_0^T and its softmax.
      if (!started && last_wg) pass_turn();  // warpgroup 0 goes first
      started = true;
      mbarrier_wait(pipe.full_q, n & 1);
      mbarrier_wait(&pipe.full_k[g % kStages], (g / kStages) & 1);
      wait_turn();
      fence_operand(sc);
      wgmma_fence();
      qk_issue<T, D, Tl>(sc, q_base, smem_addr(stage_k(g)));
      wgmma_commit();
      pass_turn();
      wgmma_wait<0>();
      fence_operand(sc);
      release(&pipe.empty_k[g % kStages]);
      mask_scores(sc, row0, 0, b.vis, need_mask(0));
      softmax_step(sc, p.scale_log2, m, l, alpha);
      pack_p<T>(sc, pa);

      for (int j = 1; j < b.n_blocks; ++j) {
        const int gj = g + j;
        const int s = gj % kStages;            // stage of block j (K_j)
        const int sp = (gj - 1) % kStages;     // stage of block j - 1 (V_{j-1})
        const int n0 = j * kBN;
        mbarrier_wait(&pipe.full_k[s], (gj / kStages) & 1);
        wait_v(gj - 1, j - 1);
        wait_turn();
        fence_operand(sc);
        fence_operand(o);
        wgmma_fence();
        qk_issue<T, D, Tl>(sc, q_base, smem_addr(stage_k(gj)));
        wgmma_commit();
        pv_issue<T, D>(o, pa, smem_addr(stage_v(gj - 1)));
        wgmma_commit();
        pass_turn();
        wgmma_wait<1>();
        fence_operand(sc);
        release(&pipe.empty_k[s]);
        mask_scores(sc, row0, n0, b.vis, need_mask(n0));
        softmax_step(sc, p.scale_log2, m, l, alpha);
        fence_operand(sc);  // the softmax pinned between the two waits, as in v3 and v4
        scratch[2 * tid] = l[0];
        scratch[2 * tid + 1] = l[1];
        wgmma_wait<0>();
        fence_operand(o);
        release(&pipe.empty_v[sp]);
        rescale_o<D>(o, alpha);
        pack_p<T>(sc, pa);
      }

      // Every S = Q K^T of the tile landed: Q's tile may take the next tile's Q.
      release(empty_q);
      // Tail: O += P V of the last block; the turn passes on to the next tile.
      const int j = b.n_blocks - 1;
      wait_v(g + j, j);
      wait_turn();
      fence_operand(o);
      wgmma_fence();
      pv_issue<T, D>(o, pa, smem_addr(stage_v(g + j)));
      wgmma_commit();
      pass_turn();
      wgmma_wait<0>();
      fence_operand(o);
      release(&pipe.empty_v[(g + j) % kStages]);
      g += b.n_blocks;
      ++n;
    }

    // The warpgroup's previous reads of its rows of sO are done; then v4's epilogue through sO.
    named_barrier_sync(kEpilogueBarrier + wg, kWarpgroup);
    store_output<T, D, Tl>(o, m, l, sO, wg, p, b, kEpilogueBarrier + wg);
  }
  // The last warpgroup's last hand-over is warpgroup 0's: take it, so that no barrier is left half full.
  if (started && wg == 0) wait_turn();
}

}  // namespace

void launch_v6(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  // Non-causal at D = 64 the persistent loop measured slower than v5 (README: v6).
  if (!p.causal && D == 64) {
    launch_v5(p, D, dtype, stream);
    return;
  }
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    // One CTA per SM (a CTA takes most of an SM's shared memory), at most one per tile.
    const int64_t tiles = tile_count<Tile<kD>>(p);
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    launch_on_grid<hopper_v6_kernel<T, kD>, PersistentSmem<kD>::kBytes, threads_of(Tile<kD>::kConsumers)>(
        p, dim3(static_cast<unsigned>(std::min<int64_t>(tiles, sms))), stream);
  });
}

}  // namespace hopper
