// Flash-decoding's merge of query rows, one warp per row, shared by the split kernels' in-kernel
// merge (merge_if_last: the block that finishes a row group last merges it, with no second launch;
// the default) and by the merge kernel (decode_merge.cu, kernel 2 of the two-kernel step).
//
// Split s of a row saw its own keys and wrote O_s = sum_j 2^(s_j - lse_s) v_j (its normalised
// partial output) and lse_s = log2 sum_j 2^(s_j) (scores in base 2). Over all keys
//
//     lse = log2 sum_s 2^(lse_s)          O = sum_s 2^(lse_s - lse) O_s
//
// exactly: each O_s is rescaled from its own normaliser to the global one. A warp merges a row: its
// lanes take the splits' lse_s (lane, lane + 32, ...), two warp reductions give lse, and each lane
// then sums its D / 32 outputs over every split, kMergeInFlight splits' loads issued before the
// first is used, so a row costs a few L2 round trips and the rows of a block merge side by side. A
// split with no visible key has lse_s = -inf and O_s = 0 and weighs nothing. A NaN lse_s (the split
// kernel's mark of a bad length or page entry) makes the whole row NaN.
#pragma once

#include <cmath>

#include "common.cuh"
#include "decode.h"
#include "decode_common.cuh"

namespace phase5_decode {

constexpr int kMergeInFlight = 8;  // splits whose partial outputs one lane loads at once

// kN FP32 partial outputs at src, read from L2 (__ldcg: another block of the same kernel may have
// written them, and this SM's L1 is not kept coherent with its stores), 8 or 16 bytes a load.
template <int kN>
__device__ __forceinline__ void load_partial(const float* src, float (&dst)[kN]) {
  static_assert(kN == 2 || kN % 4 == 0, "whole 8- or 16-byte loads");
  if constexpr (kN == 2) {
    const float2 x = __ldcg(reinterpret_cast<const float2*>(src));
    dst[0] = x.x;
    dst[1] = x.y;
  } else {
#pragma unroll
    for (int w = 0; w < kN / 4; ++w) {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(src) + w);
      dst[4 * w] = x.x;
      dst[4 * w + 1] = x.y;
      dst[4 * w + 2] = x.z;
      dst[4 * w + 3] = x.w;
    }
  }
}

