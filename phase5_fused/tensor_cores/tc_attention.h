// Host interface of the tensor-core fused attention kernel (tc_attention.cu), called by tc_ops.cpp.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "attention_mask.cuh"

namespace phase5_tc {

// Head dims the forward takes: every multiple of 8 from 8 to 256 (a 16-byte row chunk is wholly
// valid or padding). D runs on the tiles of the next multiple of 32, Dp (tc_attention.cu).
constexpr int kMinHeadDim = 8;
constexpr int kMaxHeadDim = 256;
inline bool supported_head_dim(int64_t d) { return d >= kMinHeadDim && d <= kMaxHeadDim && d % 8 == 0; }

// out = softmax(scale * q k^T + bias) v for q [B,H,Sq,D], k/v [B,H_kv,Sk,D] (H % H_kv == 0: query
// head h reads KV head h / (H / H_kv)), out [B,H,Sq,D], all contiguous, 16-byte aligned, float16 or
// bfloat16 (checked by the caller), D a supported_head_dim (checked again here). window: 0, or with
// causal masking a sliding window < Sq (query i sees keys i - window < j <= i; course::check_window).
// key_lengths: nullptr or [B] int32 already clamped to [0, Sk]. lse: nullptr, or [B, H, Sq] float32
// that receives each row's natural-log logsumexp (-inf for a row with no visible key). Launches on
// `stream` and checks the launch.
void launch_tc_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                         float* lse, const int* key_lengths, const course::AttentionMasking& masking,
                         float scale, int window, cudaStream_t stream);

}  // namespace phase5_tc
