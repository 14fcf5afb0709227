// Host-side launchers of phase 4's kernels, called by ops.cpp. Every pointer is a contiguous
// float32 CUDA buffer laid out [B*H, rows, cols] row-major. A launcher picks the float4 path when
// every row length it touches is a multiple of 4 and every pointer is 16-byte aligned, else the
// scalar path (same tiles, one float per access).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "attention_mask.cuh"

namespace phase4_coalesced {

// S[bh, i, j] = scale * sum_d Q[bh, i, d] * K[bh, j, d]        (matmul_tiled.cu)
// causal: 128 x 128 tiles of S that lie wholly above the diagonal (every j > i) are skipped and
// left unwritten; only the causal softmax may read such an S (it never reads j > i).
void launch_matmul_qk(const float* q, const float* k, float* s, int64_t BH, int64_t Sq, int64_t Sk,
                      int64_t D, float scale, bool causal, cudaStream_t stream);

// O[bh, i, d] = sum_j P[bh, i, j] * V[bh, j, d]                  (matmul_tiled.cu)
// causal: the reduction of a 128-row tile stops at key m0 + 127 (P is zero beyond it, as the
// causal softmax writes it).
void launch_matmul_av(const float* p, const float* v, float* o, int64_t BH, int64_t Sq, int64_t Sk,
                      int64_t D, bool causal, cudaStream_t stream);

// P[b, h, i, :] = softmax(S[b, h, i, :] + mask_bias(b, h, i, :)); rows whose keys are all hidden
// give zeros; hidden entries (causal j > i) of S are never read. `p` may alias `s`.
// (softmax_rows.cu)
void launch_softmax(const float* s, float* p, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                    const course::AttentionMasking& masking, cudaStream_t stream);

}  // namespace phase4_coalesced
