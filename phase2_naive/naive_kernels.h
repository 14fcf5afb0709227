// Host-side launchers of phase 2's three naive kernels (one per .cu file), called by ops.cpp.
// Every pointer is a contiguous float32 CUDA buffer; shapes are [B*H, rows, cols] row-major.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "attention_mask.cuh"

namespace phase2_naive {

// S[bh, i, j] = scale * sum_d Q[bh, i, d] * K[bh, j, d]   (naive_qk.cu)
void launch_naive_qk(const float* q, const float* k, float* s, int64_t BH, int64_t Sq, int64_t Sk,
                     int64_t D, float scale, cudaStream_t stream);

// P[b, h, i, :] = softmax(S[b, h, i, :] + mask_bias(b, h, i, :)); rows with every key hidden
// give zeros. `p` may alias `s` (in place).   (naive_softmax.cu)
void launch_naive_softmax(const float* s, float* p, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                          const course::AttentionMasking& masking, cudaStream_t stream);

// O[bh, i, d] = sum_j P[bh, i, j] * V[bh, j, d]   (naive_av.cu)
void launch_naive_av(const float* p, const float* v, float* o, int64_t BH, int64_t Sq, int64_t Sk,
                     int64_t D, cudaStream_t stream);

}  // namespace phase2_naive