// Row `row` (among all B * H * Sq rows) of out and lse from its p.num_splits partials, by one warp
// (all 32 lanes call it). weight: the warp's own p.num_splits floats of shared memory.
template <typename T, int D>
__device__ void merge_row(const Params& p, int64_t row, float* weight) {
  constexpr int kPerLane = D / course::kWarpSize;  // outputs per lane, contiguous: d = kPerLane * lane + e
  constexpr int kInFlight = kMergeInFlight;
  const int lane = threadIdx.x % course::kWarpSize;
  const int64_t total_rows = static_cast<int64_t>(p.B) * p.H_kv * p.rows;
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax (Lines 10-13) and Line 15 TODOs as Steps 1-4 here, once the teaching kernel's tests pass, over the splits instead of the keys: this warp merges one row; split s's lse_s is at p.lse_part[s * total_rows + row] and its O_s at p.o_part + (s * total_rows + row) * D, both read with __ldcg (load_partial). The largest lse_s first (each lane its splits s = lane, lane + 32, ..., kept in weight[s]; course::warp_reduce_max, and __any_sync for whether any is NaN), then lse = top + log2 of the sum of 2^(lse_s - top) (-inf if no split saw a key) and weight[s] = 2^(lse_s - lse); then each lane sums weight[s] O_s over every split for its kPerLane outputs from kPerLane * lane, kInFlight splits' loads issued before any is used, and the row is written in q's dtype into p.out with lse * ln 2 into p.lse, both NaN if any split was NaN (README: How the partial results merge exactly)
  const float* lse_split = p.lse_part + row;  // split s at lse_split[s * total_rows]

  // 1. The largest split logsumexp, and whether any split is NaN (each lane its splits).
  float top = -INFINITY;
  bool nan = false;
  for (int s = lane; s < p.num_splits; s += course::kWarpSize) {
    const float x = __ldcg(lse_split + s * total_rows);
    weight[s] = x;
    nan |= isnan(x);
    top = fmaxf(top, x);
  }
  top = course::warp_reduce_max(top);
  nan = __any_sync(course::kFullMask, nan);

  // 2. lse = top + log2 sum_s 2^(lse_s - top) (-inf if no split saw a key); weight[s] = 2^(lse_s - lse).
  const float base = top == -INFINITY ? 0.0f : top;
  float sum = 0.0f;
  for (int s = lane; s < p.num_splits; s += course::kWarpSize) sum += exp2f(weight[s] - base);
  sum = course::warp_reduce_sum(sum);
  const float lse = sum > 0.0f ? base + log2f(sum) : -INFINITY;
  for (int s = lane; s < p.num_splits; s += course::kWarpSize)
    weight[s] = lse == -INFINITY ? 0.0f : exp2f(weight[s] - lse);
  __syncwarp();

  // 3. Each lane: sum_s weight[s] O_s for its outputs, the loads of kInFlight splits issued before
  //    any is used (a slot past the last split re-reads that split with weight 0, so no load waits
  //    on a branch).
  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.0f;
  for (int s0 = 0; s0 < p.num_splits; s0 += kInFlight) {
    float w[kInFlight];
    float o_s[kInFlight][kPerLane];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int s = s0 + u;
      w[u] = s < p.num_splits ? weight[s] : 0.0f;
      load_partial<kPerLane>(p.o_part + (min(s, p.num_splits - 1) * total_rows + row) * D + kPerLane * lane, o_s[u]);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] = fmaf(w[u], o_s[u][e], acc[e]);
    }
  }

  // 4. The row in q's dtype with its natural-log lse (NaN for a bad sequence).
  const float poison = __int_as_float(0x7fffffff);
  T* out = static_cast<T*>(p.out) + row * D + kPerLane * lane;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) out[e] = from_float<T>(nan ? poison : acc[e]);
  if (lane == 0) p.lse[row] = nan ? poison : lse * kLn2;
  // END SOLUTION
  __syncwarp();  // weight free for the warp's next row
}

// The shared memory merge_if_last takes from a split kernel of `warps` warps: each warp's weights.
constexpr size_t merge_smem_bytes(int warps) { return static_cast<size_t>(warps) * kMaxSplits * sizeof(float); }

// The split kernels' end with the in-kernel merge (p.arrivals set, num_splits > 1): after every
// thread stored its rows' partials, the block counts itself on its row group's counter (sequence x
// KV head, row chunk); the block that arrives last resets the counter to zero for the next call
// (utils/csrc/zeroed_counters.h) and merges the group's rows, warp w the rows w, w + warps, ...
// smem: the block's dynamic shared memory, which the kernel no longer uses.
template <typename T, int D>
__device__ __forceinline__ void merge_if_last(const Params& p, int64_t grow0, int rows, unsigned char* smem) {
  __shared__ int last;
  __threadfence();  // this thread's partials are visible to the whole GPU before the block counts
  __syncthreads();
  if (threadIdx.x == 0) {
    int* arrivals = p.arrivals + static_cast<int64_t>(blockIdx.y) * gridDim.z + blockIdx.z;
    last = atomicAdd(arrivals, 1) == p.num_splits - 1;
    if (last) *arrivals = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int warp = threadIdx.x / course::kWarpSize, warps = blockDim.x / course::kWarpSize;
  float* weight = reinterpret_cast<float*>(smem) + warp * kMaxSplits;
  for (int r = warp; r < rows; r += warps) merge_row<T, D>(p, grow0 + r, weight);
}

}  // namespace phase5_decode
