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

// The causal schedule's sections (hopper_persistent.cuh): each K/V head should be read by about
// kReadersPerKvHead CTAs of a round at once, as at the headline shape (B = 4, H_kv = 8 on 132 SMs),
// where the L2 serves all but one of them. A round of `grid` CTAs on a section of n K/V heads gives
// each grid / n, so a section takes at most grid / kReadersPerKvHead K/V heads (at least one), the
// sections as equal as they can be, each a whole number of K/V heads with their query heads.
constexpr int kReadersPerKvHead = 4;
int causal_section_pairs(const Params& p, int64_t grid) {
  const int64_t kv_pairs = static_cast<int64_t>(p.B) * p.H_kv;
  const int64_t most = std::max<int64_t>(1, grid / kReadersPerKvHead);
  const int64_t sections = (kv_pairs + most - 1) / most;
  const int64_t kv_per_section = (kv_pairs + sections - 1) / sections;
  return static_cast<int>(kv_per_section * (p.H / p.H_kv));
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
    const int64_t grid = std::min<int64_t>(tiles, sms);
    Params q = p;
    q.section_pairs = causal_section_pairs(p, grid);
    launch_on_grid<hopper_v6_kernel<T, kD>, PersistentSmem<kD, Tile<kD>>::kBytes, threads_of(Tile<kD>::kConsumers)>(
        q, dim3(static_cast<unsigned>(grid)), stream);
  });
}

}  // namespace hopper
