// What both split kernels share (decode_split.cu on CUDA cores, decode_split_tc.cu on tensor
// cores): which keys a split owns, the page-table check, and the copy of K and V tiles into a ring
// of kStages shared-memory stages (cp.async, 16 bytes per copy; rows padded by 16 bytes on CUDA
// cores, XOR-swizzled on tensor cores: README "Swizzled tiles: every sector read once"; 2 stages on
// CUDA cores, 3 on tensor cores where the device has the shared memory: README "More bytes in
// flight: a deeper ring").
#pragma once

#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "common.cuh"
#include "cp_async.cuh"
#include "decode.h"
#include "decode_common.cuh"
#include "shared_memory_opt_in.h"
#include "../tensor_cores/tc_mma.cuh"  // tc::swizzle

namespace phase5_decode {

constexpr int kThreads = 128;  // threads of a split-kernel block

// The shared-memory tile of keys both kernels stream K and V through, in one of two layouts:
//   kSwizzled = false (CUDA cores): rows padded by 16 bytes, so that threads reading the same
//     chunk of 8 consecutive rows hit 8 bank groups;
//   kSwizzled = true (tensor cores): unpadded rows, chunk c of row r stored at chunk c ^ (r % 8)
//     (tc::swizzle), conflict-free for ldmatrix. It also keeps the two 16-byte halves of every
//     32-byte sector of the cache in one 32-byte sector of shared memory, so that cp.async
//     fetches each sector from L2 once; a row that starts mid-sector (every other padded row)
//     fetches each of its sectors twice (README "Swizzled tiles: every sector read once"). For
//     the same reason the kernels' dynamic shared memory must start on a 128-byte boundary
//     (__align__(128)): the in-kernel merge's static shared memory comes first.
template <typename T, int D, bool kSwizzled>
struct KvTile {
  static constexpr int kVec = 16 / sizeof(T);               // elements per 16-byte copy
  static constexpr int kChunks = D / kVec;                  // 16-byte chunks per key row
  static constexpr int kBc = 16384 / (D * sizeof(T));       // keys per tile: 16 KB of K, 16 KB of V
  static constexpr int kStride = kSwizzled ? D : D + kVec;  // elements per shared row
  static constexpr int kTileElems = kBc * kStride;
  static constexpr int kRowsPerPass = kThreads / kChunks;   // key rows the block copies per pass
  static constexpr int kPasses = kBc / kRowsPerPass;        // copies per thread per tensor and tile
  static_assert(kThreads % kChunks == 0 && kBc % kRowsPerPass == 0, "the block copies whole key rows");
  static_assert(kSwizzled ? kChunks % 8 == 0 : (kStride * sizeof(T) / 16) % 2 == 1,
                "swizzled: whole groups of 8 chunks per row; padded: an odd number of 16-byte units per "
                "row, so 8 threads reading 8 rows hit 8 bank groups");

  // Element offset of 16-byte chunk `chunk` of key row `row` in a stage.
  static __device__ __forceinline__ int at(int row, int chunk) {
    if constexpr (kSwizzled) {
      return row * kStride + tc::swizzle<kChunks>(row, chunk) * kVec;
    } else {
      return row * kStride + chunk * kVec;
    }
  }
};

// The keys [start, end) split `split` of sequence b owns: an equal share of its L keys, a whole
// number of tiles of kBc (a split past the end gets none). Returns true (bad) for a length outside
// [Sq, capacity] or, in a paged cache, a page entry of those keys outside [0, num_pages): the
// block then writes NaN for its rows, and nothing is read out of bounds. Every thread of the
// block calls this (it ends with a block-wide vote).
template <int kBc, bool kPaged>
__device__ __forceinline__ bool split_keys(const Params& p, int b, int split, int& start, int& end) {
  const int L = p.lengths[b];
  int bad = L < p.Sq || L > p.capacity;
  start = 0;
  end = 0;
  if (!bad) {
    const int per_split = course::ceil_div(course::ceil_div(L, p.num_splits), kBc) * kBc;
    start = static_cast<int>(min(static_cast<int64_t>(L), static_cast<int64_t>(split) * per_split));
    end = static_cast<int>(min(static_cast<int64_t>(L), static_cast<int64_t>(start) + per_split));
  }
  if (kPaged && end > start) {
    const int* table = p.page_table + static_cast<int64_t>(b) * p.max_pages;
    for (int page = (start >> p.page_shift) + static_cast<int>(threadIdx.x); page <= ((end - 1) >> p.page_shift);
         page += kThreads) {
      const int physical = table[page];
      bad |= physical < 0 || physical >= p.num_pages;
    }
  }
  return __syncthreads_or(bad) != 0;
}

// Streams the K and V rows of KV head hk of sequence b (bh = b * H_kv + hk), keys [start, end),
// through a ring of kStages shared-memory tiles sK, sV [kStages][kBc][kStride] (KvTile's layout),
// one cp.async commit group per tile. Both split kernels run the ring the same way:
//
//   prologue(num_tiles)                     tiles 0 .. kStages-2 in flight
//   for tile t:
//     fetch_ahead(t, num_tiles)             tile t + kStages - 1 into stage (t - 1) % kStages, which
//                                           every warp left at the barrier closing iteration t - 1
//     cp_async_wait<kStages - 1>()          this thread's copies of tile t have landed (the
//                                           kStages - 1 younger groups may still fly) ...
//     __syncthreads()                       ... and every thread's: tile t is visible to all
//     use stage(t)
//     __syncthreads()                       no warp reads stage(t) when the next fetch_ahead refills it
//
// Every call commits a group, empty past the last tile, so the count in the wait is the same for
// every t. The copies of the kStages - 1 tiles after t are in flight while tile t is used, and
// those of kStages tiles while the block waits for it. With kStages = 2 this is the double buffer
// of the first version (copy tile t + 1, wait for tile t).
template <typename T, int D, bool kSwizzled, bool kPaged, int kStages>
struct KvStream {
  static_assert(kStages >= 2, "a ring of at least two stages: one used, one being filled");
  using Tile = KvTile<T, D, kSwizzled>;
  const Params& p;
  int b, hk, bh, start, end;
  T* sK;
  T* sV;

