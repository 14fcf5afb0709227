// FP32 linear layer, version 3: the same C[M, N] = act(A[M, K] W[N, K]^T + bias[N]) + residual[M, N]
// for few rows, the shape of a decode step (one token per sequence: M = batch).
//
// Why the tiled SGEMMs (linear.cu, linear_async.cu) lose here: they give each block a 128 x 128
// tile of C, so M = 1..16 rows make only N / 128 blocks (16 for N = 2048, 4 for N = 512) on a
// GPU of 132 SMs, each walking all of K with 8 of its 128 rows used at most. The work is tiny
// (2 M N K FLOPs: a few MFLOP) and the bytes are the weight's N K floats, read once: at M = 1
// this is a matrix-vector product, bound by the DRAM bandwidth on W, and the kernel must spread
// W's rows over every SM.
//
// The mapping: one warp per output column n. Its 32 lanes split K (lane l takes the k-quads l,
// l + 32, l + 64, ... of W's row n: each warp-wide load is 512 consecutive bytes) and each lane
// keeps kRows partial dot products, one per row of A. A's kRows rows (kRows K floats) are read by
// every warp; they are small and stay in L1 and L2, so DRAM sees W once per block of kRows rows.
// A shuffle butterfly then sums the 32 partials of each row, and lanes 0..kRows-1 apply the
// epilogue to one row each.
//
// kRows is the smallest of 1, 2, 4, 8, 16 that covers M (rows past M are never read); M > 16 runs
// in blocks of 16 rows along gridDim.y, each reading W again (from L2 when it fits). The Python API
// picks this kernel for M up to LINEAR_ROWS_UP_TO (phase 6's run.py measures the crossover).
//
// Two load paths, as in linear.cu: kVec (K % 4 == 0, A and W 16-byte aligned) reads float4;
// otherwise each lane takes single k's. The epilogue stores one float per (row, column).
#include <cstdint>

#include "common.cuh"
#include "gelu.cuh"
#include "launchers.h"
#include "linear_tile.cuh"
#include "vec_io.cuh"

namespace phase6 {
namespace {

constexpr int kWarps = 4;          // columns per block: 4 warps, so N = 512 still makes 128 blocks
constexpr int kMaxRows = 16;       // rows per block at most (kRows)
constexpr int kMaxRowBlocks = 65535;  // gridDim.y limit; more row blocks loop

__device__ __forceinline__ float dot4(float4 a, float4 w, float acc) {
  return fmaf(a.w, w.w, fmaf(a.z, w.z, fmaf(a.y, w.y, fmaf(a.x, w.x, acc))));
}

template <int kRows, Activation ACT, bool kVec>
__global__ void __launch_bounds__(kWarps * 32)
linear_rows_kernel(const float* __restrict__ A, const float* __restrict__ W, const float* __restrict__ bias,
                   const float* __restrict__ residual, float* __restrict__ C, int64_t M, int64_t N, int64_t K) {
  const int lane = threadIdx.x % 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= N) return;  // the whole warp leaves together: no shuffle waits for it
  const float* w_row = W + n * K;
  const float b_n = bias != nullptr ? bias[n] : 0.0f;

  for (int64_t m0 = static_cast<int64_t>(blockIdx.y) * kRows; m0 < M; m0 += static_cast<int64_t>(gridDim.y) * kRows) {
    const int rows = static_cast<int>(min(M - m0, static_cast<int64_t>(kRows)));
    const float* a_rows = A + m0 * K;
    float acc[kRows] = {};

    // Step 1: each lane's partial dot products over its k's, one W load feeding kRows rows.
    if constexpr (kVec) {
      const int64_t quads = K / 4;
#pragma unroll 4
      for (int64_t q = lane; q < quads; q += 32) {
        const float4 w = __ldg(reinterpret_cast<const float4*>(w_row) + q);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (r < rows) acc[r] = dot4(__ldg(reinterpret_cast<const float4*>(a_rows + r * K) + q), w, acc[r]);
      }
    } else {
#pragma unroll 4
      for (int64_t k = lane; k < K; k += 32) {
        const float w = __ldg(w_row + k);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (r < rows) acc[r] = fmaf(__ldg(a_rows + r * K + k), w, acc[r]);
      }
    }

    // Step 2: sum each row's 32 partials across the warp (every lane ends with every sum).
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);

    // Step 3: lane r finishes row m0 + r: bias, activation, residual, store. (The unrolled
    // select keeps acc in registers; acc[lane] would put it in local memory.)
    float v = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (lane == r) v = acc[r];
    if (lane < rows) {
      const int64_t m = m0 + lane;
      v = activate<ACT>(v + b_n);
      if (residual != nullptr) v += residual[m * N + n];
      C[m * N + n] = v;
    }
  }
}

template <int kRows, Activation ACT>
void launch_rows(const LinearArgs& p) {
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(p.N, kWarps)),
                  static_cast<unsigned>(min(course::ceil_div<int64_t>(p.M, kRows), static_cast<int64_t>(kMaxRowBlocks))));
  const bool vec = p.K % 4 == 0 && aligned16(p.A) && aligned16(p.W);
  if (vec) {
    linear_rows_kernel<kRows, ACT, true><<<grid, kWarps * 32, 0, p.stream>>>(p.A, p.W, p.bias, p.residual, p.C,
                                                                             p.M, p.N, p.K);
  } else {
    linear_rows_kernel<kRows, ACT, false><<<grid, kWarps * 32, 0, p.stream>>>(p.A, p.W, p.bias, p.residual, p.C,
                                                                              p.M, p.N, p.K);
  }
}

template <Activation ACT>
void launch_rows_act(const LinearArgs& p) {
  if (p.M <= 1) return launch_rows<1, ACT>(p);
  if (p.M <= 2) return launch_rows<2, ACT>(p);
  if (p.M <= 4) return launch_rows<4, ACT>(p);
  if (p.M <= 8) return launch_rows<8, ACT>(p);
  launch_rows<kMaxRows, ACT>(p);
}

}  // namespace

void launch_linear_rows(const LinearArgs& p) {
  with_activation(p.act, [&](auto act) { launch_rows_act<decltype(act)::value>(p); });
}

}  // namespace phase6
