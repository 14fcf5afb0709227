// Phase 5, Hopper v8: v6's persistent loop with the last, partial round cut along the keys into
// even shares (Stream-K: Osama et al., "Stream-K", 2023), for non-causal calls at D = 128; causal
// calls run v6, non-causal ones at D = 64 v7.
//
// v6 runs `tiles` equally long tiles of n key blocks on G CTAs in ceil(tiles / G) rounds. At D = 128,
// S = 4096, B = 4, H = 8 that is 1024 tiles on 132 SMs: seven whole rounds and an eighth of 100
// tiles, during which 32 SMs idle. v7 cuts such a tail into pieces of one tile each for a CTA of
// its own, which at D = 128 cost more than they saved (README: "Cutting the D = 128 tail"): each
// piece paid a CTA's start and a merge. v8 keeps v6's persistent CTAs for the whole rounds and then
// hands every CTA an even share of the tail's key blocks, cut tiles = tiles % G, W = cut tiles x n
// blocks in all:
//   CTA c takes blocks [start(c), start(c + 1)) of the cut tiles laid end to end, W / G of them
//   and one more for the first W % G CTAs,
// about three quarters of a tile each at that shape, so a CTA's share covers the end of one tile
// and the start of the next: pieces of one or two tiles, which its persistent loop runs as items
// (hopper_persistent.cuh) after its whole tiles, the K/V ring and Q carried on as between tiles. A
// tile cut between CTAs is merged by hopper_merge.cuh (the last piece to finish merges, no piece
// waits); a tile that one CTA's share covers whole is stored as v6 stores it.
//
// Key padding: the shares cut the nominal n = ceil(Sk / kBN) blocks of every tile; a piece keeps
// only its blocks below its batch's last visible key (none: it still counts for the merge, with
// l = 0 and no weight in it).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>

#include "hopper_launch.cuh"
#include "hopper_merge.cuh"
#include "hopper_persistent.cuh"

