// The warp-specialized pipeline that v2-v5 and v7 share: the mbarriers of the K/V ring and the
// producer warpgroup (one warp of it) that fills it.
//
//   producer warp (lane 0 issues)             consumer warpgroups (64 query rows each)
//   TMA Q; for each block j:                   wait full_k[s]: S = Q K_j^T ... release empty_k[s]
//     wait empty_k[s], TMA K_j -> full_k[s]    wait full_v[s]: O += P V_j ...  release empty_v[s]
//     wait empty_v[s], TMA V_j -> full_v[s]
//
// K and V of a stage are released separately: a consumer that overlaps its matmuls (v3, v4) is
// done with K_j long before V_j, and the producer can refill K's half of the stage at once.
#pragma once

#include "hopper_kernel.cuh"

namespace hopper {

constexpr int kStages = 2;
constexpr int kProducerRegs = 24;
constexpr int kMaxConsumers = 3;
// Threads of a CTA with `consumers` consumer warpgroups: theirs and the producer warpgroup's.
constexpr int threads_of(int consumers) { return (1 + consumers) * kWarpgroup; }
// The registers each consumer thread takes (setmaxnreg): what the producer's kProducerRegs leave of
// the SM's 65536, shared out and rounded down to a multiple of 8: 240 for two consumer warpgroups,
// 160 for three.
constexpr int consumer_regs(int consumers) {
  return (65536 - kWarpgroup * kProducerRegs) / (consumers * kWarpgroup) / 8 * 8;
}
// Named barriers (0 is __syncthreads): the consumers' zeroing of padded V rows (v2, v3) or the
// producer's (v4, v5) use 1, the epilogue 2 + wg, the turn-taking of v4 and v5 5 + wg.
constexpr int kZeroBarrier = 1;
constexpr int kEpilogueBarrier = 2;
constexpr int kTurnBarrier = kEpilogueBarrier + kMaxConsumers;

// The mbarriers, after the tiles in shared memory (Smem::kBarriers).
//   full_*: one arrival (the producer's expect_tx) + the TMA bytes;
//   empty_*: one arrival per consumer warp;
//   zeroed_v: v4, v5 and v7 only, one arrival: the producer zeroed the padded rows of the last V block.
struct Pipeline {
  uint64_t* full_q;
  uint64_t* full_k;   // [kStages]
  uint64_t* full_v;   // [kStages]
  uint64_t* empty_k;  // [kStages]
  uint64_t* empty_v;  // [kStages]
  uint64_t* zeroed_v;
};

// The barriers' addresses; thread 0 initializes them, then the whole block synchronizes.
template <int D, class Tile>
__device__ __forceinline__ Pipeline init_pipeline(unsigned char* smem) {
  using L = Smem<D, kStages, Tile>;
  static_assert(Tile::kConsumers <= kMaxConsumers, "named barriers for at most kMaxConsumers warpgroups");
  static_assert(L::kBarrierCount >= 2 + 4 * kStages, "room for every barrier of the pipeline");
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  const Pipeline pipe{bars, bars + 1, bars + 1 + kStages, bars + 1 + 2 * kStages, bars + 1 + 3 * kStages,
                      bars + 1 + 4 * kStages};
  if (threadIdx.x == 0) {
    mbarrier_init(pipe.full_q, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&pipe.full_k[s], 1);
      mbarrier_init(&pipe.full_v[s], 1);
      mbarrier_init(&pipe.empty_k[s], Tile::kConsumers * 4);  // one arrival per consumer warp
      mbarrier_init(&pipe.empty_v[s], Tile::kConsumers * 4);
    }
    mbarrier_init(pipe.zeroed_v, 1);
    fence_barrier_init();
  }
  __syncthreads();
  return pipe;
}

// The producer warpgroup: gives its registers away; then one warp follows the ring and its lane 0
// issues every copy (key blocks b.j0 .. b.j0 + b.n_blocks - 1), refilling a stage's K (V) as soon
// as every consumer warp released the K (V) it held. kZeroV (v4, v5, v7): the warp then zeroes the
// padded rows of the last V block and announces it on zeroed_v.
// Every lane waits on every empty barrier, not lane 0 alone: a parity names one of two phases, and
// only a lane that followed the ring knows that full_v[s] is in the phase of the last block, not
// kStages or more blocks behind it (a lane that skipped the loop and waited for the last block's
// parity could pass on an earlier block's fill and zero a stage still in use).
template <int D, bool kZeroV, class Tile>
__device__ __forceinline__ void produce(const Params& p, unsigned char* smem, const Pipeline& pipe, const Block& b) {
  using L = Smem<D, kStages, Tile>;
  constexpr int kBN = Tile::kBN;
  setmaxnreg_dec<kProducerRegs>();
  if (threadIdx.x >= 32) return;
  const bool issuer = threadIdx.x == 0;
  if (issuer && b.n_blocks > 0) {
    tma_prefetch_map(&p.q_map);
    tma_prefetch_map(&p.k_map);
    tma_prefetch_map(&p.v_map);
    load_tile<D>(smem + L::kQ, L::kQPanel, &p.q_map, pipe.full_q, b.m0, b.head, b.batch);
  }
  for (int j = 0; j < b.n_blocks; ++j) {
    const int s = j % kStages;
    // The stage's previous block is j - kStages; on the first pass the parity of the phase
    // before the first one returns at once.
    const uint32_t released = ((j / kStages) & 1) ^ 1;
    const int n0 = (b.j0 + j) * kBN;  // the block's first key
    mbarrier_wait(&pipe.empty_k[s], released);
    if (issuer)
      load_tile<D>(smem + L::kK + s * L::kKVBytes, L::kKVPanel, &p.k_map, &pipe.full_k[s], n0, b.kv_head, b.batch);
    mbarrier_wait(&pipe.empty_v[s], released);
    if (issuer)
      load_tile<D>(smem + L::kV + s * L::kKVBytes, L::kKVPanel, &p.v_map, &pipe.full_v[s], n0, b.kv_head, b.batch);
  }
  const int last = b.n_blocks - 1;
  if (kZeroV && last >= 0 && holds_padding<kBN>(b.vis, p.Sk, b.j0 + last)) {
    const int s = last % kStages;
    mbarrier_wait(&pipe.full_v[s], (last / kStages) & 1);
    zero_padded_rows<D, kBN>(smem + L::kV + s * L::kKVBytes, b.vis.kv_len - (b.j0 + last) * kBN,
                             static_cast<int>(threadIdx.x), 32, kZeroBarrier);
    if (issuer) mbarrier_arrive(pipe.zeroed_v);
  }
}

// One consumer warp's release of a K or V half-stage: after all its lanes' wgmmas reading it completed.
__device__ __forceinline__ void release(uint64_t* empty) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbarrier_arrive(empty);
}

}  // namespace hopper
