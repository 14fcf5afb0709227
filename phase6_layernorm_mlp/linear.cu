// FP32 linear layer, version 1: a tiled, register-blocked SGEMM whose next tile is staged through
// registers, with a fused epilogue (linear_tile.cuh has what both versions share):
//   C[M, N] = act(A[M, K] W[N, K]^T + bias[N]) + residual[M, N]
// A is the activation (tokens x in_features), W an nn.Linear weight ([out, in]): both operands are
// K-contiguous ("NT" GEMM). Phases 3-4 applied to a GEMM: shared-memory tiles so every element
// fetched from global memory is used BM (or BN) times, and a TM x TN register micro-tile so every
// value read from shared memory feeds TN (or TM) FMAs.
//
// Two load paths, picked per call:
//   kVec = true:  K % 4 == 0, N % 4 == 0 and 16-byte aligned pointers: float4 loads of A and W
//                 (tails of M and N zero-filled), float4 epilogue loads and stores.
//   kVec = false: any M, N, K and alignment: the same tiles filled with bounds-checked scalar
//                 loads, scalar epilogue.
//
// Block tile BM x BN = 128 x 128, BK = 16. Each thread owns a TM x TN micro-tile as (TM/4) x (TN/4)
// quadrants of 4 x 4, spaced BM/(TM/4) rows and BN/(TN/4) columns apart (so its shared-memory
// reads and its global stores are float4 and consecutive across the warp). Shared memory holds A
// and W tiles transposed (k-major: As[k][m], Ws[k][n]) so the inner loop reads 4 consecutive m or
// n as one float4. The transposing store would hit the same banks from 4 k-rows; an XOR swizzle
// of the m / n index by the k-quad ((k / 4) % 4) * 8 makes those stores conflict-free and keeps
// each float4 of 4 consecutive m / n together. Two shared-memory stages (double buffering): while
// the block computes on stage t % 2, the next tile's global loads are in flight in registers and
// are stored into the other stage, one __syncthreads per k-tile.
//
// Tile configurations (`variant` 0-2; run.py times every variant):
//   0: TM x TN = 8 x 8,  256 threads, 2 blocks per SM (registers capped at 128)
//   1: TM x TN = 8 x 8,  256 threads, 1 block per SM (no cap: the compiler takes ~150 registers)
//   2: TM x TN = 8 x 16, 128 threads, 2 blocks per SM (cuBLAS's shape here: 8 warps per SM, 128
//      accumulators per thread, 6 float4 shared-memory reads per 128 FFMA instead of 4 per 64)
// Split-K (any variant of this file; linear_split_k.cuh): with a grid of less than one wave of
// blocks, the k-tiles are cut into gridDim.z ranges whose partial sums a second kernel adds up.
// What the compiler made of it (SASS, variant 0): it sinks the "prefetch" loads below the
// multiply, next to the stores that need them, so their latency is not hidden; and each tile
// recomputes 64-bit load and store addresses. linear_async.cu removes both.
#include <cstdint>

#include "common.cuh"
#include "launchers.h"
#include "linear_split_k.cuh"
#include "linear_tile.cuh"
#include "vec_io.cuh"

