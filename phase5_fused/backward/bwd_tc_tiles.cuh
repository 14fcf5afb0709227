// What the tensor-core backward kernels share (bwd_tc.cu, variants 0 and 1; bwd_tc_2d.cu, variant 2):
// the copy of a tile into swizzled shared memory, the ldmatrix lane addresses into such a tile, and
// the launch of one thread block per key block.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "../tensor_cores/tc_mma.cuh"
#include "bwd.h"
#include "common.cuh"
#include "cp_async.cuh"
#include "shared_memory_opt_in.h"

namespace phase5_bwd {

// Rows [row0, row0 + kRows) of a row-major [rows, head_dim] matrix into a swizzled shared tile of
// D columns with cp.async; rows at or beyond row_limit, and with kPadded the columns from head_dim
// on, are zero-filled, never read (head_dim % 8 == 0: a 16-byte chunk is wholly in or out). Without
// kPadded head_dim is D. The chunk loop has a compile-time trip count, so it unrolls into
// straight-line copies.
template <typename T, int D, int kRows, int kThreads, bool kPadded>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row0, int64_t row_limit, int head_dim) {
  constexpr int kChunks = D / 8, kTotal = kRows * kChunks;
  const int row_len = kPadded ? head_dim : D;
  const T* rows = src + row0 * row_len;
  const int64_t rows_left = row_limit - row0;
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
    if (kTotal % kThreads == 0 || idx < kTotal) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool valid = r < rows_left && (!kPadded || c * 8 < head_dim);
      course::cp_async_16(course::smem_u32(tile + r * D + tc::swizzle<kChunks>(r, c) * 8),
                          valid ? rows + r * row_len + c * 8 : src, valid);
    }
  }
}

// Every ldmatrix.x4 here takes its lane addresses from tc_mma.cuh, in one of its two lane patterns,
// into a swizzled tile of W elements per row, with tc::ldsm_addr<W> for the row R and chunk C:
//   tc::lane_tile_offset<W>    (l % 16, l / 16): matrices 0-3 are (rows R..R+7, chunk C), (R+8.., C),
//              (R.., C+1), (R+8.., C+1): the A operand of a tile whose rows are its rows (K_w, V_w),
//              and the B operand of a tile whose rows run along k, read .trans (dO_i, Q_i for dV,
//              dK; K_j);
//   tc::lane_tile_offset_b<W>  (l % 8 + 8 (l / 16), (l / 8) % 2): matrices 0-3 are (R.., C),
//              (R.., C+1), (R+8.., C), (R+8.., C+1): b0, b1 of two n8 tiles whose k runs along the
//              chunks (Q_i, dO_i for S^T, dP^T), and the A operand of a tile stored transposed, read
//              .trans (dS^T for dQ).
// Either way every operand lands in the registers the mma takes as they stand (no moves), and one
// register per tile and pattern holds the lane's address.

// One thread block of Cfg::kThreads threads per key block of Cfg::kBc keys of every (batch, head),
// with Cfg::kSmemBytes of dynamic shared memory (opted in once per device; a GPU that cannot give a
// block that much is refused with the numbers: shared_memory_opt_in.h). The kernel takes the head
// dim beside the parameters (its padded instances need it).
template <typename Cfg, auto kKernel>
void launch_key_blocks(const BwdParams& p, int head_dim, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TORCH_CHECK(major >= 8, "the tensor-core attention backward needs compute capability 8.0 or newer "
              "(mma.sync m16n8k16, ldmatrix, cp.async); this GPU has ", major, ".x");
  course::opt_in_shared_memory<kKernel>(device, Cfg::kSmemBytes);
  const int64_t blocks = course::ceil_div<int64_t>(p.Sk, Cfg::kBc) * p.B * p.H;
  TORCH_CHECK(blocks <= 0x7fffffff, "k: too many key blocks (B*H*ceil(Sk/", Cfg::kBc, ")) for one grid");
  kKernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, head_dim);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace phase5_bwd
