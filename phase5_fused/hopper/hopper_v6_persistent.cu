// Phase 5, Hopper v6: v5 with persistent CTAs (FlashAttention-3's tile scheduler, in a static
// form); non-causal calls at D = 64 run v5.
//
// v1-v5 launch one CTA per tile of query rows: each CTA initializes its barriers, loads Q and its
// first K/V blocks while its tensor cores wait, and ends with an epilogue during which nothing
// loads. v6 launches one CTA per SM (at most one per tile), and each CTA works on one tile after
// another (the schedule: tile_of_round). The K/V ring, Q and the turn then carry over from one tile
// to the next instead of starting again: the loop that does it is in hopper_persistent.cuh, which
// v8 shares; this file holds v6's schedule (whole tiles) and its epilogue (v5's store).
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>

#include "hopper_launch.cuh"
#include "hopper_persistent.cuh"

namespace hopper {
namespace {

template <int D>
using Tile = TileShape<tile_size(6, D).rows, tile_size(6, D).keys>;

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

// The persistent loop's list (hopper_persistent.cuh): one slot per round, each a whole tile.
template <int D>
struct TileRounds {
  __device__ int tiles(const Params& p) const { return m_blocks(p) * p.H * p.B; }
  __device__ int m_blocks(const Params& p) const { return (p.Sq + Tile<D>::kBM - 1) / Tile<D>::kBM; }
  __device__ int items(const Params& p) const {
    return (tiles(p) + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  }
  __device__ bool at(const Params& p, int r, Work& work) const {
    const int t = tile_of_round(p, r, tiles(p));
    if (t < 0) return false;
    work = Work{tile_block<D>(p, m_blocks(p), t), -1, 0, 1};
    return true;
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(threads_of(Tile<D>::kConsumers), 1)
    hopper_v6_kernel(const __grid_constant__ Params p) {
  persistent_loop<T, D, Tile<D>>(p, TileRounds<D>{}, [&](float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                                         unsigned char* sO, int wg, const Work& work) {
    store_output<T, D, Tile<D>>(o, m, l, sO, wg, p, work.b, kEpilogueBarrier + wg);
  });
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
    launch_on_grid<hopper_v6_kernel<T, kD>, PersistentSmem<kD, Tile<kD>>::kBytes, threads_of(Tile<kD>::kConsumers)>(
        p, dim3(static_cast<unsigned>(std::min<int64_t>(tiles, sms))), stream);
  });
}

}  // namespace hopper
