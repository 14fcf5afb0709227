// FP32 linear layer as a tiled, register-blocked SGEMM with a fused epilogue:
//   C[M, N] = act(A[M, K] W[N, K]^T + bias[N]) + residual[M, N]
// A is the activation (tokens x in_features), W an nn.Linear weight ([out, in]): both operands are
// K-contiguous ("NT" GEMM). Phases 3-4 applied to a GEMM: shared-memory tiles so every element
// fetched from global memory is used BM (or BN) times, and a TM x TN register micro-tile so every
// value read from shared memory feeds TN (or TM) FMAs.
//
// Versions (one kernel, two load paths picked per call):
//   1. linear_kernel<Cfg, ACT, kVec = true>: K % 4 == 0, N % 4 == 0 and 16-byte aligned pointers:
//      float4 loads of A and W (tails of M and N zero-filled), float4 epilogue loads and stores.
//   2. linear_kernel<Cfg, ACT, kVec = false>: any M, N, K and alignment: the same tiles filled with
//      bounds-checked scalar loads, scalar epilogue.
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
// Tile configurations (`variant`, run.py times them all; 0 is the default):
//   0: TM x TN = 8 x 8,  256 threads, 2 blocks per SM (registers capped at 128)
//   1: TM x TN = 8 x 8,  256 threads, 1 block per SM (no cap: the compiler takes ~150 registers)
//   2: TM x TN = 8 x 16, 128 threads, 2 blocks per SM (cuBLAS's shape here: 8 warps per SM, 128
//      accumulators per thread, 6 float4 shared-memory reads per 128 FFMA instead of 4 per 64)
#include <cstdint>

#include "common.cuh"
#include "gelu.cuh"
#include "launchers.h"
#include "vec_io.cuh"

