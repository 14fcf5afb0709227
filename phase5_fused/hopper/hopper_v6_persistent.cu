// Phase 5, Hopper v6: v5 with persistent CTAs (FlashAttention-3's tile scheduler, in a static
// form), whose consumer warpgroups run free of v4's turns; non-causal calls at D = 64 run v5.
//
// v1-v5 launch one CTA per tile of query rows: each CTA initializes its barriers, loads Q and its
// first K/V blocks while its tensor cores wait, and ends with an epilogue during which nothing
// loads. v6 launches one CTA per SM (at most one per tile), and each CTA works on one tile after
// another (the schedule: hopper_persistent.cuh's tile_of_round). The K/V ring and Q then carry over from one tile to the
// next instead of starting again: the loop that does it is in hopper_persistent.cuh, which
// v8 shares with v6's schedule of whole tiles (TileRounds); this file holds v6's kernel, its epilogue
// (v5's store) and its launch.
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>

#include "hopper_launch.cuh"
#include "hopper_persistent.cuh"

namespace hopper {
namespace {

template <int D>
using Tile = TileShape<tile_size(6, D).rows, tile_size(6, D).keys>;

template <typename T, int D>
__global__ void __launch_bounds__(threads_of(Tile<D>::kConsumers), 1)
    hopper_v6_kernel(const __grid_constant__ Params p) {
  persistent_loop<T, D, Tile<D>>(p, TileRounds<Tile<D>>{}, [&](float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
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
