// Flash-decoding, kernel 2 of 2: the merge.
//
// Split s of a row saw its own keys and wrote O_s = sum_j 2^(s_j - lse_s) v_j (its normalised
// partial output) and lse_s = log2 sum_j 2^(s_j) (scores in base 2). Over all keys
//
//     lse = log2 sum_s 2^(lse_s)          O = sum_s 2^(lse_s - lse) O_s
//
// exactly: each O_s is rescaled from its own normaliser to the global one. One warp per output
// row; a split with no visible key has lse_s = -inf and O_s = 0 and weighs nothing. A NaN lse_s
// (the split kernel's mark of a bad length or page entry) makes the whole row NaN.
#include <c10/cuda/CUDAException.h>

#include <cmath>

#include "common.cuh"
#include "decode.h"
#include "decode_common.cuh"

namespace phase5_decode {
namespace {

constexpr int kWarps = 4;  // rows per block

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32) decode_merge_kernel(const Params p) {
  constexpr int kPerLane = D / course::kWarpSize;  // outputs per lane: d = lane + 32 e
  const int lane = threadIdx.x % course::kWarpSize;
  const int64_t total_rows = static_cast<int64_t>(p.B) * p.H_kv * p.rows;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / course::kWarpSize;
  if (row >= total_rows) return;
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax (Lines 10-13) and Line 15 TODOs as Steps 1-4 here, once the teaching kernel's tests pass, over the splits instead of the keys: for this warp's row, split s's lse_s at p.lse_part[s * total_rows + row] and its O_s at p.o_part + (s * total_rows + row) * D; the largest lse_s first (warp reductions, and whether any lse_s is NaN), then lse = top + log2 of the sum of 2^(lse_s - top) (-inf if no split saw a key), O = the sum of 2^(lse_s - lse) O_s (each lane its kPerLane outputs d = lane + 32 e), and the row written in q's dtype into p.out with lse * ln 2 into p.lse, both NaN if any split was NaN (README: How the partial results merge exactly)
  const float* lse_split = p.lse_part + row;  // split s at lse_split[s * total_rows]

  // 1. The largest split logsumexp, and whether any split is NaN.
  float top = -INFINITY;
  bool nan = false;
  for (int s = lane; s < p.num_splits; s += course::kWarpSize) {
    const float x = lse_split[s * total_rows];
    nan |= isnan(x);
    top = fmaxf(top, x);
  }
  top = course::warp_reduce_max(top);
  nan = __any_sync(course::kFullMask, nan);

  // 2. lse = top + log2 sum_s 2^(lse_s - top) (-inf if no split saw a key).
  const float base = top == -INFINITY ? 0.0f : top;
  float sum = 0.0f;
  for (int s = lane; s < p.num_splits; s += course::kWarpSize) sum += exp2f(lse_split[s * total_rows] - base);
  sum = course::warp_reduce_sum(sum);
  const float lse = sum > 0.0f ? base + log2f(sum) : -INFINITY;

  // 3. O = sum_s 2^(lse_s - lse) O_s, each lane its kPerLane outputs (coalesced across the warp).
  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.0f;
  if (lse != -INFINITY) {
#pragma unroll 4
    for (int s = 0; s < p.num_splits; ++s) {
      const float weight = exp2f(lse_split[s * total_rows] - lse);
      const float* o_split = p.o_part + (s * total_rows + row) * D;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] = fmaf(weight, o_split[lane + e * course::kWarpSize], acc[e]);
    }
  }

  // 4. Write the row in q's dtype and its natural-log lse (NaN for a bad sequence).
  const float poison = __int_as_float(0x7fffffff);
  T* out = static_cast<T*>(p.out) + row * D;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) out[lane + e * course::kWarpSize] = from_float<T>(nan ? poison : acc[e]);
  if (lane == 0) p.lse[row] = nan ? poison : lse * kLn2;
  // END SOLUTION
}

template <typename T, int D>
void launch(const Params& p, cudaStream_t stream) {
  const int64_t total_rows = static_cast<int64_t>(p.B) * p.H_kv * p.rows;
  const int64_t blocks = course::ceil_div<int64_t>(total_rows, kWarps);
  TORCH_CHECK(blocks <= 0x7fffffff, "too many query rows for the merge kernel's grid: ", total_rows);
  decode_merge_kernel<T, D><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(p);
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