namespace phase6 {
namespace {

constexpr int BM = 128;  // block tile rows (tokens)
constexpr int BN = 128;  // block tile columns (out features)
constexpr int BK = 16;   // k-slice per stage
constexpr int kQuads = BK / 4;  // float4 k-quads per tile row
static_assert(BK % 4 == 0 && kQuads == 4, "the swizzle spreads exactly 4 k-quads over 4 bank groups of 8");

// One tile configuration: the micro-tile TM x TN and the blocks per SM the registers are sized for.
template <int TM_, int TN_, int MIN_BLOCKS_>
struct TileConfig {
  static constexpr int TM = TM_;                          // micro-tile rows per thread
  static constexpr int TN = TN_;                          // micro-tile columns per thread
  static constexpr int kMinBlocks = MIN_BLOCKS_;
  static constexpr int kThreads = (BM / TM) * (BN / TN);
  static constexpr int kRowQuads = TM / 4;                // 4-row quadrants, BM / kRowQuads apart
  static constexpr int kColQuads = TN / 4;                // 4-column quadrants, BN / kColQuads apart
  static constexpr int kALoads = BM * kQuads / kThreads;  // float4 loads of A per thread per tile
  static constexpr int kWLoads = BN * kQuads / kThreads;  // float4 loads of W per thread per tile
  static_assert(TM % 4 == 0 && TN % 4 == 0, "quadrants are 4 x 4");
  static_assert((BM * kQuads) % kThreads == 0 && (BN * kQuads) % kThreads == 0,
                "every thread loads the same number of float4 per tile");
  static_assert(kThreads / kQuads % 8 == 0, "a warp's loads must cover 8 consecutive rows (for the swizzle)");
};

// Column of logical index m (or n) in k-row k of a transposed tile: XOR with the k-quad's bank
// group. Keeps multiples of 4 together (float4 reads) and sends the 4 k-quads a warp stores to
// 4 different groups of 8 banks.
__device__ __forceinline__ int swizzle(int m, int k) { return m ^ (((k / 4) % 4) * 8); }

// Global -> registers: this thread's float4 slices of the tile whose first row is `block`
// (A or W already offset to the block's first row) and whose first k is k0. Rows >= rows
// (rows left in the matrix from the block's first row) and k >= K read as zero.
template <bool kVec, int THREADS, int LOADS>
__device__ __forceinline__ void load_tile(const float* __restrict__ block, int rows, int64_t K, int64_t k0,
                                          float (&regs)[LOADS][4]) {
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
}

// Registers -> shared memory, transposed to [k][row] with the swizzle.
template <int THREADS, int LOADS, int ROWS>
__device__ __forceinline__ void store_tile(const float (&regs)[LOADS][4], float (*tile)[ROWS]) {
#pragma unroll
  for (int l = 0; l < LOADS; ++l) {
    const int idx = threadIdx.x + l * THREADS;
    const int row = idx / kQuads;
    const int k = (idx % kQuads) * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) tile[k + j][swizzle(row, k + j)] = regs[l][j];
  }
}

template <class Cfg, Activation ACT, bool kVec>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
linear_kernel(const float* __restrict__ A, const float* __restrict__ W, const float* __restrict__ bias,
              const float* __restrict__ residual, float* __restrict__ C, int64_t M, int64_t N, int64_t K) {
  constexpr int TM = Cfg::TM, TN = Cfg::TN, kThreads = Cfg::kThreads;
  constexpr int kRowStep = BM / Cfg::kRowQuads;  // rows between a thread's 4-row quadrants
  constexpr int kColStep = BN / Cfg::kColQuads;  // columns between its 4-column quadrants
  __shared__ __align__(16) float As[2][BK][BM];
  __shared__ __align__(16) float Ws[2][BK][BN];

  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int tx = threadIdx.x % (BN / TN);  // column group: n = h * kColStep + tx*4
  const int ty = threadIdx.x / (BN / TN);  // row group:    m = g * kRowStep + ty*4

  float acc[TM][TN] = {};
  float a_regs[Cfg::kALoads][4];
  float w_regs[Cfg::kWLoads][4];
  const int64_t tiles = course::ceil_div<int64_t>(K, BK);
  const float* A_block = A + m0 * K;  // the block's first row of A and of W
  const float* W_block = W + n0 * K;
  const int a_rows = static_cast<int>(min(M - m0, static_cast<int64_t>(BM)));
  const int w_rows = static_cast<int>(min(N - n0, static_cast<int64_t>(BN)));

  // Prologue: tile 0 into stage 0.
  if (tiles > 0) {
    load_tile<kVec, kThreads>(A_block, a_rows, K, 0, a_regs);
    load_tile<kVec, kThreads>(W_block, w_rows, K, 0, w_regs);
    store_tile<kThreads>(a_regs, As[0]);
    store_tile<kThreads>(w_regs, Ws[0]);
  }
  __syncthreads();

  for (int64_t t = 0; t < tiles; ++t) {
    const int stage = t % 2;
    // Step 1: issue the global loads of tile t+1; they fly while this tile is computed.
    const bool more = t + 1 < tiles;
    if (more) {
      load_tile<kVec, kThreads>(A_block, a_rows, K, (t + 1) * BK, a_regs);
      load_tile<kVec, kThreads>(W_block, w_rows, K, (t + 1) * BK, w_regs);
    }
    // Step 2: acc += A_tile W_tile^T, one outer product of TM a's and TN w's per k.
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float4 a_quads[Cfg::kRowQuads], w_quads[Cfg::kColQuads];
#pragma unroll
      for (int g = 0; g < Cfg::kRowQuads; ++g)
        a_quads[g] = *reinterpret_cast<const float4*>(&As[stage][k][swizzle(g * kRowStep + ty * 4, k)]);
#pragma unroll
      for (int h = 0; h < Cfg::kColQuads; ++h)
        w_quads[h] = *reinterpret_cast<const float4*>(&Ws[stage][k][swizzle(h * kColStep + tx * 4, k)]);
      float a[TM], w[TN];
#pragma unroll
      for (int g = 0; g < Cfg::kRowQuads; ++g) {
        a[4 * g] = a_quads[g].x; a[4 * g + 1] = a_quads[g].y; a[4 * g + 2] = a_quads[g].z; a[4 * g + 3] = a_quads[g].w;
      }
#pragma unroll
      for (int h = 0; h < Cfg::kColQuads; ++h) {
        w[4 * h] = w_quads[h].x; w[4 * h + 1] = w_quads[h].y; w[4 * h + 2] = w_quads[h].z; w[4 * h + 3] = w_quads[h].w;
      }
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], w[j], acc[i][j]);
    }
    // Step 3: the prefetched tile goes into the other stage (last read before the previous
    // barrier), then one barrier makes it visible and frees this stage.
    if (more) {
      store_tile<kThreads>(a_regs, As[1 - stage]);
      store_tile<kThreads>(w_regs, Ws[1 - stage]);
    }
    __syncthreads();
  }

  // Epilogue: bias, activation, residual, store. Row i of the micro-tile is
  // m = (i / 4) * kRowStep + ty*4 + i % 4; columns likewise, in float4 quadrants.
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int64_t m = m0 + ((i / 4) * kRowStep + ty * 4 + i % 4);
    if (m >= M) continue;
