// What every backward op of phase 5 checks and allocates before its kernel (bwd_prepare.cpp): the
// arguments named where they are wrong, the gradients' buffers, and D_i (bwd_preprocess.cu) already
// computed on the current stream. Shared by this lesson's ops (bwd_ops.cpp) and the Hopper
// backward's (../hopper/hopper_ops.cpp), which compile it into their own extensions.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "bwd.h"

namespace phase5_bwd {

// The kernel the arguments are checked for: its dtypes, head dims and alignment.
//   kFp32             float32; the FP32 forward's head dims; any stride
//   kFp32TensorCores  float32; kTf32x3SupportedD; any stride; 16-byte aligned q, k, v, dout
//   kTensorCores      float16 / bfloat16; tc_supports_head_dim; stride 1; 16-byte aligned q, k, v, dout
//   kHopper           float16 / bfloat16 (its op checks the head dim); stride 1; aligned as above;
//                     q, k, v, out, dout may be views with contiguous rows (the others: contiguous)
// Every kernel takes k, v with fewer heads than q (grouped-query attention, H a multiple of H_kv).
enum class Kernel { kFp32, kFp32TensorCores, kTensorCores, kHopper };

struct Prepared {
  BwdParams params;
  at::Tensor dq, dk, dv, delta, key_lengths;  // keep the clamped key_lengths alive until the launch
  int D;
};

// window: a sliding window with is_causal, 0 for none (the Hopper op passes 0: its forward takes none).
// dq is FP32 and zeroed (every key block adds its part), [B, H, rows, D] with rows = Sq rounded up to
// a multiple of dq_row_multiple (the Hopper kernel adds whole 64-row tiles); dk, dv contiguous: k's
// shape for the Hopper kernel, [B, H, Sk, D] for the others, which write them per query head
// (sum_over_groups turns them into k's shape).
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                 const at::Tensor& lse, const at::Tensor& dout, const c10::optional<at::Tensor>& dlse,
                 const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
                 int64_t stride, const c10::optional<at::Tensor>& key_lengths, int64_t window, Kernel kernel,
                 int64_t dq_row_multiple = 1);

// The gradient of a K/V head with G = H / H_kv query heads: per_query_head [B, H, Sk, D] summed over
// each group of G adjacent heads, [B, H_kv, Sk, D] in the same dtype (FlashAttention-2's expanded
// dK, dV); per_query_head itself when H_kv = H.
at::Tensor sum_over_groups(const at::Tensor& per_query_head, int64_t H_kv);

}  // namespace phase5_bwd
