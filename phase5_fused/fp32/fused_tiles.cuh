// The register-tiled pieces that versions 2-5 of the FP32 fused attention share, each written once:
//   v2 fused_v2_register_tiles.cu, v3 fused_v3_cp_async.cu, v4 fused_v4_exp2.cu, v5 fused_fast.cu.
// A version's file keeps what that version changes (its loop, loads, masking, softmax step and
// final normalization), so `diff` of two neighbours shows one idea. Here: the 16 x 16 thread grid,
// the tile configuration and its shared-memory budget, the two tile loaders, the Q K^T and P V
// products on register tiles, the store of P, and the launch. Version 6 (fused_v6_tf32x3.cu, on
// tensor cores) takes the block size, the cp.async loader, the vector helpers and the launch.
//
// Everything sits in an anonymous namespace, as it did in each version's file: each kernel file gets
// its own copy, and the kernels keep their names (phase5::(anonymous)::TileConfig<...>).
#pragma once

#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include "common.cuh"
#include "cp_async.cuh"
#include "fused.h"
#include "shared_memory_opt_in.h"

namespace phase5 {
namespace {

constexpr int kThreads = 256;
constexpr int kTX = 16;  // threads along the key / output-column direction
constexpr int kTY = 16;  // threads along the query-row direction
constexpr float kLog2e = 1.4426950408889634f;  // versions 4-5 score in log2 units
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kSmemPerSM = 233472;     // H100: 228 KiB of shared memory per SM
constexpr int kSmemPerBlockMax = 232448;  // 227 KiB per block
constexpr int kSmemReservedPerBlock = 1024;

// ------------------------------------------------------------------------------------------------
// Tile loaders. Both copy ROWS rows of D floats into shared memory (row pitch LD floats); rows at
// or past `limit` are zero-filled.

// Version 2: a float4 at a time through registers. Tile row r is global row first + r of `head`
// ([rows, D] row-major).
template <int D, int ROWS, int LD>
__device__ __forceinline__ void load_rows(float* dst, const float* head, int64_t first,
                                          int64_t limit) {
  constexpr int kChunks = D / 4;  // 16-byte chunks per row
  constexpr int kTotal = ROWS * kChunks;
  static_assert(kTotal % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int n = 0; n < kTotal / kThreads; ++n) {
    const int c = n * kThreads + threadIdx.x;
    const int r = c / kChunks;
    const int col = (c % kChunks) * 4;
    const int64_t row = first + r;
    const float4 chunk = row < limit ? *reinterpret_cast<const float4*>(head + row * D + col)
                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    *reinterpret_cast<float4*>(dst + r * LD + col) = chunk;
  }
}

// Versions 3-5: cp.async, 16 bytes per copy, the zero-fill done by the copy. Tile row r is global
// row (first + r) * step of `head`: step = 1 for Q and dense K/V; step = stride gathers the keys
// of strided attention (version 5). kPadded (the fast kernel's padded instances): the rows of
// `head` hold head_dim <= D floats (a multiple of 4); tile columns at or past head_dim are
// zero-filled, never read. Otherwise head_dim is D.
template <int D, int ROWS, int LD, bool kPadded = false>
__device__ __forceinline__ void load_rows_async(float* dst, const float* head, int64_t first,
                                                int64_t step, int64_t limit, int head_dim = D) {
  constexpr int kChunks = D / 4;  // 16-byte chunks per row
  constexpr int kTotal = ROWS * kChunks;
  static_assert(kTotal % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int n = 0; n < kTotal / kThreads; ++n) {
    const int c = n * kThreads + threadIdx.x;
    const int r = c / kChunks;
    const int col = (c % kChunks) * 4;
    const int64_t row = (first + r) * step;
    const bool valid = row < limit && (!kPadded || col < head_dim);
    course::cp_async_16(course::smem_u32(dst + r * LD + col), head + (valid ? row * head_dim + col : 0), valid);
  }
}

// ------------------------------------------------------------------------------------------------
// Small vector helpers: VW consecutive floats of a row of V or O (VW = 4, 2 or 1).

template <int VW>
__device__ __forceinline__ void load_vec(float (&dst)[VW], const float* src) {
  if constexpr (VW == 4) {
    const float4 t = *reinterpret_cast<const float4*>(src);
    dst[0] = t.x; dst[1] = t.y; dst[2] = t.z; dst[3] = t.w;
  } else if constexpr (VW == 2) {
    const float2 t = *reinterpret_cast<const float2*>(src);
    dst[0] = t.x; dst[1] = t.y;
  } else {
    dst[0] = *src;
  }
}

template <int VW>
__device__ __forceinline__ void store_vec(float* dst, const float* src) {
  if constexpr (VW == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(src[0], src[1], src[2], src[3]);
  } else if constexpr (VW == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(src[0], src[1]);
  } else {
    dst[0] = src[0];
  }
}

__device__ __forceinline__ float component(const float4& v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

// ------------------------------------------------------------------------------------------------
// The tile configuration of one template instance.

template <int D_, int BR_, int BC_, int MIN_BLOCKS_>
struct TileConfig {
  static constexpr int D = D_, Br = BR_, Bc = BC_;
  // Blocks per SM the register budget is sized for (__launch_bounds__): 2 gives 128 registers.
  static constexpr int kMinBlocks = MIN_BLOCKS_;
  static constexpr int TM = Br / kTY;  // query rows per thread
  static constexpr int TN = Bc / kTX;  // key columns of S per thread
  // O columns per thread: OC chunks of VW consecutive floats, chunk c at column (c*16 + tx)*VW.
  static constexpr int VW = (D % (4 * kTX) == 0) ? 4 : (D % (2 * kTX) == 0) ? 2 : 1;
  static constexpr int OC = D / (kTX * VW);
  static constexpr int LDQ = D + 4;   // pitch of Q, K, V rows: +4 floats shifts each row 4 banks
  static constexpr int LDP = Bc + 4;  // pitch of P rows
  static constexpr int kSmemFloats = Br * LDQ + 2 * Bc * LDQ + Br * LDP;  // Q, K, V, P
  static constexpr int kSmemBytes = kSmemFloats * 4;
  static constexpr int kBlocksBySmem = kSmemPerSM / (kSmemBytes + kSmemReservedPerBlock);

  static_assert(D % 16 == 0, "D must be a multiple of 16 (16 threads share the O columns)");
  static_assert(Br % kTY == 0 && Bc % kTX == 0, "Br and Bc must be multiples of the 16x16 grid");
  static_assert(Bc % 4 == 0, "P V reads P in float4 steps along Bc");
  static_assert(OC * kTX * VW == D, "the O columns must split evenly over the 16 threads of a row");
  static_assert(kSmemBytes <= kSmemPerBlockMax, "tiles must fit in 227 KiB of shared memory");
  static_assert(kBlocksBySmem >= kMinBlocks, "kMinBlocks blocks must fit in an SM's shared memory");
};

// ------------------------------------------------------------------------------------------------
// The products on register tiles. Thread (ty, tx) owns the query rows ty + 16 i (i < TM), the key
// columns tx + 16 n (n < TN) of S, and the O columns of chunk c at (c*16 + tx)*VW (c < OC).
// The loops along D and Bc are unrolled by 4 steps, not fully: full unrolling hoisted so many
// shared-memory loads that fused_fast.cu's Br=128 spilled 308 bytes (ptxas -v, CUDA 13.0); now
// 0-104 bytes. The kernel declares every register array, the operands these read into (kf, pf,
// vf) included: an array declared in here would come first in the kernel's frame once inlined, and
// the compiler would then assign the kernel's registers in another order (the same instructions,
// other registers).

// S_ij = Q_i K_j^T, TM x TN per thread, float4 steps along D (Q_i and K_j row-major, pitch LDQ);
// kf holds a step's TN float4 of K_j.
template <typename Cfg>
__device__ __forceinline__ void qk_tile(float (&s)[Cfg::TM][Cfg::TN], float4 (&kf)[Cfg::TN],
                                        const float* Qs, const float* Ks, int tx, int ty) {
  constexpr int D = Cfg::D, TM = Cfg::TM, TN = Cfg::TN, LDQ = Cfg::LDQ;
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int n = 0; n < TN; ++n) s[i][n] = 0.0f;
#pragma unroll 4
  for (int d = 0; d < D; d += 4) {
#pragma unroll
    for (int n = 0; n < TN; ++n)
      kf[n] = *reinterpret_cast<const float4*>(Ks + (tx + kTX * n) * LDQ + d);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const float4 qf = *reinterpret_cast<const float4*>(Qs + (ty + kTY * i) * LDQ + d);
#pragma unroll
      for (int n = 0; n < TN; ++n) {
        s[i][n] = fmaf(qf.x, kf[n].x, s[i][n]);
        s[i][n] = fmaf(qf.y, kf[n].y, s[i][n]);
        s[i][n] = fmaf(qf.z, kf[n].z, s[i][n]);
        s[i][n] = fmaf(qf.w, kf[n].w, s[i][n]);
      }
    }
  }
}

// P_ij (this thread's TM x TN of it) to shared memory, pitch LDP: P V needs whole rows of P.
template <typename Cfg>
__device__ __forceinline__ void store_p(float* Ps, const float (&s)[Cfg::TM][Cfg::TN], int tx,
                                        int ty) {
#pragma unroll
  for (int i = 0; i < Cfg::TM; ++i)
#pragma unroll
    for (int n = 0; n < Cfg::TN; ++n) Ps[(ty + kTY * i) * Cfg::LDP + tx + kTX * n] = s[i][n];
}

// O_i += P_ij V_j: per 4 keys, TM float4 of P (pf) and OC vectors of V per key (vf).
template <typename Cfg>
__device__ __forceinline__ void pv_tile(float (&o)[Cfg::TM][Cfg::OC * Cfg::VW],
                                        float4 (&pf)[Cfg::TM], float (&vf)[Cfg::OC][Cfg::VW],
                                        const float* Ps, const float* Vs, int tx, int ty) {
  constexpr int Bc = Cfg::Bc, TM = Cfg::TM, VW = Cfg::VW, OC = Cfg::OC;
  constexpr int LDQ = Cfg::LDQ, LDP = Cfg::LDP;
#pragma unroll 4
  for (int jc = 0; jc < Bc; jc += 4) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
      pf[i] = *reinterpret_cast<const float4*>(Ps + (ty + kTY * i) * LDP + jc);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int c = 0; c < OC; ++c) load_vec<VW>(vf[c], Vs + (jc + jj) * LDQ + (c * kTX + tx) * VW);
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const float pij = component(pf[i], jj);
#pragma unroll
        for (int c = 0; c < OC; ++c)
#pragma unroll
          for (int e = 0; e < VW; ++e) o[i][c * VW + e] = fmaf(pij, vf[c][e], o[i][c * VW + e]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Launch: kKernel is a version's kernel for Cfg, opted in to its shared memory once per device.
// One block per (query block, batch*head).

template <typename Cfg, auto kKernel>
void launch_tiles(const FusedParams& p, cudaStream_t stream) {
  course::opt_in_shared_memory<kKernel>(c10::cuda::current_device(), Cfg::kSmemBytes);
  const int64_t blocks = course::ceil_div<int64_t>(p.Sq, Cfg::Br) * p.B * p.H;
  TORCH_CHECK(blocks <= 0x7fffffff, "q: too many query blocks (B*H*ceil(Sq/", Cfg::Br,
              ")) for one grid");
  kKernel<<<static_cast<unsigned>(blocks), kThreads, Cfg::kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Versions 2-4 run one tile configuration per D: fused_fast.cu's default, except at D=64, where
// Br=128 spills (268 bytes of spill stores in version 4, ptxas -v, CUDA 13.0): Br=64 there,
// fused_fast.cu's variant 1. Calls launch(Cfg{}) with D's configuration.
template <typename Launch>
void with_version_tiles(int D, Launch&& launch) {
  switch (D) {
    // <D, Br, Bc, blocks per SM the registers are sized for>
    case 32: return launch(TileConfig<32, 64, 64, 2>{});
    case 64: return launch(TileConfig<64, 64, 64, 2>{});
    case 80: return launch(TileConfig<80, 64, 64, 2>{});
    case 96: return launch(TileConfig<96, 64, 64, 2>{});
    case 128: return launch(TileConfig<128, 64, 64, 1>{});
    default: TORCH_CHECK(false, "q: head dim D=", D, " has no instance in versions 1-4 (kVersionD)");
  }
}

}  // namespace
}  // namespace phase5
