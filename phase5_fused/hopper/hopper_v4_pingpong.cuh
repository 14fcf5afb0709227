// Phase 5, Hopper v4: v3 with the consumer warpgroups taking turns on the tensor cores
// (FlashAttention-3, Section 3.1, "pingpong scheduling"). The loop of v4 and v5, for any tile:
// hopper_v4_pingpong.cu runs it on two consumer warpgroups (kBaseTile), hopper_v5_tiles.cu on the
// tile of each head dim (three warpgroups at D = 64).
//
// In v3 the consumer warpgroups run free. They start together (both wait for the same K_0) and
// stay in step, so both issue their matmuls at the same moment and both compute a softmax at the
// same moment, while the tensor cores idle. v4 makes them alternate: a warpgroup issues its
// matmuls of a block only on its turn, and hands the turn to the other one right after issuing:
//
//   warpgroup 0:  issue S_j, P V | softmax(S_j) ........ | issue S_j+1, P V | softmax ...
//   warpgroup 1:  (wait turn)    | issue S_j, P V        | softmax(S_j) ... | issue ...
//   tensor cores: wg 0's matmuls | wg 1's matmuls        | wg 0's matmuls   | ...
//
// The turn passes round the consumer warpgroups in order (0, 1, 0, ... with two; 0, 1, 2, 0, ...
// with three) through one named barrier per warpgroup, kTurnBarrier + wg, of 256 threads: a
// warpgroup waits on its own (bar.sync, its 128 threads) and arrives on the next one's (bar.arrive,
// 128 more, which does not wait); the last warpgroup arrives once before the loop, so warpgroup 0
// goes first.
//
// The turn-taking forbids any other barrier of all consumer warpgroups inside the loop: v2 and
// v3 zero the padded V rows with all consumer threads (named barrier kZeroBarrier), and a
// warpgroup that waits there while another waits for its turn deadlocks. v4 has the producer
// warp zero them (produce<D, true, Tile>) and the consumers wait for the zeroed block on zeroed_v.
#pragma once

#include <type_traits>

#include "hopper_launch.cuh"
#include "hopper_pipeline.cuh"

namespace hopper {

// The whole kernel of v4, v5 and v7 for the key blocks b.j0 .. b.j0 + b.n_blocks - 1 of a tile:
// the producer and the consumers' loop, then epilogue(o, m, l, sQ, wg) on each consumer warpgroup
// (o, m, l: its thread's share of the online softmax's state; sQ: the Q tile, free for the output).
template <typename T, int D, class Tile, class Epilogue>
__device__ __forceinline__ void pingpong_tile(const Params& p, const Block& b, Epilogue&& epilogue) {
  using L = Smem<D, kStages, Tile>;
  constexpr int kBN = Tile::kBN, kConsumers = Tile::kConsumers;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  unsigned char* sQ = smem + L::kQ;
  const Pipeline pipe = init_pipeline<D, Tile>(smem);

  const int warpgroup = static_cast<int>(threadIdx.x) / kWarpgroup;  // 0: producer, 1..: consumers
  if (warpgroup == 0) {
    produce<D, true, Tile>(p, smem, pipe, b);
    return;
  }

  // Consumers: take the registers, then FlashAttention's inner loop on this warpgroup's 64 rows.
  setmaxnreg_inc<consumer_regs(kConsumers)>();
  const int wg = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) - kWarpgroup;  // 0 .. 64 kConsumers - 1 over the consumers
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l[2] = {0.0f, 0.0f};
  const int wg_row0 = b.m0 + wg * 64;
  const int row0 = wg_row0 + (tid % kWarpgroup) / 32 * 16 + (tid % 32) / 4;
  const uint32_t q_base = smem_addr(sQ) + wg * 64 * kPanelBytes;
  volatile float* scratch = reinterpret_cast<volatile float*>(smem + L::kScratch);  // 2 floats per consumer thread
  auto stage_k = [&](int j) { return smem_addr(smem + L::kK + (j % kStages) * L::kKVBytes); };
  auto stage_v = [&](int j) { return smem + L::kV + (j % kStages) * L::kKVBytes; };
  auto need_mask = [&](int n0) { return n0 + kBN > b.vis.kv_len || (b.vis.causal && n0 + kBN - 1 > wg_row0); };
  // V_j landed (and, for the block with padded keys, zeroed by the producer).
  auto wait_v = [&](int j) {
    if (holds_padding<kBN>(b.vis, p.Sk, b.j0 + j)) {
      mbarrier_wait(pipe.zeroed_v, 0);
    } else {
      mbarrier_wait(&pipe.full_v[j % kStages], (j / kStages) & 1);
    }
  };
  auto wait_turn = [&] { named_barrier_sync(kTurnBarrier + wg, 2 * kWarpgroup); };
  auto pass_turn = [&] { named_barrier_arrive(kTurnBarrier + (wg + 1) % kConsumers, 2 * kWarpgroup); };
  const bool last_wg = wg == kConsumers - 1;

