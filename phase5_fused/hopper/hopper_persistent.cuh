// The persistent loop that v6 and v8 share: one CTA per SM works through a list of items, each the
// query rows of one tile and a range of its key blocks, and two things carry over from one item
// to the next instead of starting again (hopper_v6_persistent.cu tells why):
//   - the K/V ring: the producer's block counter g runs on across items (stage g % kStages, phase
//     g / kStages), so it loads the next item's first blocks while the consumers still work on the
//     last ones of this item, and during their epilogue;
//   - Q: released (empty_q) as soon as the item's last S = Q K^T has landed, so the next item's Q
//     loads during the last softmax, the tail's P V and the epilogue; the output is staged in its
//     own tile (sO);
// Padded V rows: the producer zeroes them as in v4, and announces every V stage it fills on
// zeroed_v[s] as well (at once when nothing needs zeroing), so that a consumer waiting for a
// zeroed block sees the phase of that use of the stage, never one an item later.
// The consumer warpgroups run free, as in v3: v4's turns, measured in this loop, cost time at D = 128
// and gained nothing at D = 64 (README: "The persistent loop without turns").
//
// What differs between the versions is the list (a Schedule) and the epilogue (finish):
//   sched.items(p)          how many slots the CTA's list has;
//   sched.at(p, w, work)    item w, or false where the CTA has none in slot w;
//   finish(o, m, l, sO, wg, work)   the epilogue of an item on consumer warpgroup wg, its rows of sO
//                                   free (v6: store_output; v8: a piece's partial result and merge).
#pragma once

#include <type_traits>

#include "hopper_pipeline.cuh"

