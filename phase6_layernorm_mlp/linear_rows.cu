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
// The mapping: kSplit warps per output column n (a block of 8 warps holds 8 / kSplit columns).
// Their 32 * kSplit lanes split K: lane l of the column's warp w takes the float4 k-quads
// 32 w + l, 32 w + l + 32 kSplit, ... of W's row n, so each warp-wide load is 512 consecutive
// bytes and W is read once. Each lane keeps kRows partial dot products, one per row of A, from one
// W load; A's kRows rows are read by every warp, but they are a few KB to a hundred and stay in L1
// and L2, so DRAM sees W once per block of kRows rows. A shuffle butterfly sums each warp's 32
// partials of each row, shared memory the column's kSplit warp sums, and lanes 0..kRows-1 of the
// column's first warp apply the epilogue to one row each.
//
// Why kSplit: a GEMV is bound by how many bytes are in flight. One warp per column gives
// linear2 (N = 512) 512 warps, about 4 per SM, each waiting out a DRAM round trip per few loads:
// the launcher raises kSplit until the grid has about 32 warps per SM (or each warp's share of K
// would fall under 128 floats).
//
// kRows is the smallest of 1, 2, 4, 8, 16 that covers M (rows past M are never read); M > 16 runs
// in blocks of 16 rows along gridDim.y, each reading W again (from L2 when it fits). The Python API
// picks this kernel for M up to LINEAR_ROWS_UP_TO (phase 6's run.py measures the crossover).
//
// Two load paths, as in linear.cu: kVec (K % 4 == 0, A and W 16-byte aligned) reads float4;
// otherwise each lane takes single k's. The epilogue stores one float per (row, column).
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "gelu.cuh"
#include "launchers.h"
#include "linear_tile.cuh"
#include "vec_io.cuh"