namespace phase6 {
namespace {

constexpr int BK = 16;          // k-slice per stage
constexpr int kQuads = BK / 4;  // float4 k-quads per tile row

// Column of logical index m (or n) in k-row k of a transposed tile: XOR with the k-quad's bank
// group. Keeps multiples of 4 together (float4 reads) and sends the 4 k-quads a warp stores to
// 4 different groups of 8 banks.
struct QuadSwizzle {
  static __device__ __forceinline__ int col(int m, int k) { return m ^ (((k / 4) % 4) * 8); }
};

// Global -> registers: this thread's float4 slices of the tile whose first row is `block`
// (A or W already offset to the block's first row) and whose first k is k0. Rows >= rows
// (rows left in the matrix from the block's first row) and k >= K read as zero.
template <bool kVec, int THREADS, int LOADS>
__device__ __forceinline__ void load_tile(const float* __restrict__ block, int rows, int64_t K, int64_t k0,
                                          float (&regs)[LOADS][4]) {
  // BEGIN SOLUTION: Port of Step 1 of phase 4's matmul_tiled.cu, once phase 4's tests pass: this thread's LOADS k-quads of the tile into regs, consecutive threads on consecutive k-quads of a row (coalesced), a float4 each when kVec, else bounds-checked floats, zeros for rows past `rows` and k past K (README: Linear, version 1)
#pragma unroll
  for (int l = 0; l < LOADS; ++l) {
    const int idx = threadIdx.x + l * THREADS;
    const int row = idx / kQuads;
    const int64_t k = k0 + (idx % kQuads) * 4;
    const float* p = block + row * K + k;
    if constexpr (kVec) {
      // K % 4 == 0: a k-quad is either fully inside the matrix or fully outside.
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (row < rows && k < K) v = *reinterpret_cast<const float4*>(p);
      regs[l][0] = v.x; regs[l][1] = v.y; regs[l][2] = v.z; regs[l][3] = v.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) regs[l][j] = (row < rows && k + j < K) ? p[j] : 0.0f;
    }
  }
  // END SOLUTION
}

// Registers -> shared memory, transposed to [k][row] with the swizzle.
template <int THREADS, int LOADS, int ROWS>
__device__ __forceinline__ void store_tile(const float (&regs)[LOADS][4], float (*tile)[ROWS]) {
  // BEGIN SOLUTION: Port of Step 2 of phase 4's matmul_tiled.cu, once phase 4's tests pass: regs (in the layout load_tile fills) into the tile transposed to [k][row], each row's column through QuadSwizzle::col instead of padding (README: Linear, version 1)
#pragma unroll
  for (int l = 0; l < LOADS; ++l) {
    const int idx = threadIdx.x + l * THREADS;
    const int row = idx / kQuads;
    const int k = (idx % kQuads) * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) tile[k + j][QuadSwizzle::col(row, k + j)] = regs[l][j];
  }
  // END SOLUTION
}

template <class Cfg, Activation ACT, bool kVec, bool kSplitK>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
linear_kernel(const float* __restrict__ A, const float* __restrict__ W, const float* __restrict__ bias,
              const float* __restrict__ residual, float* __restrict__ C, int64_t M, int64_t N, int64_t K,
              float* __restrict__ partials, int64_t tiles_per_split) {
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kLoads = BM * kQuads / kThreads;  // float4 loads of A (and of W) per thread per tile
  static_assert(Cfg::BK == BK && Cfg::kStages == 2 && BM == BN, "register staging: BK = 16, two stages");
  static_assert((BM * kQuads) % kThreads == 0, "every thread loads the same number of float4 per tile");
  static_assert(kThreads / kQuads % 8 == 0, "a warp's loads must cover 8 consecutive rows (for the swizzle)");
  __shared__ __align__(16) float As[2][BK][BM];
  __shared__ __align__(16) float Ws[2][BK][BN];

  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int tx = threadIdx.x % (BN / Cfg::TN);  // column group: n = h * kColStep + tx*4
  const int ty = threadIdx.x / (BN / Cfg::TN);  // row group:    m = g * kRowStep + ty*4

  float acc[Cfg::TM][Cfg::TN] = {};
  float a_regs[kLoads][4];
  float w_regs[kLoads][4];
  // Split-K: this block multiplies k-tiles [t_first, t_first + tiles) only. (A template flag, so
  // that the unsplit kernel carries none of it: under the 128-register cap it cost about 5%.)
  const int64_t t_first = kSplitK ? static_cast<int64_t>(blockIdx.z) * tiles_per_split : 0;
  const int64_t tiles = kSplitK ? min(course::ceil_div<int64_t>(K, BK) - t_first, tiles_per_split)
                                : course::ceil_div<int64_t>(K, BK);
  const int64_t k_first = t_first * BK;
  const float* A_block = A + m0 * K;  // the block's first row of A and of W
  const float* W_block = W + n0 * K;
  const int a_rows = static_cast<int>(min(M - m0, static_cast<int64_t>(BM)));
  const int w_rows = static_cast<int>(min(N - n0, static_cast<int64_t>(BN)));

  // BEGIN SOLUTION: Port of the double buffering of phase 4's matmul_tiled.cu (before its loop, Steps 3 and 5), once phase 4's tests pass, with the two stages As[2], Ws[2]: this block's `tiles` k-tiles starting at k = k_first (its split-K range; the whole of K without a split), the first into stage 0, then per k-tile the next tile's loads in flight while multiply_tile works on this stage, stored into the other stage afterwards, one barrier per tile (README: Linear, version 1)
  // Prologue: tile 0 into stage 0.
  if (tiles > 0) {
    load_tile<kVec, kThreads>(A_block, a_rows, K, k_first, a_regs);
    load_tile<kVec, kThreads>(W_block, w_rows, K, k_first, w_regs);
    store_tile<kThreads>(a_regs, As[0]);
    store_tile<kThreads>(w_regs, Ws[0]);
  }
  __syncthreads();

  for (int64_t t = 0; t < tiles; ++t) {
    const int stage = t % 2;
    // Step 1: issue the global loads of tile t+1; they fly while this tile is computed.
    const bool more = t + 1 < tiles;
    if (more) {
      load_tile<kVec, kThreads>(A_block, a_rows, K, k_first + (t + 1) * BK, a_regs);
      load_tile<kVec, kThreads>(W_block, w_rows, K, k_first + (t + 1) * BK, w_regs);
    }
    // Step 2: acc += A_tile W_tile^T, one outer product of TM a's and TN w's per k.
    multiply_tile<Cfg, QuadSwizzle>(&As[stage][0][0], &Ws[stage][0][0], tx, ty, acc);
    // Step 3: the prefetched tile goes into the other stage (last read before the previous
    // barrier), then one barrier makes it visible and frees this stage.
    if (more) {
      store_tile<kThreads>(a_regs, As[1 - stage]);
      store_tile<kThreads>(w_regs, Ws[1 - stage]);
    }
    __syncthreads();
  }
  // END SOLUTION

  // Step 4: bias, activation, residual, store; with split-K, the raw partial sum into this
  // split's slice of `partials` (linear_split_reduce_kernel finishes the output).
  if constexpr (kSplitK) {
    store_output<Cfg, Activation::kNone, kVec>(acc, nullptr, nullptr, partials + blockIdx.z * M * N, M, N, m0, n0,
                                               tx, ty);
  } else {
    store_output<Cfg, ACT, kVec>(acc, bias, residual, C, M, N, m0, n0, tx, ty);
  }
}

