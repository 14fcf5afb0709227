// What ops.cpp hands to the fused FP32 kernels of phase 5: the six versions, fused_teaching.cu (v1),
// fused_v2_register_tiles.cu, fused_v3_cp_async.cu, fused_v4_exp2.cu, fused_fast.cu (v5) and
// fused_v6_tf32x3.cu (v6, tensor cores in 3xTF32).
// Plain data only, so this header is shared by the host compiler and nvcc.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "attention_mask.cuh"

namespace phase5 {

// The head dims every version takes, each with a template instance of its own (__init__.py's
// VERSION_D): the teaching kernel, versions 2-4 and the tf32x3 kernel take these only.
constexpr int kVersionD[] = {32, 64, 80, 96, 128};

// The head dims the fast kernel takes (__init__.py's SUPPORTED_D), and so the FP32 backward: every
// multiple of 8 from 8 to 256 (a 16-byte chunk of a row is wholly data or padding). A D outside
// kVersionD runs on the padded tiles of the next multiple of 32 (fused_fast.cu).
constexpr int kMinHeadDim = 8;
constexpr int kMaxHeadDim = 256;
constexpr int kHeadDimStep = 8;

inline bool version_supports_head_dim(int64_t D) {
  for (int d : kVersionD)
    if (d == D) return true;
  return false;
}

inline bool fast_supports_head_dim(int64_t D) {
  return D >= kMinHeadDim && D <= kMaxHeadDim && D % kHeadDimStep == 0;
}

// The version the `fastest` op runs (final.attention's `fused` mode): version 6 (3xTF32 tensor
// cores, as accurate as FFMA and the faster of the two at the lesson's headline shapes) wherever it
// takes the inputs: D in kVersionD, one K/V head per query head, no window; and no stride, which the
// fast kernel serves by gathering the kept keys where version 6 masks the others. Else the fast kernel.
inline bool fastest_is_version6(int64_t D, int64_t H, int64_t H_kv, int64_t stride, int64_t window) {
  return version_supports_head_dim(D) && H_kv == H && window == 0 && stride == 1;
}

struct FusedParams {
  const float* q;            // [B, H, Sq, D], contiguous, 16-byte aligned
  const float* k;            // [B, H_kv, Sk, D]
  const float* v;            // [B, H_kv, Sk, D]
  float* o;                  // [B, H, Sq, D]
  float* lse;                // [B, H, Sq] natural-log logsumexp, or nullptr when not requested
  const int* key_lengths;    // [B] valid keys per batch (already clamped to [0, Sk]), or nullptr
  int64_t B, H, Sq, Sk;
  // Grouped-query attention (fast kernel only; H_kv = H for the others): query head h reads KV
  // head h / (H / H_kv).
  int64_t H_kv;
  // Sliding window (fast kernel only, with causal; 0 = none): query i sees keys i - window < j <= i.
  int64_t window;
  float scale;               // softmax scale (1/sqrt(D) by default)
  course::AttentionMasking masking;  // user mask (bool / additive), causal, stride
  // D, the row length of q, k, v and o. Only the fast kernel's padded instances read it: the others
  // have D as a template constant.
  int head_dim;
};

// Launchers (one per kernel file); they pick the template instance for D and launch on `stream`.
// variant: the fast kernel's tile configuration (0 = default for D; see fused_fast.cu).
void launch_teaching(const FusedParams& p, int D, cudaStream_t stream);
void launch_v2(const FusedParams& p, int D, cudaStream_t stream);
void launch_v3(const FusedParams& p, int D, cudaStream_t stream);
void launch_v4(const FusedParams& p, int D, cudaStream_t stream);
void launch_tf32x3(const FusedParams& p, int D, cudaStream_t stream);
void launch_fast(const FusedParams& p, int D, int variant, cudaStream_t stream);
int fast_variant_count(int D);

}  // namespace phase5
