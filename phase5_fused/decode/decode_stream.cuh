// What both split kernels share (decode_split.cu on CUDA cores, decode_split_tc.cu on tensor
// cores): which keys a split owns, the page-table check, and the double-buffered copy of K and V
// tiles into shared memory (cp.async, 16 bytes per copy, rows padded by 16 bytes).
#pragma once

#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "common.cuh"
#include "cp_async.cuh"
#include "decode.h"
#include "decode_common.cuh"
#include "shared_memory_opt_in.h"

namespace phase5_decode {

constexpr int kThreads = 128;  // threads of a split-kernel block

// The shared-memory tile of keys both kernels stream K and V through.
template <typename T, int D>
struct KvTile {
  static constexpr int kVec = 16 / sizeof(T);               // elements per 16-byte copy
  static constexpr int kChunks = D / kVec;                  // 16-byte chunks per key row
  static constexpr int kBc = 16384 / (D * sizeof(T));       // keys per tile: 16 KB of K, 16 KB of V
  static constexpr int kStride = D + kVec;                  // shared row padded by 16 bytes
  static constexpr int kTileElems = kBc * kStride;
  static constexpr int kRowsPerPass = kThreads / kChunks;   // key rows the block copies per pass
  static constexpr int kPasses = kBc / kRowsPerPass;        // copies per thread per tensor and tile
  static_assert(kThreads % kChunks == 0 && kBc % kRowsPerPass == 0, "the block copies whole key rows");
  static_assert((kStride * sizeof(T) / 16) % 2 == 1,
                "an odd number of 16-byte units per shared row: 8 threads reading 8 rows hit 8 bank groups");
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

// Streams the K and V rows of KV head hk of sequence b (bh = b * H_kv + hk) through a two-stage
// ring of shared-memory tiles sK, sV [2][kBc][kStride].
template <typename T, int D, bool kPaged>
struct KvStream {
  using Tile = KvTile<T, D>;
  const Params& p;
  int b, hk, bh, end;
  T* sK;
  T* sV;

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
      const int at = stage * Tile::kTileElems + r * Tile::kStride + chunk * Tile::kVec;
      course::cp_async_16(course::smem_u32(sK + at), k_cache + offset, valid);
      course::cp_async_16(course::smem_u32(sV + at), v_cache + offset, valid);
    }
  }
};

// Store kN outputs (columns col .. col + kN - 1) of row `grow` (among all B * H * Sq rows), already
// divided by l, and (with_lse) the row's base-2 logsumexp lse2: with one split the final output in
// q's dtype and the natural-log lse, with several the FP32 partials of split `split` for the merge
// (decode_merge.cu).
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