#pragma unroll
    for (int h = 0; h < Cfg::kColQuads; ++h) {
      const int64_t n = n0 + h * kColStep + tx * 4;
      float v[4] = {acc[i][h * 4 + 0], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]};
      if constexpr (kVec) {
        if (n >= N) continue;  // N % 4 == 0: the quad is fully in or fully out
        if (bias != nullptr) {
          const float4 b = *reinterpret_cast<const float4*>(bias + n);
          v[0] += b.x; v[1] += b.y; v[2] += b.z; v[3] += b.w;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = activate<ACT>(v[j]);
        if (residual != nullptr) {
          const float4 r = *reinterpret_cast<const float4*>(residual + m * N + n);
          v[0] += r.x; v[1] += r.y; v[2] += r.z; v[3] += r.w;
        }
        *reinterpret_cast<float4*>(C + m * N + n) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (n + j >= N) continue;
          float out = v[j] + (bias != nullptr ? bias[n + j] : 0.0f);
          out = activate<ACT>(out);
          if (residual != nullptr) out += residual[m * N + n + j];
          C[m * N + n + j] = out;
        }
      }
    }
  }
}

template <class Cfg, Activation ACT>
void launch_config(const float* A, const float* W, const float* bias, const float* residual, float* C,
                   int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(M, BM)),
                  static_cast<unsigned>(course::ceil_div<int64_t>(N, BN)));
  const bool vec = K % 4 == 0 && N % 4 == 0 && aligned16(A) && aligned16(W) && aligned16(C) &&
                   (bias == nullptr || aligned16(bias)) && (residual == nullptr || aligned16(residual));
  if (vec) linear_kernel<Cfg, ACT, true><<<grid, Cfg::kThreads, 0, stream>>>(A, W, bias, residual, C, M, N, K);
  else linear_kernel<Cfg, ACT, false><<<grid, Cfg::kThreads, 0, stream>>>(A, W, bias, residual, C, M, N, K);
}

template <Activation ACT>
void launch_act(const float* A, const float* W, const float* bias, const float* residual, float* C,
                int64_t M, int64_t N, int64_t K, int variant, cudaStream_t stream) {
  switch (variant) {
    case 0: return launch_config<TileConfig<8, 8, 2>, ACT>(A, W, bias, residual, C, M, N, K, stream);
    case 1: return launch_config<TileConfig<8, 8, 1>, ACT>(A, W, bias, residual, C, M, N, K, stream);
    default: return launch_config<TileConfig<8, 16, 2>, ACT>(A, W, bias, residual, C, M, N, K, stream);
  }
}

}  // namespace

void launch_linear(const float* A, const float* W, const float* bias, const float* residual, float* C,
                   int64_t M, int64_t N, int64_t K, Activation act, int variant, cudaStream_t stream) {
  switch (act) {
    case Activation::kNone: launch_act<Activation::kNone>(A, W, bias, residual, C, M, N, K, variant, stream); break;
    case Activation::kGeluTanh: launch_act<Activation::kGeluTanh>(A, W, bias, residual, C, M, N, K, variant, stream); break;
    case Activation::kGeluErf: launch_act<Activation::kGeluErf>(A, W, bias, residual, C, M, N, K, variant, stream); break;
  }
}

}  // namespace phase6