  // The stage tile t lives in.
  static __device__ __forceinline__ int stage(int tile) {
    return static_cast<int>(static_cast<unsigned>(tile) % kStages);
  }

  // Tiles 0 .. kStages-2 into stages 0 .. kStages-2, one group each (empty past num_tiles).
  __device__ __forceinline__ void prologue(int num_tiles) const {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_tiles) load(start + s * Tile::kBc, s);
      course::cp_async_commit();
    }
  }

  // Top of iteration `tile`: start the copies of tile + kStages - 1 (if there is one), one group.
  __device__ __forceinline__ void fetch_ahead(int tile, int num_tiles) const {
    const int ahead = tile + kStages - 1;
    if (ahead < num_tiles) load(start + ahead * Tile::kBc, stage(ahead));
    course::cp_async_commit();
  }

  // Element offset of key `key` in the cache: through the page table, or in the contiguous
  // [B, H_kv, S_max, D] layout.
  __device__ __forceinline__ int64_t key_offset(int key) const {
    if constexpr (kPaged) {
      const int physical = __ldg(p.page_table + static_cast<int64_t>(b) * p.max_pages + (key >> p.page_shift));
      const int slot = key & ((1 << p.page_shift) - 1);
      return ((static_cast<int64_t>(physical) * p.H_kv + hk) * (int64_t{1} << p.page_shift) + slot) * D;
    } else {
      return (static_cast<int64_t>(bh) * p.capacity + key) * D;
    }
  }

  // Copy the keys [tile_start, tile_start + kBc) of K and V into stage `stage`, each thread the same
  // 16-byte chunk of kPasses rows; rows at or past `end` are zero-filled.
  __device__ __forceinline__ void load(int tile_start, int stage) const {
    const int tid = static_cast<int>(threadIdx.x);
    const int chunk = tid % Tile::kChunks;
    const T* k_cache = static_cast<const T*>(p.k);
    const T* v_cache = static_cast<const T*>(p.v);
#pragma unroll
    for (int pass = 0; pass < Tile::kPasses; ++pass) {
      const int r = tid / Tile::kChunks + pass * Tile::kRowsPerPass;
      const bool valid = tile_start + r < end;
      const int64_t offset = valid ? key_offset(tile_start + r) + chunk * Tile::kVec : 0;
      const int at = stage * Tile::kTileElems + Tile::at(r, chunk);
      course::cp_async_16(course::smem_u32(sK + at), k_cache + offset, valid);
      course::cp_async_16(course::smem_u32(sV + at), v_cache + offset, valid);
    }
  }
};

// Store kN outputs (columns col .. col + kN - 1) of row `grow` (among all B * H * Sq rows), already
// divided by l, and (with_lse) the row's base-2 logsumexp lse2: with one split the final output in
// q's dtype and the natural-log lse, with several the FP32 partials of split `split` for the merge
// (decode_merge.cuh).
template <typename T, int D, int kN>
__device__ __forceinline__ void store_result(const Params& p, int split, int64_t total_rows, int64_t grow, int col,
                                             const float (&out)[kN], float lse2, bool with_lse) {
  if (p.num_splits == 1) {
    store_from_float<kN>(static_cast<T*>(p.out) + grow * D + col, out);
    if (with_lse) p.lse[grow] = lse2 * kLn2;
  } else {
    const int64_t at = split * total_rows + grow;
    store_from_float<kN>(p.o_part + at * D + col, out);
    if (with_lse) p.lse_part[at] = lse2;
  }
}

// Launch split kernel kKernel on the (split, sequence x KV head, row chunk) grid with `smem` bytes
// of dynamic shared memory, opted in (once per device) for the most it will ever ask: kMaxSmem.
template <void (*kKernel)(Params), size_t kMaxSmem>
void launch_split_grid(const Params& p, size_t smem, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  course::opt_in_shared_memory<kKernel>(device, static_cast<int>(kMaxSmem));
  const dim3 grid(p.num_splits, p.B * p.H_kv, course::ceil_div(p.rows, p.rows_per_block));
  kKernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace phase5_decode
