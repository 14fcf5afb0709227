// Phase 5, Hopper v5: v4's loop on three consumer warpgroups at D = 64 (tile_size in
// hopper_attention.h), as FlashAttention-3 runs that head dim.
//
// A key block's softmax costs a consumer warpgroup the same at D = 64 and D = 128 (64 x 128
// exponentials), but its two matmuls take half as long at D = 64. With two consumer warpgroups
// the tensor cores have one warpgroup's matmuls to run while the other computes its softmax, and
// at D = 64 that is not enough to cover it. v5 gives D = 64 192 query rows: three consumer
// warpgroups, 160 registers each instead of 240 (S, P and O take 64 + 32 + 32 of them). While one
// computes its softmax, the other two have their matmuls queued: twice v4's cover. The turn passes
// 0 -> 1 -> 2 -> 0. D = 128 keeps v4's tile: its matmuls already cover a softmax.
#include "hopper_v4_pingpong.cuh"

namespace hopper {
namespace {

template <int D>
using Tile = TileShape<tile_size(5, D).rows, tile_size(5, D).keys>;

template <typename T, int D>
__global__ void __launch_bounds__(threads_of(Tile<D>::kConsumers), 1)
    hopper_v5_kernel(const __grid_constant__ Params p) {
  pingpong_attention<T, D, Tile<D>>(p);
}

}  // namespace

void launch_v5(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    launch_kernel<hopper_v5_kernel<T, kD>, Smem<kD, kStages, Tile<kD>>::kBytes, threads_of(Tile<kD>::kConsumers),
                  Tile<kD>>(p, stream);
  });
}

}  // namespace hopper