namespace hopper {

// One item: block b (key blocks b.j0 .. b.j0 + b.n_blocks - 1) and, for a piece of a tile cut
// along the keys (v8), which piece of how many.
struct Work {
  Block b;
  int slot;    // the cut tile's index among the cut tiles, or -1: a whole tile
  int piece;   // 0 .. pieces - 1
  int pieces;
};

// v5's shared memory (Smem) followed by the output tile and the persistent loop's own barriers:
//   sO        kBM x D, the epilogue's staging (Q's panels layout)
//   empty_q   one arrival per consumer warp: every S = Q K^T of the item landed
//   zeroed_v  [kStages], one arrival (the producer's) per fill of the stage
template <int D, class Tl>
struct PersistentSmem {
  using Base = Smem<D, kStages, Tl>;
  static constexpr int kO = (Base::kBytes - 1024 + 1023) / 1024 * 1024;
  static constexpr int kEmptyQ = kO + Base::kQBytes;
  static constexpr int kZeroedV = kEmptyQ + 8;
  static constexpr int kBytes = kZeroedV + 8 * kStages + 1024;  // + 1024: aligning the base
};

// The schedule: CTA c of G takes one tile per round r, tile index r G + c (none where that index is
// past the last tile).
//   non-causal: every tile is equally long; index i is v5's grid order (query blocks of one
//               (head, batch) side by side, so that the CTAs of a round share K/V in L2);
//   causal:     the (head, batch) pairs in sections of p.section_pairs, one section after another;
//               within a section the tiles sorted by length (index j of the section is query block
//               j / n of its n pairs, counted from the longest or the shortest, of pair j % n), and in
//               odd rounds CTA c takes r G + G - 1 - c instead: a CTA that got one of the longest
//               tiles of a round gets one of the shortest of the next. (In v5's order with G a
//               multiple of the query blocks per head, CTA c would get the same query block, as long
//               or as short, in every round.) The last section runs longest first, so the grid ends
//               on the shortest tiles, and the sections before it alternate, so that the lengths
//               never jump from short to long between two sections (the reversed rounds balance a
//               CTA's tiles only where lengths change smoothly). One section, all pairs, wherever
//               the grid's CTAs already share each K/V head (launch_v6 sizes the sections).
__device__ __forceinline__ int tile_of_round(const Params& p, int r, int tiles) {
  const int c = static_cast<int>(blockIdx.x), G = static_cast<int>(gridDim.x);
  const int i = r * G + (p.causal && r % 2 == 1 ? G - 1 - c : c);
  return i < tiles ? i : -1;
}

template <class Tl>
__device__ __forceinline__ Block tile_block(const Params& p, int m_blocks, int i) {
  if (!p.causal) return tile_in_grid_order<Tl>(p, m_blocks, i);
  const int pairs = p.H * p.B;
  const int sections = (pairs + p.section_pairs - 1) / p.section_pairs;
  const int s = i / (p.section_pairs * m_blocks);
  const int first = s * p.section_pairs;          // the section's first pair
  const int n = min(p.section_pairs, pairs - first);  // its pairs (the last section may have fewer)
  const int j = i - first * m_blocks;             // the tile's index in its section
  const bool longest_first = (sections - 1 - s) % 2 == 0;
  const int m_block = longest_first ? m_blocks - 1 - j / n : j / n;
  const int bh = first + j % n;
  return block_at<Tl>(p, m_block, bh % p.H, bh / p.H);
}

// v6's list for the persistent loop: one slot per round, each a whole tile (v8 runs the same rounds
// before its cut tiles).
template <class Tl>
struct TileRounds {
  __device__ int tiles(const Params& p) const { return m_blocks(p) * p.H * p.B; }
  __device__ int m_blocks(const Params& p) const { return (p.Sq + Tl::kBM - 1) / Tl::kBM; }
  __device__ int items(const Params& p) const {
    return (tiles(p) + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  }
  __device__ bool at(const Params& p, int r, Work& work) const {
    const int t = tile_of_round(p, r, tiles(p));
    if (t < 0) return false;
    work = Work{tile_block<Tl>(p, m_blocks(p), t), -1, 0, 1};
    return true;
  }
};

template <typename T, int D, class Tl, class Schedule, class Finish>
__device__ __forceinline__ void persistent_loop(const Params& p, const Schedule& sched, Finish&& finish) {
  using L = PersistentSmem<D, Tl>;
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
  const int items = sched.items(p);
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
    int g = 0, n = 0;  // blocks and items (with a visible key) loaded so far
    for (int w = 0; w < items; ++w) {
      Work work;
      if (!sched.at(p, w, work)) continue;
      const Block& b = work.b;
      if (b.n_blocks == 0) continue;
      if (issuer) {
        mbarrier_wait(empty_q, (n & 1) ^ 1);
        load_tile<D>(sQ, LB::kQPanel, &p.q_map, pipe.full_q, b.m0, b.head, b.batch);
      }
      for (int j = 0; j < b.n_blocks; ++j, ++g) {
        const int s = g % kStages;
        const int n0 = (b.j0 + j) * kBN;  // the block's first key
        const bool padded = holds_padding<kBN>(b.vis, p.Sk, b.j0 + j);
        const uint32_t released = ((g / kStages) & 1) ^ 1;  // the stage's fill g - kStages consumed
        mbarrier_wait(&pipe.empty_k[s], released);
        if (issuer) load_tile<D>(stage_k(g), LB::kKVPanel, &p.k_map, &pipe.full_k[s], n0, b.kv_head, b.batch);
        mbarrier_wait(&pipe.empty_v[s], released);
        if (issuer) {
          // Nothing to zero: zeroed_v's phase for this fill completes before its copy is issued.
          if (!padded) mbarrier_arrive(&zeroed_v[s]);
          load_tile<D>(stage_v(g), LB::kKVPanel, &p.v_map, &pipe.full_v[s], n0, b.kv_head, b.batch);
        }
        if (padded) {
          mbarrier_wait(&pipe.full_v[s], (g / kStages) & 1);
          zero_padded_rows<D, kBN>(stage_v(g), b.vis.kv_len - n0, static_cast<int>(threadIdx.x), 32, kZeroBarrier);
          if (issuer) mbarrier_arrive(&zeroed_v[s]);
        }
      }
      ++n;
    }
    return;
  }

  // Consumers: take the registers, then v4's loop without the turns on each item, the counters running on.
  setmaxnreg_inc<consumer_regs(kConsumers)>();
  const int wg = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) - kWarpgroup;  // 0 .. 64 kConsumers - 1 over the consumers
  const int warp_row = (tid % kWarpgroup) / 32 * 16 + (tid % 32) / 4;
  const uint32_t q_base = smem_addr(sQ) + wg * 64 * kPanelBytes;
  volatile float* scratch = reinterpret_cast<volatile float*>(smem + LB::kScratch);  // 2 floats per consumer thread
  int g = 0, n = 0;  // the producer's counters

