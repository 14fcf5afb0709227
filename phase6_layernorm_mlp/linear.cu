// FP32 linear layer as a tiled, register-blocked SGEMM with a fused epilogue:
//   C[M, N] = act(A[M, K] W[N, K]^T + bias[N]) + residual[M, N]
// A is the activation (tokens x in_features), W an nn.Linear weight ([out, in]): both operands are
// K-contiguous ("NT" GEMM). Phases 3-4 applied to a GEMM: shared-memory tiles so every element
// fetched from global memory is used BM (or BN) times, and a TM x TN register micro-tile so every
// value read from shared memory feeds TN (or TM) FMAs.
//
// Versions (one kernel, two load paths picked per call):
//   1. linear_kernel<ACT, kVec = true>: K % 4 == 0, N % 4 == 0 and 16-byte aligned pointers:
//      float4 loads of A and W (tails of M and N zero-filled), float4 epilogue loads and stores.
//   2. linear_kernel<ACT, kVec = false>: any M, N, K and alignment: the same tiles filled with
//      bounds-checked scalar loads, scalar epilogue.
//
// Block tile BM x BN = 128 x 128, BK = 16, 256 threads, each owning a TM x TN = 8 x 8 micro-tile
// as two 4 x 4 quadrants 64 rows / 64 columns apart (so its shared-memory reads and its global
// stores are float4 and consecutive across the warp). Shared memory holds A and W tiles
// transposed (k-major: As[k][m], Ws[k][n]) so the inner loop reads 4 consecutive m or n as one
// float4. The transposing store would hit the same banks from 4 k-rows; an XOR swizzle of the
// m / n index by the k-quad ((k / 4) % 4) * 8 makes those stores conflict-free and keeps each
// float4 of 4 consecutive m / n together. Two shared-memory stages (double buffering): while the
// block computes on stage t % 2, the next tile's global loads are in flight in registers and are
// stored into the other stage, one __syncthreads per k-tile.
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
constexpr int TM = 8;    // micro-tile rows per thread
constexpr int TN = 8;    // micro-tile columns per thread
constexpr int kThreads = (BM / TM) * (BN / TN);
constexpr int kQuads = BK / 4;                       // float4 k-quads per tile row
constexpr int kALoads = BM * kQuads / kThreads;      // float4 loads of A per thread per tile
constexpr int kWLoads = BN * kQuads / kThreads;      // float4 loads of W per thread per tile

static_assert(kThreads == 256, "the tile shapes assume 256 threads per block");
static_assert(TM == 8 && TN == 8, "each thread owns two 4-row and two 4-column quadrants");
static_assert(BM == 2 * (BM / TM) * 4 && BN == 2 * (BN / TN) * 4,
              "quadrants sit BM/2 rows and BN/2 columns apart");
static_assert(BK % 4 == 0 && kQuads == 4, "the swizzle spreads exactly 4 k-quads over 4 bank groups of 8");
static_assert((BM * kQuads) % kThreads == 0 && (BN * kQuads) % kThreads == 0,
              "every thread loads the same number of float4 per tile");
static_assert(kThreads / kQuads % 8 == 0, "a warp's loads must cover 8 consecutive rows (for the swizzle)");

// Column of logical index m (or n) in k-row k of a transposed tile: XOR with the k-quad's bank
// group. Keeps multiples of 4 together (float4 reads) and sends the 4 k-quads a warp stores to
// 4 different groups of 8 banks.
__device__ __forceinline__ int swizzle(int m, int k) { return m ^ (((k / 4) % 4) * 8); }

