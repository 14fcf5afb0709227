// FlashAttention-2 backward, Algorithm 2, line 4 (the preprocessing): D_i = rowsum(dO_i * O_i).
//
// Why: dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik), and sum_k P_ik dP_ik = sum_k P_ik (dO_i . V_k)
// = dO_i . (sum_k P_ik V_k) = dO_i . O_i. One dot product of length D per query row replaces a
// reduction over all Sk keys, and the main kernel, which sees only Bc keys at a time, gets it ready.
// When the logsumexp is an output whose gradient dlse is used too, d lse_i / d S_ij = P_ij adds
// dlse_i P_ij to dS_ij: the same formula with D_i - dlse_i, folded in here.
//
// One warp per row: lanes stride along D (coalesced), then a warp sum. FP32 accumulation for every
// input dtype. out and dout are read through their own strides: the Hopper backward takes them as
// views of [B, S, H, D] memory, as its forward writes O.
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bwd.h"
#include "common.cuh"

namespace phase5_bwd {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per row

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__global__ void preprocess_kernel(const T* out, RowStrides os, const T* dout, RowStrides ds, const float* dlse,
                                  float* delta, int64_t H, int64_t Sq, int64_t rows, int D) {
  const int lane = static_cast<int>(threadIdx.x) % course::kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / course::kWarpSize;
  if (row >= rows) return;
  // Row (b, h, i) of [B, H, Sq]: out and dout may be views (heads inside a position), rows contiguous.
  const int64_t i = row % Sq, h = (row / Sq) % H, b = row / (Sq * H);
  const T* o = out + b * os.b + h * os.h + i * os.s;
  const T* dO = dout + b * ds.b + h * ds.h + i * ds.s;
  // BEGIN SOLUTION: D_i of this warp's row: the dot product of the rows dO and o (D elements each, in FP32 through to_float), each lane a strided part of it, summed over the warp (course::warp_reduce_sum), and lane 0 writes delta[row], less dlse[row] when dlse is given (README: The derivation)
  float sum = 0.0f;
  for (int d = lane; d < D; d += course::kWarpSize) sum = fmaf(to_float(dO[d]), to_float(o[d]), sum);
  sum = course::warp_reduce_sum(sum);
  if (lane == 0) delta[row] = dlse != nullptr ? sum - dlse[row] : sum;
  // END SOLUTION
}

template <typename T>
void launch_typed(const void* out, RowStrides os, const void* dout, RowStrides ds, const float* dlse, float* delta,
                  int64_t H, int64_t Sq, int64_t rows, int D, cudaStream_t stream) {
  const int64_t blocks = course::ceil_div<int64_t>(rows, kRowsPerBlock);
  TORCH_CHECK(blocks <= 0x7fffffff, "q: too many rows (B*H*Sq) for one grid");
  preprocess_kernel<T><<<static_cast<unsigned>(blocks), kRowsPerBlock * course::kWarpSize, 0, stream>>>(
      static_cast<const T*>(out), os, static_cast<const T*>(dout), ds, dlse, delta, H, Sq, rows, D);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_preprocess(const void* out, RowStrides out_strides, const void* dout, RowStrides dout_strides,
                       const float* dlse, float* delta, int64_t B, int64_t H, int64_t Sq, int D, DType dtype,
                       cudaStream_t stream) {
  const int64_t rows = B * H * Sq;
  switch (dtype) {
    case DType::kFloat:
      launch_typed<float>(out, out_strides, dout, dout_strides, dlse, delta, H, Sq, rows, D, stream);
      break;
    case DType::kHalf:
      launch_typed<__half>(out, out_strides, dout, dout_strides, dlse, delta, H, Sq, rows, D, stream);
      break;
    case DType::kBFloat16:
      launch_typed<__nv_bfloat16>(out, out_strides, dout, dout_strides, dlse, delta, H, Sq, rows, D, stream);
      break;
  }
}

}  // namespace phase5_bwd