  // Block 0: S_0 = Q K_0^T and its softmax (O is still zero: nothing to rescale).
  float sc[kBN / 2];
  uint32_t pa[kBN / 16][4];  // P of the previous block, rounded, the A operand of its P V
  float alpha[2];
  if (b.n_blocks > 0) {
    if (last_wg) pass_turn();  // warpgroup 0 goes first
    mbarrier_wait(pipe.full_q, 0);
    mbarrier_wait(&pipe.full_k[0], 0);
    wait_turn();
    fence_operand(sc);
    wgmma_fence();
    qk_issue<T, D, Tile>(sc, q_base, stage_k(0));
    wgmma_commit();
    pass_turn();
    wgmma_wait<0>();
    fence_operand(sc);
    release(&pipe.empty_k[0]);
    mask_scores(sc, row0, b.j0 * kBN, b.vis, need_mask(b.j0 * kBN));
    softmax_step(sc, p.scale_log2, m, l, alpha);
    pack_p<T>(sc, pa);
  }

  // One block j >= 1 of the loop. The masked copy (kMasked) tests the scores of the blocks that may
  // hide some (need_mask); the unmasked copy has no mask code at all.
  auto key_step = [&](const int j, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int s = j % kStages;            // stage of block j (K_j)
    const int sp = (j - 1) % kStages;     // stage of block j - 1 (V_{j-1})
    const int n0 = (b.j0 + j) * kBN;      // its first key
    // Issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: two commit groups in flight.
    // Issue them on this warpgroup's turn, then hand the turn over.
    mbarrier_wait(&pipe.full_k[s], (j / kStages) & 1);
    wait_v(j - 1);
    wait_turn();
    fence_operand(sc);
    fence_operand(o);
    wgmma_fence();
    qk_issue<T, D, Tile>(sc, q_base, stage_k(j));
    wgmma_commit();
    pv_issue<T, D>(o, pa, smem_addr(stage_v(j - 1)));
    wgmma_commit();
    pass_turn();
    // Wait for S_j only (at most one group, the P V, still pending): release K_j; mask and
    // softmax while the P V runs.
    wgmma_wait<1>();
    fence_operand(sc);
    release(&pipe.empty_k[s]);
    if constexpr (kMasked) mask_scores(sc, row0, n0, b.vis, need_mask(n0));
    softmax_step(sc, p.scale_log2, m, l, alpha);
    // Pin the softmax before the next wait. The compiler's order is not enough: ptxas schedules the
    // exponentials next to their first use (the rounding of P, after the wait), which serializes
    // the softmax behind the P V again (seen in the SASS). It keeps shared-memory stores on their
    // side of wgmma.wait_group, and the row sums depend on every exponential of the block: storing
    // them (to a scratch slot nobody reads) keeps the whole softmax between the two waits.
    fence_operand(sc);
    scratch[2 * tid] = l[0];
    scratch[2 * tid + 1] = l[1];
    // P_{j-1} V_{j-1} done: release V_{j-1}, rescale O for block j, round P_j for the next P V.
    wgmma_wait<0>();
    fence_operand(o);
    release(&pipe.empty_v[sp]);
    rescale_o<D>(o, alpha);
    pack_p<T>(sc, pa);
  };
  // Steps before first_masked_step hide no score: the unmasked copy; the rest the masked one.
  const int j_hi = first_masked_step<kBN>(b);
  for (int j = 1; j < j_hi; ++j) key_step(j, std::false_type{});
  for (int j = j_hi; j < b.n_blocks; ++j) key_step(j, std::true_type{});

  // Tail: O += P V of the last block, on the last turn. The last warpgroup passes no turn after it:
  // each barrier then had as many waits as arrivals, and none is left half full.
  if (b.n_blocks > 0) {
    const int j = b.n_blocks - 1;
    wait_v(j);
    wait_turn();
    fence_operand(o);
    wgmma_fence();
    pv_issue<T, D>(o, pa, smem_addr(stage_v(j)));
    wgmma_commit();
    if (!last_wg) pass_turn();
    wgmma_wait<0>();
    fence_operand(o);
    release(&pipe.empty_v[j % kStages]);
  }

  epilogue(o, m, l, sQ, wg);
}

// The whole kernel of v4 and v5: one CTA per tile, every key block, the output through the Q tile.
template <typename T, int D, class Tile>
__device__ __forceinline__ void pingpong_attention(const Params& p) {
  const Block b = block_of<Tile>(p);
  pingpong_tile<T, D, Tile>(p, b, [&](const float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                      unsigned char* sQ, int wg) {
    store_output<T, D, Tile>(o, m, l, sQ, wg, p, b, kEpilogueBarrier + wg);
  });
}

}  // namespace hopper
