// Phase 2, kernel 3 of 3: O = P V, one thread per output element O[i][d], no shared memory.
//
// Thread (i, d) walks the keys: O[i][d] = sum_j P[i][j] * V[j][d]. A warp holds 32 consecutive
// d (same i): at each step j it reads P[i][j] (a broadcast) and V[j][d..d+31] (coalesced), but
// nothing is reused on chip: every row of V is read again for each of the Sq query rows, and the
// whole Sq x Sk matrix P comes back from DRAM after the softmax wrote it.
#include <algorithm>

#include "common.cuh"
#include "naive_kernels.h"

namespace phase2_naive {
namespace {

constexpr int kBlockX = 32;  // threads along d
constexpr int kBlockY = 8;   // threads along i
constexpr int64_t kMaxGridYZ = 65535;

__global__ void naive_av_kernel(const float* __restrict__ p, const float* __restrict__ v,
                                float* __restrict__ o, int64_t BH, int64_t Sq, int64_t Sk,
                                int64_t D) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  for (int64_t bh = blockIdx.z; bh < BH; bh += gridDim.z) {
    const float* v_col = v + bh * Sk * D + d;
    for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; i < Sq;
         i += static_cast<int64_t>(gridDim.y) * blockDim.y) {
      const float* p_row = p + (bh * Sq + i) * Sk;
      // BEGIN SOLUTION: this thread's one output O[i][d] of head bh: the sum over the keys of P[i][j] times V[j][d], read straight from global memory, written to its place in O (README: The concept)
      // The weighted sum of the value rows, weights from row i of P.
      float acc = 0.0f;
      for (int64_t j = 0; j < Sk; ++j) acc = fmaf(p_row[j], v_col[j * D], acc);
      o[(bh * Sq + i) * D + d] = acc;
      // END SOLUTION
    }
  }
}

}  // namespace

void launch_naive_av(const float* p, const float* v, float* o, int64_t BH, int64_t Sq, int64_t Sk,
                     int64_t D, cudaStream_t stream) {
  const dim3 block(kBlockX, kBlockY);
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(D, kBlockX)),
                  static_cast<unsigned>(std::min(course::ceil_div<int64_t>(Sq, kBlockY), kMaxGridYZ)),
                  static_cast<unsigned>(std::min(BH, kMaxGridYZ)));
  naive_av_kernel<<<grid, block, 0, stream>>>(p, v, o, BH, Sq, Sk, D);
}

}  // namespace phase2_naive
