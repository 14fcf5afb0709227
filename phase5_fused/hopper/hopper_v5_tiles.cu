// Phase 5, Hopper v5: v4's loop with a tile chosen per head dim (tile_size in hopper_attention.h),
// as FlashAttention-3 chooses its tiles.
//
// A key block's softmax costs a consumer warpgroup the same at D = 64 and D = 128 (64 x kBN
// exponentials), but its two matmuls take half as long at D = 64. With two consumer warpgroups the
// tensor cores have one warpgroup's matmuls to run while the other computes its softmax, which at
// D = 64 is not enough to cover it. So:
//   D = 64:  192 query rows, three consumer warpgroups (160 registers each instead of 240: S, P and
//            O take 64 + 32 + 32 of them), key blocks of 128. While one warpgroup computes its
//            softmax, the other two have their matmuls queued: twice v4's cover. The turn passes
//            0 -> 1 -> 2 -> 0.
//   D = 128: 128 query rows (two warpgroups; S + P + O = 88 + 44 + 64 registers already) and key
//            blocks of 176: 11 wgmma k-steps per P V instead of 8, so a block's fixed costs (the
//            waits, the turn, the row max's shuffles, the O rescale) are shared by more keys. Shared
//            memory: Q 32 KiB + 2 stages of K and V at 44 KiB each = 208 KiB of the 227 KiB.
#include <cstdlib>

#include "hopper_v4_pingpong.cuh"

namespace hopper {
namespace {

template <int D>
using Tile = TileShape<tile_size(5, D).rows, tile_size(5, D).keys>;

template <typename T, int D, class TileT, bool kTree>
__global__ void __launch_bounds__(threads_of(TileT::kConsumers), 1)
    hopper_v5_kernel(const __grid_constant__ Params p) {
  pingpong_attention<T, D, TileT, kTree>(p);
}

}  // namespace

// DEV: HOPPER_DEV_CONFIG bit 0: v5 tile (else base), bit 1: tree softmax. FP16 only for non-default.
void launch_v5(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  const char* env = std::getenv("HOPPER_DEV_CONFIG");
  const int config = env != nullptr ? std::atoi(env) : 1;
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    if (config == 1 || !std::is_same_v<T, __half>) {
      launch_kernel<hopper_v5_kernel<T, kD, Tile<kD>, false>, Smem<kD, kStages, Tile<kD>>::kBytes,
                    threads_of(Tile<kD>::kConsumers), Tile<kD>>(p, stream);
    } else if (config == 0) {
      launch_kernel<hopper_v5_kernel<T, kD, BaseTile, false>, Smem<kD, kStages, BaseTile>::kBytes,
                    threads_of(BaseTile::kConsumers), BaseTile>(p, stream);
    } else if (config == 2) {
      launch_kernel<hopper_v5_kernel<T, kD, BaseTile, true>, Smem<kD, kStages, BaseTile>::kBytes,
                    threads_of(BaseTile::kConsumers), BaseTile>(p, stream);
    } else {
      launch_kernel<hopper_v5_kernel<T, kD, Tile<kD>, true>, Smem<kD, kStages, Tile<kD>>::kBytes,
                    threads_of(Tile<kD>::kConsumers), Tile<kD>>(p, stream);
    }
  });
}

}  // namespace hopper
