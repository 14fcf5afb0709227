// Phase 3, kernel 1 of 3: S = scale * Q K^T with shared-memory tiles.
//
// Versions (the tile size T is a template parameter; T x T threads per block):
//   T = 8   64 threads, 2 x 256 B of shared memory: little reuse per staged element (8 FMAs)
//   T = 16  256 threads, 2 x 1 KiB: the default
//   T = 32  1024 threads, 2 x 4 KiB: the most reuse, but one block fills half an SM
//
// A block owns the T x T tile S[i0 : i0+T, j0 : j0+T]. It walks the head dimension in chunks of
// T: all threads stage the Q tile Q[i0 : i0+T, d0 : d0+T] and the K tile K[j0 : j0+T, d0 : d0+T]
// in shared memory, then every thread (ty, tx) accumulates sum_c Qs[ty][c] * Kt[c][tx]. Each
// staged element now feeds T multiply-adds instead of one, and both shared-memory reads are
// conflict-free: Qs[ty][c] is one address per row of the warp (a broadcast), Kt[c][tx] runs
// along a row (consecutive banks). Out-of-range rows and columns (S or D not a multiple of T) are
// staged as zeros and never stored.
//
// Left for phase 4: the K tile is stored transposed (Kt[c][r] = K[j0 + r][d0 + c]) by letting
// thread (ty, tx) fetch K[j0 + tx][d0 + ty], so consecutive threads read global addresses D floats
// apart: T sectors per warp request where a coalesced read needs 4 (ncu: sectors per request).
// Fetching K along its rows and transposing on the way into shared memory fixes the reads, and
// then needs padding against the bank conflicts of the transposed store.
#include <algorithm>

#include "common.cuh"
#include "tiled_kernels.h"

namespace phase3_tiled {
namespace {

constexpr int64_t kMaxGridYZ = 65535;

template <int T>
__global__ void __launch_bounds__(T * T)
    tiled_qk_kernel(const float* __restrict__ q, const float* __restrict__ k,
                    float* __restrict__ s, int64_t BH, int64_t Sq, int64_t Sk, int64_t D,
                    float scale) {
  static_assert(T == 8 || T == 16 || T == 32,
                "tile T must be 8, 16 or 32: T*T threads per block must be a multiple of the warp "
                "size and at most 1024");
  __shared__ float Qs[T][T];  // Qs[r][c] = Q[i0 + r][d0 + c]
  __shared__ float Kt[T][T];  // Kt[c][r] = K[j0 + r][d0 + c]  (K tile, transposed)
  const int tx = threadIdx.x;  // column of the S tile (key j)
  const int ty = threadIdx.y;  // row of the S tile (query i)
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * T;

  // Grid-stride over heads and row tiles: the loop bounds are the same for the whole block,
  // so every thread reaches every __syncthreads().
  for (int64_t bh = blockIdx.z; bh < BH; bh += gridDim.z) {
    const float* q_bh = q + bh * Sq * D;
    const float* k_bh = k + bh * Sk * D;
    for (int64_t i0 = static_cast<int64_t>(blockIdx.y) * T; i0 < Sq;
         i0 += static_cast<int64_t>(gridDim.y) * T) {
      // BEGIN SOLUTION: this block's T x T tile of S by tiling: walk the head dimension a tile at a time, the block staging a tile of Q and of K in Qs and Kt (laid out as their comments say, zeros outside the matrices) so that each staged value feeds T multiply-adds; barriers so no thread reads a tile before it is complete or overwrites one still in use; then each thread's scaled score, only inside S (README: The concept)
      float acc = 0.0f;
      for (int64_t d0 = 0; d0 < D; d0 += T) {
        // Step 1: stage one T x T tile of Q (row-wise) and of K (transposed), zeros outside.
        Qs[ty][tx] = (i0 + ty < Sq && d0 + tx < D) ? q_bh[(i0 + ty) * D + d0 + tx] : 0.0f;
        Kt[ty][tx] = (j0 + tx < Sk && d0 + ty < D) ? k_bh[(j0 + tx) * D + d0 + ty] : 0.0f;
        __syncthreads();
        // Step 2: the partial dot product of query row i0+ty and key row j0+tx over this chunk.
#pragma unroll
        for (int c = 0; c < T; ++c) acc = fmaf(Qs[ty][c], Kt[c][tx], acc);
        // Step 3: wait until every thread is done with the tiles before they are overwritten.
        __syncthreads();
      }
      // Step 4: store the scaled score (consecutive tx: consecutive j, coalesced).
      const int64_t i = i0 + ty, j = j0 + tx;
      if (i < Sq && j < Sk) s[(bh * Sq + i) * Sk + j] = scale * acc;
      // END SOLUTION
    }
  }
}

template <int T>
void launch(const float* q, const float* k, float* s, int64_t BH, int64_t Sq, int64_t Sk,
            int64_t D, float scale, cudaStream_t stream) {
  const dim3 block(T, T);
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(Sk, T)),
                  static_cast<unsigned>(std::min(course::ceil_div<int64_t>(Sq, T), kMaxGridYZ)),
                  static_cast<unsigned>(std::min(BH, kMaxGridYZ)));
  tiled_qk_kernel<T><<<grid, block, 0, stream>>>(q, k, s, BH, Sq, Sk, D, scale);
}

}  // namespace

void launch_tiled_qk(int tile, const float* q, const float* k, float* s, int64_t BH, int64_t Sq,
                     int64_t Sk, int64_t D, float scale, cudaStream_t stream) {
  switch (tile) {
    case 8: return launch<8>(q, k, s, BH, Sq, Sk, D, scale, stream);
    case 16: return launch<16>(q, k, s, BH, Sq, Sk, D, scale, stream);
    case 32: return launch<32>(q, k, s, BH, Sq, Sk, D, scale, stream);
  }
}

}  // namespace phase3_tiled
