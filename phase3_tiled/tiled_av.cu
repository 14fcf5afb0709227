// Phase 3, kernel 3 of 3: O = P V with shared-memory tiles.
//
// Versions (the tile size T is a template parameter; T x T threads per block):
//   T = 8, 16 (default), 32: as in tiled_qk.cu.
//
// A block owns the T x T tile O[i0 : i0+T, d0 : d0+T]. It walks the keys in chunks of T: all
// threads stage P[i0 : i0+T, j0 : j0+T] and V[j0 : j0+T, d0 : d0+T] in shared memory (row-wise,
// coalesced), then thread (ty, tx) accumulates sum_c Ps[ty][c] * Vs[c][tx]. Each staged element
// feeds T multiply-adds. Here the shared reads are conflict-free: within a warp Ps[ty][c] is a
// broadcast per row and Vs[c][tx] runs along a row (consecutive banks). Out-of-range rows and
// columns (S or D not a multiple of T) are staged as zeros and never stored.
#include <algorithm>

#include "common.cuh"
#include "tiled_kernels.h"

namespace phase3_tiled {
namespace {

constexpr int64_t kMaxGridYZ = 65535;

template <int T>
__global__ void __launch_bounds__(T * T)
    tiled_av_kernel(const float* __restrict__ p, const float* __restrict__ v,
                    float* __restrict__ o, int64_t BH, int64_t Sq, int64_t Sk, int64_t D) {
  static_assert(T == 8 || T == 16 || T == 32,
                "tile T must be 8, 16 or 32: T*T threads per block must be a multiple of the warp "
                "size and at most 1024");
  __shared__ float Ps[T][T];  // Ps[r][c] = P[i0 + r][j0 + c]
  __shared__ float Vs[T][T];  // Vs[r][c] = V[j0 + r][d0 + c]
  const int tx = threadIdx.x;  // column of the O tile (d)
  const int ty = threadIdx.y;  // row of the O tile (query i)
  const int64_t d0 = static_cast<int64_t>(blockIdx.x) * T;

  for (int64_t bh = blockIdx.z; bh < BH; bh += gridDim.z) {
    const float* p_bh = p + bh * Sq * Sk;
    const float* v_bh = v + bh * Sk * D;
    for (int64_t i0 = static_cast<int64_t>(blockIdx.y) * T; i0 < Sq;
         i0 += static_cast<int64_t>(gridDim.y) * T) {
      // BEGIN SOLUTION: this block's T x T tile of O by tiling, as in tiled_qk.cu: walk the keys a tile at a time, staging a tile of P and of V in Ps and Vs (zeros outside the matrices) so that each staged value feeds T multiply-adds, with the barriers that keep it correct; then each thread's output, only inside O (README: The concept)
      float acc = 0.0f;
      for (int64_t j0 = 0; j0 < Sk; j0 += T) {
        // Step 1: stage one T x T tile of P and of V (zeros outside the matrices).
        Ps[ty][tx] = (i0 + ty < Sq && j0 + tx < Sk) ? p_bh[(i0 + ty) * Sk + j0 + tx] : 0.0f;
        Vs[ty][tx] = (j0 + ty < Sk && d0 + tx < D) ? v_bh[(j0 + ty) * D + d0 + tx] : 0.0f;
        __syncthreads();
        // Step 2: the partial weighted sum of value column d0+tx for query row i0+ty.
#pragma unroll
        for (int c = 0; c < T; ++c) acc = fmaf(Ps[ty][c], Vs[c][tx], acc);
        // Step 3: wait until every thread is done with the tiles before they are overwritten.
        __syncthreads();
      }
      // Step 4: store the output element.
      const int64_t i = i0 + ty, d = d0 + tx;
      if (i < Sq && d < D) o[(bh * Sq + i) * D + d] = acc;
      // END SOLUTION
    }
  }
}

template <int T>
void launch(const float* p, const float* v, float* o, int64_t BH, int64_t Sq, int64_t Sk,
            int64_t D, cudaStream_t stream) {
  const dim3 block(T, T);
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(D, T)),
                  static_cast<unsigned>(std::min(course::ceil_div<int64_t>(Sq, T), kMaxGridYZ)),
                  static_cast<unsigned>(std::min(BH, kMaxGridYZ)));
  tiled_av_kernel<T><<<grid, block, 0, stream>>>(p, v, o, BH, Sq, Sk, D);
}

}  // namespace

void launch_tiled_av(int tile, const float* p, const float* v, float* o, int64_t BH, int64_t Sq,
                     int64_t Sk, int64_t D, cudaStream_t stream) {
  switch (tile) {
    case 8: return launch<8>(p, v, o, BH, Sq, Sk, D, stream);
    case 16: return launch<16>(p, v, o, BH, Sq, Sk, D, stream);
    case 32: return launch<32>(p, v, o, BH, Sq, Sk, D, stream);
  }
}

}  // namespace phase3_tiled
