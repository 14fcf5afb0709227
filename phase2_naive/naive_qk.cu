// Phase 2, kernel 1 of 3: S = scale * Q K^T, one thread per score S[i][j], no shared memory.
//
// Thread (i, j) walks the head dimension: it reads row i of Q and row j of K from global memory
// and accumulates their dot product. The 32 threads of a warp hold 32 consecutive j (same i), so
// at each step d they read Q[i][d] (one address, a broadcast) and K[j][d], K[j+1][d], ...: 32
// addresses D floats apart, 32 different 32-byte sectors for 32 useful floats (uncoalesced).
// Nothing is shared between threads: every Q row is read Sk times and every K row Sq times.
#include <algorithm>

#include "common.cuh"
#include "naive_kernels.h"

namespace phase2_naive {
namespace {

constexpr int kBlockX = 32;  // threads along j (one warp: consecutive keys)
constexpr int kBlockY = 8;   // threads along i
constexpr int64_t kMaxGridYZ = 65535;

__global__ void naive_qk_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                float* __restrict__ s, int64_t BH, int64_t Sq, int64_t Sk,
                                int64_t D, float scale) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= Sk) return;
  // Grid-stride over heads and query rows, so any B*H and Sq fit the grid's y/z limits.
  for (int64_t bh = blockIdx.z; bh < BH; bh += gridDim.z) {
    const float* k_row = k + (bh * Sk + j) * D;
    for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; i < Sq;
         i += static_cast<int64_t>(gridDim.y) * blockDim.y) {
      const float* q_row = q + (bh * Sq + i) * D;
      // BEGIN SOLUTION: this thread's one score S[i][j] of head bh: the scaled dot product of query row i and key row j, read straight from global memory, written to its place in S (README: The concept)
      // The dot product q_i . k_j, straight from global memory.
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc = fmaf(q_row[d], k_row[d], acc);
      // One coalesced store per warp: consecutive threads write consecutive j.
      s[(bh * Sq + i) * Sk + j] = scale * acc;
      // END SOLUTION
    }
  }
}

}  // namespace

void launch_naive_qk(const float* q, const float* k, float* s, int64_t BH, int64_t Sq, int64_t Sk,
                     int64_t D, float scale, cudaStream_t stream) {
  const dim3 block(kBlockX, kBlockY);
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(Sk, kBlockX)),
                  static_cast<unsigned>(std::min(course::ceil_div<int64_t>(Sq, kBlockY), kMaxGridYZ)),
                  static_cast<unsigned>(std::min(BH, kMaxGridYZ)));
  naive_qk_kernel<<<grid, block, 0, stream>>>(q, k, s, BH, Sq, Sk, D, scale);
}

}  // namespace phase2_naive
