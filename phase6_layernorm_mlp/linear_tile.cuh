// What phase 6's two SGEMM kernels share (linear.cu: loads staged through registers;
// linear_async.cu: a cp.async pipeline): the block tile, the thread's micro-tile, the outer-product
// step over one k-slice of shared memory, and the fused epilogue.
//   C[M, N] = act(A[M, K] W[N, K]^T + bias[N]) + residual[M, N]
// Both kernels hold their tiles transposed in shared memory (k-major: As[k][m], Ws[k][n]) so one
// float4 read gives 4 consecutive m (or n); each names the XOR swizzle of its stores (`Swizzle::col`).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "gelu.cuh"
#include "launchers.h"
#include "vec_io.cuh"

namespace phase6 {

constexpr int BM = 128;  // block tile rows (tokens)
constexpr int BN = 128;  // block tile columns (out features)

// One tile configuration: the micro-tile TM x TN, the blocks per SM its registers are sized for,
// the k-slice BK per shared-memory stage and the number of stages.
template <int TM_, int TN_, int MIN_BLOCKS_, int BK_ = 16, int STAGES_ = 2>
struct TileConfig {
  static constexpr int TM = TM_;                  // micro-tile rows per thread
  static constexpr int TN = TN_;                  // micro-tile columns per thread
  static constexpr int kMinBlocks = MIN_BLOCKS_;
  static constexpr int BK = BK_;
  static constexpr int kStages = STAGES_;
  static constexpr int kThreads = (BM / TM) * (BN / TN);
  static constexpr int kRowQuads = TM / 4;        // 4-row quadrants, kRowStep rows apart
  static constexpr int kColQuads = TN / 4;        // 4-column quadrants, kColStep columns apart
  static constexpr int kRowStep = BM / kRowQuads;
  static constexpr int kColStep = BN / kColQuads;
  static constexpr int kSmemBytes = kStages * BK * (BM + BN) * static_cast<int>(sizeof(float));
  static_assert(TM % 4 == 0 && TN % 4 == 0, "quadrants are 4 x 4");
  static_assert(BK % 8 == 0, "k-slices are whole multiples of 8");
};

// Step of the main loop: acc += A_tile W_tile^T over one k-slice. Thread (ty, tx) owns rows
// m = g * kRowStep + ty*4 + (0..3) and columns n = h * kColStep + tx*4 + (0..3); per k it reads
// its TM a's and TN w's as float4 and adds their outer product (TM*TN FMAs per TM/4 + TN/4 reads).
template <class Cfg, class Swizzle>
__device__ __forceinline__ void multiply_tile(const float* __restrict__ As, const float* __restrict__ Ws,
                                              int tx, int ty, float (&acc)[Cfg::TM][Cfg::TN]) {
  // BEGIN SOLUTION: Port of Step 4 of phase 4's matmul_tiled.cu, once phase 4's tests pass, over one k-slice of BK: for every k, this thread's TM values of A and TN of W read as float4 at its quadrants' columns through Swizzle::col, and their outer product added to acc (README: Linear, version 1)
#pragma unroll
  for (int k = 0; k < Cfg::BK; ++k) {
    float a[Cfg::TM], w[Cfg::TN];
#pragma unroll
    for (int g = 0; g < Cfg::kRowQuads; ++g) {
      const float4 q = *reinterpret_cast<const float4*>(As + k * BM + Swizzle::col(g * Cfg::kRowStep + ty * 4, k));
      a[4 * g] = q.x; a[4 * g + 1] = q.y; a[4 * g + 2] = q.z; a[4 * g + 3] = q.w;
    }
#pragma unroll
    for (int h = 0; h < Cfg::kColQuads; ++h) {
      const float4 q = *reinterpret_cast<const float4*>(Ws + k * BN + Swizzle::col(h * Cfg::kColStep + tx * 4, k));
      w[4 * h] = q.x; w[4 * h + 1] = q.y; w[4 * h + 2] = q.z; w[4 * h + 3] = q.w;
    }
#pragma unroll
    for (int i = 0; i < Cfg::TM; ++i)
#pragma unroll
      for (int j = 0; j < Cfg::TN; ++j) acc[i][j] = fmaf(a[i], w[j], acc[i][j]);
  }
  // END SOLUTION
}

// Epilogue: bias, activation, residual, store. Row i of the micro-tile is
// m = (i / 4) * kRowStep + ty*4 + i % 4; columns likewise, in float4 quadrants.
// kVec (N % 4 == 0, 16-byte aligned pointers): float4 loads and stores; else scalar, any N.
template <class Cfg, Activation ACT, bool kVec>
__device__ __forceinline__ void store_output(const float (&acc)[Cfg::TM][Cfg::TN], const float* __restrict__ bias,
                                             const float* __restrict__ residual, float* __restrict__ C,
                                             int64_t M, int64_t N, int64_t m0, int64_t n0, int tx, int ty) {
  // BEGIN SOLUTION: Port of Step 6 of phase 4's matmul_tiled.cu with the epilogue fused in, once phase 4's tests pass: every element of the micro-tile inside C gets bias[n], activate<ACT> and the residual, and is stored; a float4 per quadrant when kVec, else one float at a time (README: Linear, version 1)
#pragma unroll
  for (int i = 0; i < Cfg::TM; ++i) {
    const int64_t m = m0 + ((i / 4) * Cfg::kRowStep + ty * 4 + i % 4);
    if (m >= M) continue;
#pragma unroll
    for (int h = 0; h < Cfg::kColQuads; ++h) {
      const int64_t n = n0 + h * Cfg::kColStep + tx * 4;
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
  // END SOLUTION
}

// One block per BM x BN tile of C.
inline dim3 linear_grid(const LinearArgs& p) {
  return dim3(static_cast<unsigned>(course::ceil_div<int64_t>(p.M, BM)),
              static_cast<unsigned>(course::ceil_div<int64_t>(p.N, BN)));
}

// Calls launch(std::integral_constant<Activation, ACT>{}) for the call's activation, so each
// launcher instantiates its kernels once per activation.
template <class Launch>
void with_activation(Activation act, Launch&& launch) {
  switch (act) {
    case Activation::kNone: return launch(std::integral_constant<Activation, Activation::kNone>{});
    case Activation::kGeluTanh: return launch(std::integral_constant<Activation, Activation::kGeluTanh>{});
    case Activation::kGeluErf: return launch(std::integral_constant<Activation, Activation::kGeluErf>{});
  }
}

// The float4 epilogue needs N % 4 == 0 and 16-byte aligned C, bias and residual.
inline bool vector_epilogue(const LinearArgs& p) {
  return p.N % 4 == 0 && aligned16(p.C) && (p.bias == nullptr || aligned16(p.bias)) &&
         (p.residual == nullptr || aligned16(p.residual));
}

}  // namespace phase6
