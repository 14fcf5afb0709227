// Host-side launchers of phase 3's kernels (one per .cu file), called by ops.cu.
// Every pointer is a contiguous float32 CUDA buffer; shapes are [B*H, rows, cols] row-major.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "attention_mask.cuh"

namespace phase3_tiled {

// The tile sizes the kernels are instantiated for (T x T threads per block, T x T tiles).
inline bool is_supported_tile(int64_t tile) { return tile == 8 || tile == 16 || tile == 32; }

// S[bh, i, j] = scale * sum_d Q[bh, i, d] * K[bh, j, d], T x T output tiles   (tiled_qk.cu)
void launch_tiled_qk(int tile, const float* q, const float* k, float* s, int64_t BH, int64_t Sq,
                     int64_t Sk, int64_t D, float scale, cudaStream_t stream);

// P[b, h, i, :] = softmax(S[b, h, i, :] + mask_bias(b, h, i, :)), one block per row; rows with
// every key hidden give zeros. `p` may alias `s` (in place).   (block_softmax.cu)
void launch_block_softmax(const float* s, float* p, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                          const course::AttentionMasking& masking, cudaStream_t stream);

// O[bh, i, d] = sum_j P[bh, i, j] * V[bh, j, d], T x T output tiles   (tiled_av.cu)
void launch_tiled_av(int tile, const float* p, const float* v, float* o, int64_t BH, int64_t Sq,
                     int64_t Sk, int64_t D, cudaStream_t stream);

}  // namespace phase3_tiled