namespace hopper {
namespace {

template <int D>
using Tile = TileShape<tile_size(8, D).rows, tile_size(8, D).keys>;

// The shares of the tail: W blocks (the cut tiles' n blocks each, end to end) over G CTAs, q = W / G
// each and one more for the first r = W % G. All in 32 bits (the host runs v6 where W >= 2^31): a
// 64-bit division is a called routine, around which the producer, at 24 registers, spilled more.
struct Shares {
  uint32_t n;  // blocks per tile
  uint32_t q;  // blocks per share, W / G
  uint32_t r;  // shares with one block more, W % G
  __host__ __device__ Shares(uint32_t W, uint32_t blocks_per_tile, uint32_t G) : n(blocks_per_tile), q(W / G), r(W % G) {}
  __host__ __device__ uint32_t start(uint32_t c) const { return c * q + (c < r ? c : r); }  // CTA c's first block
  // The CTA whose share holds block x.
  __host__ __device__ uint32_t cta_of(uint32_t x) const {
    const uint32_t long_part = r * (q + 1);  // blocks of the r longer shares
    return x < long_part ? x / (q + 1) : r + (x - long_part) / q;
  }
  // CTAs sharing cut tile t.
  __host__ __device__ int pieces(uint32_t t) const {
    return static_cast<int>(cta_of(t * n + n - 1) - cta_of(t * n) + 1);
  }
};

// The persistent loop's list (hopper_persistent.cuh) for CTA c: its whole tiles (v6's rounds,
// v5's grid order), then the pieces of its share of the cut tiles.
template <int D>
struct StreamKTail {
  TileRounds<Tile<D>> v6;  // the whole rounds' tile count and query blocks
  __device__ Shares shares(const Params& p) const {
    const uint32_t cut = static_cast<uint32_t>(v6.tiles(p) - p.split.whole_tiles);
    const uint32_t n = static_cast<uint32_t>((p.Sk + Tile<D>::kBN - 1) / Tile<D>::kBN);
    return Shares(cut * n, n, gridDim.x);
  }
  __device__ int rounds(const Params& p) const { return p.split.whole_tiles / static_cast<int>(gridDim.x); }
  __device__ int items(const Params& p) const {
    const Shares sh = shares(p);
    const uint32_t first = sh.start(blockIdx.x), end = sh.start(blockIdx.x + 1);
    return rounds(p) + (end > first ? static_cast<int>((end - 1) / sh.n - first / sh.n + 1) : 0);
  }
  __device__ bool at(const Params& p, int w, Work& work) const {
    const int c = static_cast<int>(blockIdx.x);
    // v6's rounds, numbered as TileRounds::at numbers them non-causal (calling it brings its causal
    // branches into the producer, which then spilled more).
    if (w < rounds(p)) {
      work = Work{tile_in_grid_order<Tile<D>>(p, v6.m_blocks(p), w * static_cast<int>(gridDim.x) + c), -1, 0, 1};
      return true;
    }
    // Piece k of the CTA's share: cut tile t, its blocks [j0, j1).
    const Shares sh = shares(p);
    const uint32_t first = sh.start(c), end = sh.start(c + 1);
    const uint32_t t = first / sh.n + static_cast<uint32_t>(w - rounds(p));
    const int j0 = static_cast<int>(max(first, t * sh.n) - t * sh.n);
    const int j1 = static_cast<int>(min(end, (t + 1) * sh.n) - t * sh.n);
    Block b = tile_in_grid_order<Tile<D>>(p, v6.m_blocks(p), p.split.whole_tiles + static_cast<int>(t));
    const int pieces = sh.pieces(t);
    b.j0 = j0;
    b.n_blocks = max(0, min(j1, b.n_blocks) - j0);  // b.n_blocks: the tile's visible blocks
    work = Work{b, pieces > 1 ? static_cast<int>(t) : -1, c - static_cast<int>(sh.cta_of(t * sh.n)), pieces};
    return true;
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(threads_of(Tile<D>::kConsumers), 1)
    hopper_v8_kernel(const __grid_constant__ Params p) {
  persistent_loop<T, D, Tile<D>>(p, StreamKTail<D>{}, [&](float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                                          unsigned char* sO, int wg, const Work& work) {
    if (work.slot < 0) {
      store_output<T, D, Tile<D>>(o, m, l, sO, wg, p, work.b, kEpilogueBarrier + wg);
    } else {
      merge_pieces<T, D, Tile<D>>(o, m, l, sO, wg, p, work.b, work.slot, work.piece, work.pieces);
    }
  });
}

// v8's cut of a grid of `tiles` tiles of n key blocks on G CTAs: the whole rounds, the cut tiles
// after them, and the most pieces one of them is cut into (the buffers' stride). cut_tiles = 0
// where there is no partial round, where a CTA's share would be under half a tile (short pieces
// cost more than they save: v7's D = 128 measurement), or where W would not fit the kernel's 32-bit
// shares (Sk of billions), and v6 runs instead.
struct StreamKPlan {
  int64_t whole_tiles;
  int64_t cut_tiles;
  int max_pieces;
};
StreamKPlan stream_k_plan(int64_t tiles, int G, int64_t n) {
  const int64_t whole = tiles / G * G, cut = tiles - whole;
  if (cut == 0 || 2 * (cut * n / G) < n || cut * n >= (int64_t{1} << 31)) return {tiles, 0, 1};
  const Shares sh(static_cast<uint32_t>(cut * n), static_cast<uint32_t>(n), static_cast<uint32_t>(G));
  int max_pieces = 1;
  for (uint32_t t = 0; t < cut; ++t) max_pieces = std::max(max_pieces, sh.pieces(t));
  return {whole, cut, max_pieces};
}

// v8's launch at D = 128: the plan, then v6 where it cuts nothing, else the buffers and the kernel.
template <typename T, int kD>
void launch_stream_k(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  using Tl = Tile<kD>;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const StreamKPlan plan = stream_k_plan(tile_count<Tl>(p), sms, (p.Sk + Tl::kBN - 1) / Tl::kBN);
  if (plan.cut_tiles == 0) {
    launch_v6(p, D, dtype, stream);
    return;
  }
  static_assert(kMaxSplits >= 3, "a share of half a tile or more cuts a tile into at most three pieces");
  const MergeBuffers buffers(plan.cut_tiles, plan.max_pieces, Tl::kConsumers, kD, stream);
  Params q = p;
  q.split = buffers.split(plan.whole_tiles, plan.max_pieces);
  launch_on_grid<hopper_v8_kernel<T, kD>, PersistentSmem<kD, Tl>::kBytes, threads_of(Tl::kConsumers)>(
      q, dim3(static_cast<unsigned>(sms)), stream);
}

}  // namespace

void launch_v8(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  // Causal tiles differ in length (v6's longest-first order balances them); at D = 64 v7's cut of
  // v5's grid measured best (README: v6, v7).
  if (p.causal || D == 64) {
    launch_v7(p, D, dtype, stream);
    return;
  }
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    if constexpr (kD == 128) {  // (D = 64 went to v7 above: no D = 64 instance is compiled)
      launch_stream_k<T, kD>(p, D, dtype, stream);
    }
  });
}

}  // namespace hopper