namespace phase6 {
namespace {

constexpr int kWarps = 8;             // warps per block: 8 / kSplit columns
constexpr int kMaxRows = 16;          // rows per block at most (kRows)
constexpr int kMaxRowBlocks = 65535;  // gridDim.y limit; more row blocks loop
constexpr int kWarpsPerSmWanted = 32;  // the launcher's kSplit target (grid warps / SMs)
constexpr int kMinKPerWarp = 128;      // nor more splits than leave each warp 128 k's

__device__ __forceinline__ float dot4(float4 a, float4 w, float acc) {
  return fmaf(a.w, w.w, fmaf(a.z, w.z, fmaf(a.y, w.y, fmaf(a.x, w.x, acc))));
}

template <int kRows, int kSplit, Activation ACT, bool kVec>
__global__ void __launch_bounds__(kWarps * 32)
linear_rows_kernel(const float* __restrict__ A, const float* __restrict__ W, const float* __restrict__ bias,
                   const float* __restrict__ residual, float* __restrict__ C, int64_t M, int64_t N, int64_t K) {
  __shared__ float warp_sums[kWarps][kRows];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int part = warp % kSplit;  // this warp's share of K
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (kWarps / kSplit) + warp / kSplit;
  const bool column_in = n < N;  // no early return: the block meets at barriers below
  const float* w_row = W + min(n, N - 1) * K;

  for (int64_t m0 = static_cast<int64_t>(blockIdx.y) * kRows; m0 < M; m0 += static_cast<int64_t>(gridDim.y) * kRows) {
    const int rows = static_cast<int>(min(M - m0, static_cast<int64_t>(kRows)));
    const float* a_rows = A + m0 * K;
    float acc[kRows] = {};

    // Step 1: each lane's partial dot products over its k's, one W load feeding kRows rows.
    if (column_in) {
      if constexpr (kVec) {
        const int64_t quads = K / 4;
#pragma unroll 4
        for (int64_t q = part * 32 + lane; q < quads; q += 32 * kSplit) {
          const float4 w = __ldg(reinterpret_cast<const float4*>(w_row) + q);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
            if (r < rows) acc[r] = dot4(__ldg(reinterpret_cast<const float4*>(a_rows + r * K) + q), w, acc[r]);
        }
      } else {
#pragma unroll 4
        for (int64_t k = part * 32 + lane; k < K; k += 32 * kSplit) {
          const float w = __ldg(w_row + k);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
            if (r < rows) acc[r] = fmaf(__ldg(a_rows + r * K + k), w, acc[r]);
        }
      }
    }

    // Step 2: sum each row's 32 partials across the warp (every lane ends with every sum); lane r
    // keeps row r's (the unrolled select keeps acc in registers, acc[lane] would not).
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
    float v = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (lane == r) v = acc[r];

    // Step 3: the column's first warp adds the other kSplit - 1 warps' sums (through shared
    // memory), then lane r finishes row m0 + r: bias, activation, residual, store.
    if constexpr (kSplit > 1) {
      if (lane < kRows) warp_sums[warp][lane] = v;
      __syncthreads();
      if (part == 0 && lane < kRows)
#pragma unroll
        for (int s = 1; s < kSplit; ++s) v += warp_sums[warp + s][lane];
    }
    if (column_in && part == 0 && lane < rows) {
      const int64_t m = m0 + lane;
      v = activate<ACT>(v + (bias != nullptr ? bias[n] : 0.0f));
      if (residual != nullptr) v += residual[m * N + n];
      C[m * N + n] = v;
    }
    if constexpr (kSplit > 1) __syncthreads();  // warp_sums is rewritten by the next row block
  }
}

template <int kRows, int kSplit, Activation ACT>
void launch_rows(const LinearArgs& p) {
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(p.N, kWarps / kSplit)),
                  static_cast<unsigned>(min(course::ceil_div<int64_t>(p.M, kRows), static_cast<int64_t>(kMaxRowBlocks))));
  const bool vec = p.K % 4 == 0 && aligned16(p.A) && aligned16(p.W);
  if (vec) {
    linear_rows_kernel<kRows, kSplit, ACT, true><<<grid, kWarps * 32, 0, p.stream>>>(p.A, p.W, p.bias, p.residual,
                                                                                     p.C, p.M, p.N, p.K);
  } else {
    linear_rows_kernel<kRows, kSplit, ACT, false><<<grid, kWarps * 32, 0, p.stream>>>(p.A, p.W, p.bias, p.residual,
                                                                                      p.C, p.M, p.N, p.K);
  }
}

// kSplit: doubled from 1 while the grid has fewer than kWarpsPerSmWanted warps per SM and each
// warp would still get kMinKPerWarp k's or more.
int split_for(const LinearArgs& p) {
  const int sms = sm_count();
  const int64_t row_blocks = std::min(course::ceil_div<int64_t>(p.M, kMaxRows), static_cast<int64_t>(kMaxRowBlocks));
  int split = 1;
  while (split < kWarps && p.N * row_blocks * split < static_cast<int64_t>(sms) * kWarpsPerSmWanted &&
         p.K >= static_cast<int64_t>(2 * split) * kMinKPerWarp)
    split *= 2;
  return split;
}

template <int kRows, Activation ACT>
void launch_rows_split(const LinearArgs& p) {
  switch (split_for(p)) {
    case 1: return launch_rows<kRows, 1, ACT>(p);
    case 2: return launch_rows<kRows, 2, ACT>(p);
    case 4: return launch_rows<kRows, 4, ACT>(p);
    default: return launch_rows<kRows, 8, ACT>(p);
  }
}

template <Activation ACT>
void launch_rows_act(const LinearArgs& p) {
  if (p.M <= 1) return launch_rows_split<1, ACT>(p);
  if (p.M <= 2) return launch_rows_split<2, ACT>(p);
  if (p.M <= 4) return launch_rows_split<4, ACT>(p);
  if (p.M <= 8) return launch_rows_split<8, ACT>(p);
  launch_rows_split<kMaxRows, ACT>(p);
}

}  // namespace

void launch_linear_rows(const LinearArgs& p) {
  with_activation(p.act, [&](auto act) { launch_rows_act<decltype(act)::value>(p); });
}

}  // namespace phase6
