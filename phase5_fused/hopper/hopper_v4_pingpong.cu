// Phase 5, Hopper v4: the ping-pong loop (hopper_v4_pingpong.cuh) on the tile of v1-v3, kBaseTile:
// two consumer warpgroups of 64 query rows, key blocks of 128.
#include "hopper_v4_pingpong.cuh"

namespace hopper {
namespace {

using Tile = BaseTile;
constexpr int kThreads = threads_of(Tile::kConsumers);

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) hopper_v4_kernel(const __grid_constant__ Params p) {
  pingpong_attention<T, D, Tile>(p);
}

}  // namespace

void launch_v4(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    launch_kernel<hopper_v4_kernel<T, kD>, Smem<kD, kStages, Tile>::kBytes, kThreads, Tile>(p, stream);
  });
}

}  // namespace hopper
