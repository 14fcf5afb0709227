// FP32 products on tensor cores: the 3xTF32 split (sm_80+), what version 6 of phase 5's FP32 fused
// kernel (fused_v6_tf32x3.cu) builds its two matmuls from, and phase 6's 3xTF32 GEMM
// (linear_tf32x3.cu) its one.
//
// A TF32 tensor-core MMA reads 19 bits of each FP32 operand (sign, 8 exponent bits, 10 mantissa
// bits): one product alone keeps about 11 significant bits, far from FP32's 24. Splitting each
// operand in two TF32 numbers,
//   x = big(x) + small(x),  big(x) = x rounded to TF32,  small(x) = x - big(x) (which the MMA truncates),
// keeps about 21 bits, and a * b = big(a) big(b) + big(a) small(b) + small(a) big(b) + small(a) small(b),
// where the last term is below 2^-22 of the product and is dropped: three TF32 MMAs per product,
// accumulated in FP32. This is how PyTorch's memory-efficient attention (sdpa_efficient) runs FP32
// inputs.
#pragma once

#include <cstdint>

namespace course {

// x = big + small as two 32-bit patterns that the MMA reads as TF32 (its top 19 bits; the low 13 are
// ignored). big is x rounded to TF32: half a TF32 ulp added to the bits, the low 13 cleared (ties
// away from zero; a carry into the exponent is the right rounding). small is the exact rest
// x - big (|small| <= 2^-11 |x|), which the MMA truncates: an error below 2^-21 |x|. Three
// instructions (IADD, LOP3, FADD), where cvt.rna.tf32.f32 alone compiles to four on sm_90. Phase 5's
// attention kernel issues one split per operand element it loads, so their count sets its speed: rounding
// small as well (a fourth instruction) changed the output error by nothing measurable and cost 7%
// at D=128 (measured). An inf or NaN input makes small NaN, and the output NaN, as in FP32.
struct Tf32Split {
  uint32_t big, small;
};

// In PTX (volatile, so that the compiler keeps each split next to its MMAs instead of hoisting all
// of a tile's splits ahead of them, which cost registers and spilled).
__device__ __forceinline__ Tf32Split split_tf32(float x) {
  Tf32Split r;
  asm volatile(
      "{\n"
      "  .reg .f32 big_f, small_f;\n"
      "  mov.b32 %0, %2;\n"
      "  add.u32 %0, %0, 0x1000;\n"          // + half a TF32 ulp
      "  and.b32 %0, %0, 0xffffe000;\n"      // keep the TF32 bits
      "  mov.b32 big_f, %0;\n"
      "  sub.f32 small_f, %2, big_f;\n"      // the exact rest
      "  mov.b32 %1, small_f;\n"
      "}\n"
      : "=&r"(r.big), "=r"(r.small)
      : "f"(x));
  return r;
}

// mma.sync.aligned.m16n8k8.row.col, TF32 operands, FP32 accumulate. With g = lane / 4, t = lane % 4:
//   A (16x8): a0 (g, t)  a1 (g+8, t)  a2 (g, t+4)  a3 (g+8, t+4)
//   B (8x8):  b0 (k t, n g)           b1 (k t+4, n g)
//   C (16x8): c0 c1 (g, 2t..2t+1)     c2 c3 (g+8, 2t..2t+1)
__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b in 3xTF32: the two small cross terms first, the big product last (the smallest terms
// are added while the accumulator is smallest).
__device__ __forceinline__ void mma_1688_3xtf32(float (&d)[4], const uint32_t (&a_big)[4],
                                                const uint32_t (&a_small)[4], Tf32Split b0, Tf32Split b1) {
  mma_1688_tf32(d, a_small, b0.big, b1.big);
  mma_1688_tf32(d, a_big, b0.small, b1.small);
  mma_1688_tf32(d, a_big, b0.big, b1.big);
}

// The same sum with the two cross terms in an accumulator of their own, d_cross: three MMA chains
// that do not wait for each other's results, where one accumulator makes every MMA wait for the
// one before. The caller adds d + d_cross.
__device__ __forceinline__ void mma_1688_3xtf32(float (&d)[4], float (&d_cross)[4], const uint32_t (&a_big)[4],
                                                const uint32_t (&a_small)[4], Tf32Split b0, Tf32Split b1) {
  mma_1688_tf32(d_cross, a_small, b0.big, b1.big);
  mma_1688_tf32(d_cross, a_big, b0.small, b1.small);
  mma_1688_tf32(d, a_big, b0.big, b1.big);
}

// The A operand of one m16n8k8 step, split: a[e] = big + small for the four elements of the step.
__device__ __forceinline__ void split_fragment(const float (&a)[4], uint32_t (&big)[4], uint32_t (&small)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const Tf32Split x = split_tf32(a[e]);
    big[e] = x.big;
    small[e] = x.small;
  }
}

}  // namespace course