// Global -> registers: this thread's float4 slices of the tile whose first row is `block`
// (A or W already offset to the block's first row) and whose first k is k0. Rows >= rows
// (rows left in the matrix from the block's first row) and k >= K read as zero.
template <bool kVec, int LOADS>
__device__ __forceinline__ void load_tile(const float* __restrict__ block, int rows, int64_t K, int64_t k0,
                                          float (&regs)[LOADS][4]) {
#pragma unroll
  for (int l = 0; l < LOADS; ++l) {
    const int idx = threadIdx.x + l * kThreads;
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
template <int LOADS, int ROWS>
__device__ __forceinline__ void store_tile(const float (&regs)[LOADS][4], float (*tile)[ROWS]) {
#pragma unroll
  for (int l = 0; l < LOADS; ++l) {
    const int idx = threadIdx.x + l * kThreads;
    const int row = idx / kQuads;
    const int k = (idx % kQuads) * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) tile[k + j][swizzle(row, k + j)] = regs[l][j];
  }
}

template <Activation ACT, bool kVec>
__global__ void __launch_bounds__(kThreads, 2)
linear_kernel(const float* __restrict__ A, const float* __restrict__ W, const float* __restrict__ bias,
              const float* __restrict__ residual, float* __restrict__ C, int64_t M, int64_t N, int64_t K) {
  __shared__ __align__(16) float As[2][BK][BM];
  __shared__ __align__(16) float Ws[2][BK][BN];

  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int tx = threadIdx.x % (BN / TN);  // column group: n = tx*4 and BN/2 + tx*4
  const int ty = threadIdx.x / (BN / TN);  // row group:    m = ty*4 and BM/2 + ty*4

  float acc[TM][TN] = {};
  float a_regs[kALoads][4];
  float w_regs[kWLoads][4];
  const int64_t tiles = course::ceil_div<int64_t>(K, BK);
  const float* A_block = A + m0 * K;  // the block's first row of A and of W
  const float* W_block = W + n0 * K;
  const int a_rows = static_cast<int>(min(M - m0, static_cast<int64_t>(BM)));
  const int w_rows = static_cast<int>(min(N - n0, static_cast<int64_t>(BN)));

  // Prologue: tile 0 into stage 0.
  if (tiles > 0) {
    load_tile<kVec>(A_block, a_rows, K, 0, a_regs);
    load_tile<kVec>(W_block, w_rows, K, 0, w_regs);
    store_tile(a_regs, As[0]);
    store_tile(w_regs, Ws[0]);
  }
  __syncthreads();

  for (int64_t t = 0; t < tiles; ++t) {
    const int stage = t % 2;
    // Step 1: issue the global loads of tile t+1; they fly while this tile is computed.
    const bool more = t + 1 < tiles;
    if (more) {
      load_tile<kVec>(A_block, a_rows, K, (t + 1) * BK, a_regs);
      load_tile<kVec>(W_block, w_rows, K, (t + 1) * BK, w_regs);
    }
    // Step 2: acc += A_tile W_tile^T, one outer product of 8 a's and 8 w's per k.
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      const float4 a_lo = *reinterpret_cast<const float4*>(&As[stage][k][swizzle(ty * 4, k)]);
      const float4 a_hi = *reinterpret_cast<const float4*>(&As[stage][k][swizzle(BM / 2 + ty * 4, k)]);
      const float4 w_lo = *reinterpret_cast<const float4*>(&Ws[stage][k][swizzle(tx * 4, k)]);
      const float4 w_hi = *reinterpret_cast<const float4*>(&Ws[stage][k][swizzle(BN / 2 + tx * 4, k)]);
      const float a[TM] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
      const float w[TN] = {w_lo.x, w_lo.y, w_lo.z, w_lo.w, w_hi.x, w_hi.y, w_hi.z, w_hi.w};
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], w[j], acc[i][j]);
    }
    // Step 3: the prefetched tile goes into the other stage (last read before the previous
    // barrier), then one barrier makes it visible and frees this stage.
    if (more) {
      store_tile(a_regs, As[1 - stage]);
      store_tile(w_regs, Ws[1 - stage]);
    }
    __syncthreads();
  }

  // Epilogue: bias, activation, residual, store. Row i of the micro-tile is m = ty*4 + i
  // (i < 4) or BM/2 + ty*4 + i - 4; columns likewise in two float4 halves.
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int64_t m = m0 + (i < 4 ? ty * 4 + i : BM / 2 + ty * 4 + (i - 4));
    if (m >= M) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + h * (BN / 2) + tx * 4;
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

template <Activation ACT>
void launch_act(const float* A, const float* W, const float* bias, const float* residual, float* C,
                int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(course::ceil_div<int64_t>(M, BM)),
                  static_cast<unsigned>(course::ceil_div<int64_t>(N, BN)));
  const bool vec = K % 4 == 0 && N % 4 == 0 && aligned16(A) && aligned16(W) && aligned16(C) &&
                   (bias == nullptr || aligned16(bias)) && (residual == nullptr || aligned16(residual));
  if (vec) linear_kernel<ACT, true><<<grid, kThreads, 0, stream>>>(A, W, bias, residual, C, M, N, K);
  else linear_kernel<ACT, false><<<grid, kThreads, 0, stream>>>(A, W, bias, residual, C, M, N, K);
}

}  // namespace

void launch_linear(const float* A, const float* W, const float* bias, const float* residual, float* C,
                   int64_t M, int64_t N, int64_t K, Activation act, cudaStream_t stream) {
  switch (act) {
    case Activation::kNone: launch_act<Activation::kNone>(A, W, bias, residual, C, M, N, K, stream); break;
    case Activation::kGeluTanh: launch_act<Activation::kGeluTanh>(A, W, bias, residual, C, M, N, K, stream); break;
    case Activation::kGeluErf: launch_act<Activation::kGeluErf>(A, W, bias, residual, C, M, N, K, stream); break;
  }
}

}  // namespace phase6
