// The tensor-core building blocks of the FP16/BF16 fused attention kernel (tc_attention.cu), each a
// thin wrapper over one PTX instruction of sm_80+ so the kernel reads like the algorithm
// (its cp.async copies come from utils/csrc/cp_async.cuh):
//   ldmatrix.x4 (.trans)  four 8x8 b16 matrices from shared memory into mma fragments
//   mma.sync m16n8k16     D[16x8] += A[16x16] * B[16x8], A/B in FP16 or BF16, C/D in FP32
// and the XOR swizzle that makes every ldmatrix and every 16-byte shared store bank-conflict free,
// with the ldmatrix lane addresses into a swizzled tile.
// Fragment layouts are drawn in README.md.
#pragma once

#include <cstdint>
#include <cstring>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tc {

// ------------------------------------------------------------------------------------------------
// Shared-memory addressing

// A tile row of D b16 elements is kChunks = D/8 chunks of 16 bytes; shared memory has 8 groups of
// 4 banks (16 bytes each). ldmatrix reads one chunk from each of 8 consecutive rows; unswizzled, a
// row pitch that is a multiple of 128 bytes puts all 8 in the same bank group (8-way conflict).
// Storing logical chunk c of row r at chunk swizzle(r, c) spreads those 8 chunks over 8 groups:
//   kChunks % 8 == 0 (D = 64, 128, 192, 256): c ^ (r % 8)        -> group (c ^ r) % 8, distinct over 8 rows
//   kChunks % 8 == 4 (D = 32, 96, 160, 224):  c ^ ((r / 2) % 4)  -> group 4 (r % 2) + (c ^ r/2) % 4, distinct
// Both stay inside the row (XOR only touches the low 3 or 2 bits of c).
template <int kChunks>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(kChunks % 4 == 0, "rows must be a multiple of 64 bytes (D % 32 == 0) to swizzle");
  if constexpr (kChunks % 8 == 0) {
    return chunk ^ (row & 7);
  } else {
    return chunk ^ ((row >> 1) & 3);
  }
}

// The ldmatrix.x4 of the tensor-core kernels use one lane pattern (K in S = Q K^T the second one,
// below it): lane l gives the address of row R + l % 16, chunk C + l / 16 of a swizzled [rows][Dp]
// tile, so the four 8x8 matrices are (rows R..R+7 | R+8..R+15) x (chunk C | C+1). R (a multiple
// of 16) and C (even) are constants once the loops are unrolled. With lane_base = the tile's address
// of the lane's own (l % 16, l / 16) element and G = the swizzle group (8 or 4 chunks), the swizzled
// address is
//   (lane_base ^ (C % G) * 16) + (C / G) * G * 16 + R * Dp * 2
// because tiles and rows are multiples of G * 16 bytes: one XOR with a constant per ldmatrix, and
// one register per tile instead of one per unrolled ldmatrix.
template <int Dp>
__device__ __forceinline__ uint32_t lane_tile_offset(int lane) {
  const int row = lane & 15;
  const int chunk = lane >> 4;
  return static_cast<uint32_t>((row * Dp + swizzle<Dp / 8>(row, chunk) * 8) * 2);
}

// A second pattern for a B operand stored [n][k] (K in S = Q K^T): lane l gives row
// R + l % 8 + 8 (l / 16), chunk C + (l / 8) % 2, so the four matrices are (rows R..R+7, chunk C),
// (R..R+7, C+1), (R+8..R+15, C), (R+8.., C+1): b0, b1 of the n8 tile of rows R..R+7, then b0, b1 of
// the tile of rows R+8..R+15, each pair in consecutive registers as mma.sync takes it. (The first
// pattern gives b0, b0, b1, b1, and the compiler adds a register move per operand register to pair
// them.) ldsm_addr applies to both: the lane's row stays below 16 and its chunk is 0 or 1.
template <int Dp>
__device__ __forceinline__ uint32_t lane_tile_offset_b(int lane) {
  const int row = (lane & 7) + ((lane >> 4) << 3);
  const int chunk = (lane >> 3) & 1;
  return static_cast<uint32_t>((row * Dp + swizzle<Dp / 8>(row, chunk) * 8) * 2);
}

template <int Dp>
__device__ __forceinline__ uint32_t ldsm_addr(uint32_t lane_base, int R, int C) {
  constexpr int kGroup = (Dp / 8) % 8 == 0 ? 8 : 4;
  return (lane_base ^ static_cast<uint32_t>((C % kGroup) * 16)) +
         static_cast<uint32_t>((C / kGroup) * kGroup * 16 + R * Dp * 2);
}

// ------------------------------------------------------------------------------------------------
// ldmatrix: lanes 8m..8m+7 give the row addresses of matrix m; register m of lane l receives
// matrix m's elements (row l/4, cols 2(l%4), 2(l%4)+1), or with .trans (rows 2(l%4), 2(l%4)+1, col l/4).

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ------------------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col, FP32 accumulate. With g = lane / 4 and t = lane % 4:
//   A (16x16): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B (16x8):  b0 (k 2t..2t+1, n g)              b1 (k 2t+8..2t+9, n g)
//   C (16x8):  c0 c1 (g, 2t..2t+1)               c2 c3 (g+8, 2t..2t+1)

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------------------------------------------
// Conversions

// Two floats rounded to T and packed as one 32-bit register: `lo` in the low half (the lower
// column, as in every fragment above).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

// 2^x on the special-function unit (about 2 ulp; 2^-inf = +0), what the softmax exponentials use.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace tc
