// Flash-decoding, kernel 2 of the two-kernel step: the merge, one warp per output row
// (decode_merge.cuh merge_row, which the split kernels' in-kernel merge shares). With fused_merge
// (the default) the split kernels merge for themselves and this kernel is not launched;
// decode.attention(..., fused_merge=False) runs it, so that the two can be timed side by side.
#include <c10/cuda/CUDAException.h>

#include "decode_merge.cuh"

namespace phase5_decode {
namespace {

constexpr int kRowsPerBlock = 4;  // one warp per row

template <typename T, int D>
__global__ void __launch_bounds__(kRowsPerBlock * 32) decode_merge_kernel(const Params p) {
  __shared__ float weight[kRowsPerBlock][kMaxSplits];  // each warp's split weights
  const int warp = threadIdx.x / course::kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp;
  if (row < static_cast<int64_t>(p.B) * p.H_kv * p.rows) merge_row<T, D>(p, row, weight[warp]);
}

template <typename T, int D>
void launch(const Params& p, cudaStream_t stream) {
  const int64_t total_rows = static_cast<int64_t>(p.B) * p.H_kv * p.rows;
  const int64_t blocks = (total_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  TORCH_CHECK(blocks <= 0x7fffffff, "too many query rows for the merge kernel's grid: ", total_rows);
  decode_merge_kernel<T, D><<<static_cast<unsigned>(blocks), kRowsPerBlock * course::kWarpSize, 0, stream>>>(p);
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
