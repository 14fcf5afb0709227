// GELU(x) = x * Phi(x), Phi the standard normal CDF (Hendrycks & Gimpel 2016), in two forms:
//   exact:  0.5 x (1 + erf(x / sqrt(2)))
//   tanh:   0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (GPT-2 / BERT's approximation)
// Shared by the elementwise kernel (gelu.cu) and the GEMM epilogue (linear.cu).
#pragma once

#include "types.h"

namespace phase6 {

__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kKappa = 0.044715f;
  // 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)): the same value without the cancellation of
  // 1 + tanh(u) for negative u, where GELU is tiny and must keep its relative accuracy.
  // For |x| beyond ~1e13 x^3 overflows to +-inf; exp gives inf or 0 and the result -0 or x.
  const float inner = kSqrt2OverPi * (x + kKappa * x * x * x);
  return x / (1.0f + expf(-2.0f * inner));
}

__device__ __forceinline__ float gelu_erf(float x) {
  constexpr float kRsqrt2 = 0.7071067811865476f;
  // 1 + erf(z) = erfc(-z), accurate where erf(z) is close to -1 (large negative x).
  return 0.5f * x * erfcf(-x * kRsqrt2);
}

template <Activation ACT>
__device__ __forceinline__ float activate(float x) {
  if constexpr (ACT == Activation::kGeluTanh) return gelu_tanh(x);
  else if constexpr (ACT == Activation::kGeluErf) return gelu_erf(x);
  else return x;
}

}  // namespace phase6
