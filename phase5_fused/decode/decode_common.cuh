// Device helpers both decoding kernels share: FP32 <-> storage-type conversions, vector loads and
// stores, and the base-2 constants (the kernels keep scores and logsumexps in base 2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace phase5_decode {

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x * log2(e))
constexpr float kLn2 = 0.6931471805599453f;    // ln(x) = log2(x) * ln(2)

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

// kN consecutive elements at src as FP32, read with one 8-byte load or with 16-byte loads (src
// aligned to the load, kN * sizeof(T) = 8 or a multiple of 16).
template <int kN, typename T>
__device__ __forceinline__ void load_as_float(const T* src, float (&dst)[kN]) {
  constexpr int kBytes = kN * static_cast<int>(sizeof(T));
  static_assert(kBytes == 8 || kBytes % 16 == 0, "whole 8- or 16-byte loads");
  if constexpr (kBytes == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kN; ++i) dst[i] = to_float(e[i]);
  } else {
    constexpr int kPerLoad = 16 / sizeof(T);
#pragma unroll
    for (int w = 0; w < kN / kPerLoad; ++w) {
      const uint4 raw = reinterpret_cast<const uint4*>(src)[w];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPerLoad; ++i) dst[w * kPerLoad + i] = to_float(e[i]);
    }
  }
}

// kN FP32 values stored as T at dst, with one 8-byte store or with 16-byte stores (same rules).
template <int kN, typename T>
__device__ __forceinline__ void store_from_float(T* dst, const float (&src)[kN]) {
  constexpr int kBytes = kN * static_cast<int>(sizeof(T));
  static_assert(kBytes == 8 || kBytes % 16 == 0, "whole 8- or 16-byte stores");
  if constexpr (kBytes == 8) {
    uint2 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kN; ++i) e[i] = from_float<T>(src[i]);
    *reinterpret_cast<uint2*>(dst) = raw;
  } else {
    constexpr int kPerStore = 16 / sizeof(T);
#pragma unroll
    for (int w = 0; w < kN / kPerStore; ++w) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPerStore; ++i) e[i] = from_float<T>(src[w * kPerStore + i]);
      reinterpret_cast<uint4*>(dst)[w] = raw;
    }
  }
}

}  // namespace phase5_decode