template <class Cfg, Activation ACT>
void launch_config(const LinearArgs& p) {
  dim3 grid = linear_grid(p);
  const SplitK split = plan_split_k(grid, course::ceil_div<int64_t>(p.K, BK), Cfg::kMinBlocks, p);
  const bool vec = p.K % 4 == 0 && aligned16(p.A) && aligned16(p.W) && vector_epilogue(p);
  auto kernel = vec ? (split.split() ? linear_kernel<Cfg, ACT, true, true> : linear_kernel<Cfg, ACT, true, false>)
                    : (split.split() ? linear_kernel<Cfg, ACT, false, true> : linear_kernel<Cfg, ACT, false, false>);
  kernel<<<grid, Cfg::kThreads, 0, p.stream>>>(p.A, p.W, p.bias, p.residual, p.C, p.M, p.N, p.K, split.workspace(),
                                               split.tiles_per_split);
  if (split.split()) reduce_split_k<ACT>(split, p);
}

template <Activation ACT>
void launch_act(const LinearArgs& p, int config) {
  switch (config) {
    case 0: return launch_config<TileConfig<8, 8, 2>, ACT>(p);
    case 1: return launch_config<TileConfig<8, 8, 1>, ACT>(p);
    default: return launch_config<TileConfig<8, 16, 2>, ACT>(p);
  }
}

}  // namespace

void launch_linear_staged(const LinearArgs& p, int config) {
  with_activation(p.act, [&](auto act) { launch_act<decltype(act)::value>(p, config); });
}

void launch_linear(const float* A, const float* W, const float* bias, const float* residual, float* C,
                   int64_t M, int64_t N, int64_t K, Activation act, int variant, cudaStream_t stream) {
  const LinearArgs p{A, W, bias, residual, C, M, N, K, act, stream};
  if (variant < kStagedVariants) launch_linear_staged(p, variant);
  else if (variant < kRowsVariant) launch_linear_async(p, variant - kStagedVariants);
  else if (variant == kRowsVariant) launch_linear_rows(p);
  else launch_linear_tf32x3(p);
}

}  // namespace phase6