  for (int w = 0; w < items; ++w) {
    Work work;
    if (!sched.at(p, w, work)) continue;
    const Block& b = work.b;
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
    float l[2] = {0.0f, 0.0f};
    const int wg_row0 = b.m0 + wg * 64;
    const int row0 = wg_row0 + warp_row;
    auto need_mask = [&](int n0) { return n0 + kBN > b.vis.kv_len || (b.vis.causal && n0 + kBN - 1 > wg_row0); };
    // V of global block gj (block j of the item) landed, and zeroed where it holds padding.
    auto wait_v = [&](int gj, int j) {
      if (holds_padding<kBN>(b.vis, p.Sk, b.j0 + j)) {
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
      const int first = b.j0 * kBN;  // the item's first key
      mbarrier_wait(pipe.full_q, n & 1);
      mbarrier_wait(&pipe.full_k[g % kStages], (g / kStages) & 1);
      fence_operand(sc);
      wgmma_fence();
      qk_issue<T, D, Tl>(sc, q_base, smem_addr(stage_k(g)));
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(sc);
      release(&pipe.empty_k[g % kStages]);
      if (b.n_blocks == 1) release(empty_q);  // the item's only S landed (key_step says why now)
      mask_scores(sc, row0, first, b.vis, need_mask(first));
      softmax_step(sc, p.scale_log2, m, l, alpha);
      pack_p<T>(sc, pa);

      // Block j >= 1 of the item, in v4's two copies: masked (kMasked) and without mask code.
      auto key_step = [&](const int j, auto masked) {
        constexpr bool kMasked = decltype(masked)::value;
        const int gj = g + j;
        const int s = gj % kStages;            // stage of block j (K_j)
        const int sp = (gj - 1) % kStages;     // stage of block j - 1 (V_{j-1})
        const int n0 = (b.j0 + j) * kBN;
        mbarrier_wait(&pipe.full_k[s], (gj / kStages) & 1);
        wait_v(gj - 1, j - 1);
        fence_operand(sc);
        fence_operand(o);
        wgmma_fence();
        qk_issue<T, D, Tl>(sc, q_base, smem_addr(stage_k(gj)));
        wgmma_commit();
        pv_issue<T, D>(o, pa, smem_addr(stage_v(gj - 1)));
        wgmma_commit();
        wgmma_wait<1>();
        fence_operand(sc);
        release(&pipe.empty_k[s]);
        // The item's last S landed: Q's tile may take the next item's Q, whose load then runs under
        // this softmax, the tail's P V and the epilogue.
        if (j == b.n_blocks - 1) release(empty_q);
        if constexpr (kMasked) mask_scores(sc, row0, n0, b.vis, need_mask(n0));
        softmax_step(sc, p.scale_log2, m, l, alpha);
        fence_operand(sc);  // the softmax pinned between the two waits, as in v3 and v4
        scratch[2 * tid] = l[0];
        scratch[2 * tid + 1] = l[1];
        wgmma_wait<0>();
        fence_operand(o);
        release(&pipe.empty_v[sp]);
        rescale_o<D>(o, alpha);
        pack_p<T>(sc, pa);
      };
      const int j_hi = first_masked_step<kBN>(b);
      for (int j = 1; j < j_hi; ++j) key_step(j, std::false_type{});
      for (int j = j_hi; j < b.n_blocks; ++j) key_step(j, std::true_type{});

      // Tail: O += P V of the last block.
      const int j = b.n_blocks - 1;
      wait_v(g + j, j);
      fence_operand(o);
      wgmma_fence();
      pv_issue<T, D>(o, pa, smem_addr(stage_v(g + j)));
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(o);
      release(&pipe.empty_v[(g + j) % kStages]);
      g += b.n_blocks;
      ++n;
    }

    // The warpgroup's previous reads of its rows of sO are done; then the item's epilogue.
    named_barrier_sync(kEpilogueBarrier + wg, kWarpgroup);
    finish(o, m, l, sO, wg, work);
  }
}

}  // namespace hopper
