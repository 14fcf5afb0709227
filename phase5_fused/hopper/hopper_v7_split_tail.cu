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
// keys alone. Its epilogue (merge_pieces) writes O / l and lse2 = m + log2 l of each row to FP32
// buffers and counts itself on the tile's arrival counter (one per consumer warpgroup: the 64 rows
// it owns). The piece that arrives last merges them all in piece order (the same sums whichever
// piece that is), as the decode lesson's merge does,
//   lse2 = log2 sum_s 2^lse2_s,   O = sum_s 2^(lse2_s - lse2) O_s,
// and stores the tile. No piece waits for another: whichever finishes last does the merge.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>

#include "hopper_v4_pingpong.cuh"
#include "zeroed_counters.h"

namespace hopper {
namespace {

template <int D>
using Tile = TileShape<tile_size(7, D).rows, tile_size(7, D).keys>;

// At most this many pieces per tile: the piece that merges reads every piece's rows.
constexpr int kMaxSplits = 8;

// The epilogue of piece `piece` of split tile `slot`, on one consumer warpgroup (64 rows).
template <typename T, int D>
__device__ __forceinline__ void merge_pieces(float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                             unsigned char* sQ, int wg, const Params& p, const Block& b, int slot,
                                             int piece) {
  constexpr int kConsumers = Tile<D>::kConsumers;
  const SplitTail& st = p.split;
  const int tid = static_cast<int>(threadIdx.x % kWarpgroup);
  const int barrier = kEpilogueBarrier + wg;
  // A piece's rows in the buffers: this thread's fragment, float4 c of it at [c][tid], so that a warp
  // writes and reads 512 contiguous bytes at a time.
  auto o_of = [&](int s) {
    return reinterpret_cast<float4*>(st.partial_o) + ((slot * st.splits + s) * kConsumers + wg) * (D / 8) * kWarpgroup +
           tid;
  };
  auto lse_of = [&](int s) {
    return reinterpret_cast<float2*>(st.partial_lse) + ((slot * st.splits + s) * kConsumers + wg) * kWarpgroup + tid;
  };
  __shared__ int merges[kMaxConsumers];  // per warpgroup: this piece arrived last

  // 1. This piece's O / l and lse2, to its place in the buffers.
  float inv[2], lse2[2];
  finish_rows(m, l, inv, lse2);
#pragma unroll
  for (int c = 0; c < D / 8; ++c) {
    o[4 * c] *= inv[0];
    o[4 * c + 1] *= inv[0];
    o[4 * c + 2] *= inv[1];
    o[4 * c + 3] *= inv[1];
    o_of(piece)[c * kWarpgroup] = make_float4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
  }
  *lse_of(piece) = make_float2(lse2[0], lse2[1]);

  // 2. Count the piece once the warpgroup's writes are visible to the whole GPU; only the last
  //    piece of the tile goes on.
  __threadfence();
  named_barrier_sync(barrier, kWarpgroup);
  if (tid == 0) {
    int* arrivals = &st.arrivals[slot * kConsumers + wg];
    const bool last = atomicAdd(arrivals, 1) == st.splits - 1;
    // Every piece has counted: leave the counter at zero for the next call (zeroed_counters.h).
    if (last) *arrivals = 0;
    merges[wg] = last;
  }
  named_barrier_sync(barrier, kWarpgroup);
  if (!merges[wg]) return;
  __threadfence();

  // 3. Merge every piece, this one's too, in piece order from the buffers (L2 reads: __ldcg), so
  //    that the result does not depend on which piece finished last. All the pieces' lse2 first,
  //    then their rows: no load waits for the arithmetic on an earlier one.
  // BEGIN SOLUTION: Port of ../decode/decode_merge.cu's merge TODO as v7's step 3, once the decode lesson's tests pass: read every piece's lse2_s (float2 at lse_of(s): rows g and g + 8) with __ldcg; per row lse2 = log2 sum_s 2^lse2_s (-inf when every piece's is -inf: no visible key); then o = sum over s = 0 .. splits - 1 in order of 2^(lse2_s - lse2) O_s, O_s being the D / 8 float4 at o_of(s)[c * kWarpgroup] (read with __ldcg), and o = 0 for a row with lse2 = -inf (README: v7)
  float lse_s[kMaxSplits][2];
  float top[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s < st.splits) {
      const float2 x = __ldcg(lse_of(s));
      lse_s[s][0] = x.x;
      lse_s[s][1] = x.y;
      top[0] = fmaxf(top[0], x.x);
      top[1] = fmaxf(top[1], x.y);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      if (s < st.splits && top[h] != -CUDART_INF_F) sum += exp2f(lse_s[s][h] - top[h]);
    }
    lse2[h] = top[h] == -CUDART_INF_F ? top[h] : top[h] + log2f(sum);
  }
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s < st.splits) {
      const float w0 = lse2[0] == -CUDART_INF_F ? 0.0f : exp2f(lse_s[s][0] - lse2[0]);
      const float w1 = lse2[1] == -CUDART_INF_F ? 0.0f : exp2f(lse_s[s][1] - lse2[1]);
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const float4 x = __ldcg(o_of(s) + c * kWarpgroup);
        o[4 * c] += w0 * x.x;
        o[4 * c + 1] += w0 * x.y;
        o[4 * c + 2] += w1 * x.z;
        o[4 * c + 3] += w1 * x.w;
      }
    }
  }
  // END SOLUTION

  // 4. The merged rows, already divided by their l, stored as every tile's are.
  const float one[2] = {1.0f, 1.0f};
  store_rows<T, D, Tile<D>>(o, one, lse2, sQ, wg, p, b, barrier);
}

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
      merge_pieces<T, D>(o, m, l, sQ, wg, p, b, slot, piece);
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
    // The partial buffers (freed in stream order) and the arrival counters, which every call
    // leaves at zero (utils/csrc/zeroed_counters.h: no memset per call).
    const int64_t pieces = plan.split_tiles * plan.splits * Tl::kConsumers;
    const int64_t o_floats = pieces * 64 * kD, lse_floats = pieces * kWarpgroup * 2;
    const int device = at::cuda::current_device();
    const at::Tensor buffers =
        at::empty({o_floats + lse_floats}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device));
    const at::Tensor arrivals = course::zeroed_counters(plan.split_tiles * Tl::kConsumers, device, stream);
    Params q = p;
    q.split = SplitTail{static_cast<int>(plan.whole_tiles), plan.splits, buffers.data_ptr<float>(),
                        buffers.data_ptr<float>() + o_floats, arrivals.data_ptr<int>()};
    const dim3 grid(static_cast<unsigned>(plan.whole_tiles + plan.split_tiles * plan.splits));
    launch_on_grid<hopper_v7_kernel<T, kD>, Smem<kD, kStages, Tl>::kBytes, threads_of(Tl::kConsumers)>(q, grid,
                                                                                                      stream);
  });
}

}  // namespace hopper
