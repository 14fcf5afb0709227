// Phase 6 device helpers: dtype tags shared with ops.cpp, float <-> storage conversions, and
// 16-byte vector loads/stores (float4 for FP32, 8 halves for FP16/BF16) with a scalar fallback.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "types.h"

namespace phase6 {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Elements of T in one 16-byte vector: 4 floats or 8 halves.
template <typename T>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// Load VEC consecutive elements p[0..VEC) as floats. With VEC == kVec16<T> it is one 16-byte
// load, so p must be 16-byte aligned; with VEC == 1 it is a plain scalar load.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[VEC]) {
  static_assert(VEC == 1 || VEC == kVec16<T>, "VEC must be 1 (scalar) or one 16-byte vector");
  if constexpr (VEC == 1) {
    v[0] = to_float(p[0]);
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_float(e[i]);
  }
}

// Store VEC floats to p[0..VEC) as T (one 16-byte store when VEC == kVec16<T>).
template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[VEC]) {
  static_assert(VEC == 1 || VEC == kVec16<T>, "VEC must be 1 (scalar) or one 16-byte vector");
  if constexpr (VEC == 1) {
    p[0] = from_float<T>(v[0]);
  } else {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) e[i] = from_float<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
}

__host__ __device__ inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace phase6
