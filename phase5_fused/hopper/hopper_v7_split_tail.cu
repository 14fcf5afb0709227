// Phase 5, Hopper v7: v5 with the grid's last, partial wave of tiles cut along the keys (a split
// tail: the "data-parallel + Stream-K" hybrid of Osama et al., "Stream-K", 2023), for non-causal
// calls; causal calls, and calls with no partial wave worth cutting, run v6.
//
// One CTA per SM at a time runs `tiles` equally long tiles in ceil(tiles / G) waves on G SMs. At
// D = 64, S = 4096, B = 4, H = 8 that is 704 tiles on 132 SMs: five full waves and a sixth of 44
// tiles, during which 88 SMs idle, so the call takes six tiles' time for 5.33 tiles of work per SM.
// v7 runs the first whole_tiles = tiles - tiles % G tiles as v5 does, and cuts each of the last
// tiles % G tiles into `splits` pieces of its key blocks (split_tail_plan): 44 x 3 = 132 pieces, one
// per SM, each a third of a tile long.
//
// A piece runs v5's loop over its own key blocks, so its O, m and l are the online softmax over its
// keys alone; its epilogue (hopper_merge.cuh, merge_pieces) writes them to FP32 buffers, and the
// piece of a tile that finishes last merges them all by logsumexp and stores the tile.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>

#include "hopper_merge.cuh"
#include "hopper_v4_pingpong.cuh"

namespace hopper {
namespace {

template <int D>
using Tile = TileShape<tile_size(7, D).rows, tile_size(7, D).keys>;

// CTA i < whole_tiles runs tile i of v5's grid order; CTA whole_tiles + slot splits + piece runs
// piece `piece` of tile whole_tiles + slot: key blocks [piece n / splits, (piece + 1) n / splits) of
// its n.
template <typename T, int D>
__global__ void __launch_bounds__(threads_of(Tile<D>::kConsumers), 1)
    hopper_v7_kernel(const __grid_constant__ Params p) {
  using Tl = Tile<D>;
  const SplitTail& st = p.split;
  const int m_blocks = (p.Sq + Tl::kBM - 1) / Tl::kBM;
  const int split_item = static_cast<int>(blockIdx.x) - st.whole_tiles;  // < 0: a whole tile
  const int slot = split_item / st.splits, piece = split_item % st.splits;
  Block b = tile_in_grid_order<Tl>(p, m_blocks, split_item < 0 ? static_cast<int>(blockIdx.x) : st.whole_tiles + slot);
  if (split_item >= 0) {
    const int n = b.n_blocks;
    b.j0 = piece * n / st.splits;
    b.n_blocks = (piece + 1) * n / st.splits - b.j0;
  }
  pingpong_tile<T, D, Tl>(p, b, [&](float (&o)[D / 2], const float (&m)[2], const float (&l)[2], unsigned char* sQ,
                                    int wg) {
    if (split_item < 0) {
      store_output<T, D, Tl>(o, m, l, sQ, wg, p, b, kEpilogueBarrier + wg);
    } else {
      merge_pieces<T, D, Tl>(o, m, l, sQ, wg, p, b, slot, piece, st.splits);
    }
  });
}

// How v7 cuts a grid of `tiles` tiles of `key_blocks` key blocks each on `sms` SMs: the last
// tiles % sms tiles into as many pieces as the SMs left room for (at most kMaxSplits, and no more
// than the key blocks); splits = 1 where that is less than two.
struct SplitPlan {
  int64_t whole_tiles;
  int64_t split_tiles;
  int splits;
};
SplitPlan split_tail_plan(int64_t tiles, int sms, int64_t key_blocks) {
  const int64_t tail = tiles % sms;
  const int64_t splits = tail == 0 ? 1 : std::min<int64_t>({sms / tail, kMaxSplits, key_blocks});
  if (splits < 2) return {tiles, 0, 1};
  return {tiles - tail, tail, static_cast<int>(splits)};
}

}  // namespace

void launch_v7(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  if (p.causal) {
    launch_v6(p, D, dtype, stream);
    return;
  }
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    using Tl = Tile<kD>;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const SplitPlan plan = split_tail_plan(tile_count<Tl>(p), sms, (p.Sk + Tl::kBN - 1) / Tl::kBN);
    if (plan.splits < 2) {
      launch_v6(p, D, dtype, stream);
      return;
    }
    const MergeBuffers buffers(plan.split_tiles, plan.splits, Tl::kConsumers, kD, stream);
    Params q = p;
    q.split = buffers.split(plan.whole_tiles, plan.splits);
    const dim3 grid(static_cast<unsigned>(plan.whole_tiles + plan.split_tiles * plan.splits));
    launch_on_grid<hopper_v7_kernel<T, kD>, Smem<kD, kStages, Tl>::kBytes, threads_of(Tl::kConsumers)>(q, grid,
                                                                                                      stream);
  });
}

}  // namespace hopper
