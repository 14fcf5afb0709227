// What bwd_ops.cpp hands to the backward kernels of phase 5 (FlashAttention-2, Algorithm 2):
//   bwd_preprocess.cu  D_i = rowsum(dO_i * O_i) (minus dlse_i), one warp per query row
//   bwd_fp32.cu        the FP32 teaching kernel
//   bwd_tc.cu          the FP16 / BF16 kernel on mma.sync tensor cores (variants 0 and 1)
//   bwd_tc_2d.cu       the same with FlashAttention-2's two-dimensional warp tiles (variant 2)
//   bwd_tf32x3.cu      the FP32 kernel on tensor cores (3xTF32)
// Plain data only, so this header is shared by the host compiler and nvcc.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "attention_mask.cuh"

namespace phase5_bwd {

enum class DType : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

struct BwdParams {
  const void* q;           // [B, H, Sq, D] in the inputs' dtype, contiguous
  const void* k;           // [B, H_kv, Sk, D]: query head h reads K/V head h / (H / H_kv)
  const void* v;           // [B, H_kv, Sk, D]
  const void* dout;        // [B, H, Sq, D]  dO, the gradient of the output
  const float* lse;        // [B, H, Sq]     L_i, the forward's natural-log row logsumexp
  const float* delta;      // [B, H, Sq]     D_i = rowsum(dO_i * O_i) - dlse_i (bwd_preprocess.cu)
  float* dq;               // [B, H, Sq, D]  FP32, zeroed: every key block adds its part (atomicAdd)
  void* dk;                // [B, H, Sk, D]  in the inputs' dtype, written once per key block, one
  void* dv;                // [B, H, Sk, D]  head per query head (the op sums each group of H / H_kv)
  const int* key_lengths;  // [B] valid keys per batch (clamped to [0, Sk]), or nullptr
  int64_t B, H, H_kv, Sq, Sk;
  float scale;             // softmax scale (1/sqrt(D) by default)
  course::AttentionMasking masking;  // user mask (bool / additive), causal, stride
  int window;              // sliding window (with causal): query i sees keys i - window < j <= i; 0: none
};

// Grouped-query attention: the (batch, K/V head) pair whose K, V rows the (batch, query head) pair
// bh = b H + h reads. With H = H_kv G, bh / G = b H_kv + h / G. 32-bit division: bh < a grid's 2^31
// blocks.
__host__ __device__ inline int64_t kv_pair(int64_t bh, const BwdParams& p) {
  return static_cast<int>(bh) / (static_cast<int>(p.H) / static_cast<int>(p.H_kv));
}

// The sliding window, in three questions the kernels ask (window 0: none, every answer "all"). The
// tensor-core kernels ask the per-tile and per-score ones only in their instance for a user mask or
// a window (kMaskOrWindow), so that a call with neither runs code without them.
// Whether key j is inside query i's window (causal hides the keys after i).
__host__ __device__ inline bool in_window(const BwdParams& p, int64_t i, int64_t j) {
  return p.window == 0 || j > i - p.window;
}
// The end of the query rows that see a key of the block [k0, k0 + n): row k0 + n - 1 + window - 1 is
// the last one whose window reaches the block's last key.
__host__ __device__ inline int64_t query_rows_end(const BwdParams& p, int64_t k0, int64_t n) {
  return p.window == 0 || k0 + n - 1 + p.window > p.Sq ? p.Sq : k0 + n - 1 + p.window;
}
// Whether a call needs the tensor-core kernels' instance for a user mask or a window (kMaskOrWindow).
inline bool uses_mask_or_window(const BwdParams& p) {
  return p.masking.mask.kind != course::MaskKind::kNone || p.window > 0;
}
// Whether the tile of queries [q0, q0 + m) and keys from k0 on holds a pair outside the window.
__host__ __device__ inline bool crosses_window(const BwdParams& p, int64_t q0, int64_t m, int64_t k0) {
  return p.window > 0 && q0 + m - 1 - k0 >= p.window;
}

// Element strides of a [B, H, S, D] tensor whose rows (D) are contiguous: batch, head, position.
struct RowStrides {
  int64_t b, h, s;
};

// delta[r] = sum_d dout[r, d] * out[r, d] - (dlse ? dlse[r] : 0) for the B * H * Sq rows r = (b, h, i)
// of out and dout (each with its own strides), in FP32; delta and dlse are [B, H, Sq] contiguous.
void launch_preprocess(const void* out, RowStrides out_strides, const void* dout, RowStrides dout_strides,
                       const float* dlse, float* delta, int64_t B, int64_t H, int64_t Sq, int D, DType dtype,
                       cudaStream_t stream);

// Head dims of the FP16 / BF16 backward: every multiple of kTcHeadDimStep up to kTcMaxHeadDim, as the
// tensor-core forward. D runs on the tiles of the next width in kTcTileD, the tile columns from D on
// zero-filled (bwd_tc.cu's kPadded instances). Variants 0 and 1 (a warp's 16 keys of dK, dV by D in
// registers) take D up to kTcRowTileMaxD; variant 2 takes every D. bwd_fp32.cu takes the FP32
// forward's own list.
constexpr int kTcHeadDimStep = 8, kTcMaxHeadDim = 256, kTcRowTileMaxD = 128;
constexpr int kTcTileD[] = {32, 64, 96, 128, 160, 192, 224, 256};
inline bool tc_supports_head_dim(int64_t D) { return D > 0 && D <= kTcMaxHeadDim && D % kTcHeadDimStep == 0; }
// The tile width head dim D runs on: the narrowest of kTcTileD at least D (0 if none is).
inline int tc_tile_d(int D) {
  for (const int width : kTcTileD) {
    if (width >= D) return width;
  }
  return 0;
}

// dq += ..., dk = ..., dv = ... for one attention call (each launcher picks the instance for D).
void launch_fp32_backward(const BwdParams& p, int D, cudaStream_t stream);
// FP32 on tensor cores in 3xTF32 (bwd_tf32x3.cu), at the head dims of its instances.
constexpr int kTf32x3SupportedD[] = {32, 64, 96, 128};
void launch_tf32x3_backward(const BwdParams& p, int D, cudaStream_t stream);
// variant (tensor cores): 0 = 4 warps and Bc = 64 keys per block, 1 = 8 warps, Bc = 128 (bwd_tc.cu);
// 2 = 8 warps, Bc = 128, FlashAttention-2's two-dimensional warp tiles (bwd_tc_2d.cu, which
// launch_tc_backward calls for it).
void launch_tc_backward(const BwdParams& p, int D, DType dtype, int variant, cudaStream_t stream);
void launch_tc_backward_2d(const BwdParams& p, int D, DType dtype, cudaStream_t stream);
// The dynamic shared memory a block of variant 2 needs at head dim D (tc_supports_head_dim).
int tc_backward_2d_smem_bytes(int D);

}  // namespace phase5_bwd
