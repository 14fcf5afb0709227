// Flash-decoding, kernel 2 of 2: the merge.
//
// Split s of a row saw its own keys and wrote O_s = sum_j 2^(s_j - lse_s) v_j (its normalised
// partial output) and lse_s = log2 sum_j 2^(s_j) (scores in base 2). Over all keys
//
//     lse = log2 sum_s 2^(lse_s)          O = sum_s 2^(lse_s - lse) O_s
//
// exactly: each O_s is rescaled from its own normaliser to the global one. One block per output
// row, its warps taking every num_warps-th split, so that the loads of a row's partials are in
// flight together instead of one after another; a split with no visible key has lse_s = -inf and
// O_s = 0 and weighs nothing. A NaN lse_s (the split kernel's mark of a bad length or page entry)
// makes the whole row NaN.
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cmath>

#include "common.cuh"
#include "decode.h"
#include "decode_common.cuh"

namespace phase5_decode {
namespace {

constexpr int kMaxWarps = 8;  // warps per row (fewer when there are fewer splits)
constexpr int kInFlight = 4;  // splits whose partial outputs one warp loads at once

template <typename T, int D>
__global__ void __launch_bounds__(kMaxWarps * 32) decode_merge_kernel(const Params p) {
  constexpr int kPerLane = D / course::kWarpSize;  // outputs per lane, contiguous: d = kPerLane * lane + e
  __shared__ float weight[kMaxSplits];             // split s's lse_s, then its weight 2^(lse_s - lse)
  __shared__ float warp_o[kMaxWarps][D];           // each warp's sum over its splits
  __shared__ float scratch[kMaxWarps];             // block reductions
  const int lane = threadIdx.x % course::kWarpSize;
  const int warp = threadIdx.x / course::kWarpSize;
  const int num_warps = blockDim.x / course::kWarpSize;
  const int64_t total_rows = static_cast<int64_t>(p.B) * p.H_kv * p.rows;
  const int64_t row = blockIdx.x;
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax (Lines 10-13) and Line 15 TODOs as Steps 1-4 here, once the teaching kernel's tests pass, over the splits instead of the keys: this block is one row; split s's lse_s is at p.lse_part[s * total_rows + row] and its O_s at p.o_part + (s * total_rows + row) * D. The largest lse_s first (each thread its splits s = threadIdx.x, + blockDim.x, ..., kept in weight[s]; course::block_reduce_max, and __syncthreads_or for whether any is NaN), then lse = top + log2 of the sum of 2^(lse_s - top) (-inf if no split saw a key) and weight[s] = 2^(lse_s - lse); then warp w sums weight[s] O_s over s = w, w + num_warps, ... (each lane its kPerLane outputs from kPerLane * lane, load_as_float), the warps' sums are added through warp_o, and the row is written in q's dtype into p.out with lse * ln 2 into p.lse, both NaN if any split was NaN (README: How the partial results merge exactly)
  const float* lse_split = p.lse_part + row;  // split s at lse_split[s * total_rows]

  // 1. The largest split logsumexp, and whether any split is NaN (each thread its splits).
  float top = -INFINITY;
  bool nan = false;
  for (int s = threadIdx.x; s < p.num_splits; s += blockDim.x) {
    const float x = lse_split[s * total_rows];
    weight[s] = x;
    nan |= isnan(x);
    top = fmaxf(top, x);
  }
  top = course::block_reduce_max(top, scratch);
  nan = __syncthreads_or(nan);

  // 2. lse = top + log2 sum_s 2^(lse_s - top) (-inf if no split saw a key); weight[s] = 2^(lse_s - lse).
  const float base = top == -INFINITY ? 0.0f : top;
  float sum = 0.0f;
  for (int s = threadIdx.x; s < p.num_splits; s += blockDim.x) sum += exp2f(weight[s] - base);
  sum = course::block_reduce_sum(sum, scratch);
  const float lse = sum > 0.0f ? base + log2f(sum) : -INFINITY;
  for (int s = threadIdx.x; s < p.num_splits; s += blockDim.x)
    weight[s] = lse == -INFINITY ? 0.0f : exp2f(weight[s] - lse);
  __syncthreads();

  // 3. Warp w: sum_s weight[s] O_s over its splits s = w, w + num_warps, ..., the loads of kInFlight
  //    splits issued before any is used (one vector load per lane and split; a slot past the last
  //    split re-reads that split with weight 0, so no load waits on a branch).
  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.0f;
  for (int s0 = warp; s0 < p.num_splits; s0 += kInFlight * num_warps) {
    float w[kInFlight];
    float o_s[kInFlight][kPerLane];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int s = s0 + u * num_warps;
      w[u] = s < p.num_splits ? weight[s] : 0.0f;
      load_as_float<kPerLane>(p.o_part + (min(s, p.num_splits - 1) * total_rows + row) * D + kPerLane * lane, o_s[u]);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] = fmaf(w[u], o_s[u][e], acc[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) warp_o[warp][kPerLane * lane + e] = acc[e];
  __syncthreads();

  // 4. O = the warps' sums added; the row written in q's dtype with its natural-log lse (NaN for a
  //    bad sequence).
  const float poison = __int_as_float(0x7fffffff);
  T* out = static_cast<T*>(p.out) + row * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < num_warps; ++w) o += warp_o[w][d];
    out[d] = from_float<T>(nan ? poison : o);
  }
  if (threadIdx.x == 0) p.lse[row] = nan ? poison : lse * kLn2;
  // END SOLUTION
}

template <typename T, int D>
void launch(const Params& p, cudaStream_t stream) {
  const int64_t total_rows = static_cast<int64_t>(p.B) * p.H_kv * p.rows;
  TORCH_CHECK(total_rows <= 0x7fffffff, "too many query rows for the merge kernel's grid: ", total_rows);
  const int warps = std::min(kMaxWarps, p.num_splits);
  decode_merge_kernel<T, D><<<static_cast<unsigned>(total_rows), warps * course::kWarpSize, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_for_head_dim(const Params& p, int64_t D, cudaStream_t stream) {
  switch (D) {
    case 64: launch<T, 64>(p, stream); break;
    case 128: launch<T, 128>(p, stream); break;
    case 256: launch<T, 256>(p, stream); break;
    default: TORCH_CHECK(false, "head dim D=", D, " (q.size(3)) is not supported: use 64, 128 or 256");
  }
}

}  // namespace

void launch_merge(const Params& p, at::ScalarType dtype, int64_t D, cudaStream_t stream) {
  switch (dtype) {
    case at::kHalf: launch_for_head_dim<__half>(p, D, stream); break;
    case at::kBFloat16: launch_for_head_dim<__nv_bfloat16>(p, D, stream); break;
    case at::kFloat: launch_for_head_dim<float>(p, D, stream); break;
    default: TORCH_CHECK(false, "q must be float16, bfloat16 or float32, got ", dtype);
  }
}

}  // namespace phase5_decode
