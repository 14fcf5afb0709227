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

// The derivatives, for the backward (gelu.cu's gelu_backward_kernel):
//   tanh:   with s = sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), GELU = x s, so
//           GELU' = s + x * 2 s (1 - s) * sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//   exact:  GELU' = Phi(x) + x phi(x),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
// Neither form subtracts two values of the size of the result, so both keep their relative
// accuracy in the negative tail, where GELU' is tiny.
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kKappa = 0.044715f;
  const float x2 = x * x;
  const float s = 1.0f / (1.0f + expf(-2.0f * kSqrt2OverPi * (x + kKappa * x2 * x)));
  const float ds_du = 2.0f * s * (1.0f - s);
  // Once s is exactly 0 or 1 (|x| > ~10), the second term is 0; skipping it also avoids
  // 0 * inf = NaN where x^2 overflows (|x| > ~1e19).
  return ds_du == 0.0f ? s : s + x * ds_du * kSqrt2OverPi * (1.0f + 3.0f * kKappa * x2);
}

__device__ __forceinline__ float gelu_erf_grad(float x) {
  constexpr float kRsqrt2 = 0.7071067811865476f;
  constexpr float kRsqrt2Pi = 0.3989422804014327f;
  // exp(-x^2/2) is 0 for |x| > ~14, and x * 0 = 0 for every finite x.
  return 0.5f * erfcf(-x * kRsqrt2) + x * kRsqrt2Pi * expf(-0.5f * x * x);
}

template <Activation ACT>
__device__ __forceinline__ float activate_grad(float x) {
  if constexpr (ACT == Activation::kGeluTanh) return gelu_tanh_grad(x);
  else if constexpr (ACT == Activation::kGeluErf) return gelu_erf_grad(x);
  else return 1.0f;
}

template <Activation ACT>
__device__ __forceinline__ float activate(float x) {
  if constexpr (ACT == Activation::kGeluTanh) return gelu_tanh(x);
  else if constexpr (ACT == Activation::kGeluErf) return gelu_erf(x);
  else return x;
}

}  // namespace phase6
