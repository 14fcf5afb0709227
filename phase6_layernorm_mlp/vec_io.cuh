// Phase 6 device helpers: dtype tags shared with ops.cpp, float <-> storage conversions, and
// 16-byte vector loads/stores (float4 for FP32, 8 halves for FP16/BF16) with a scalar fallback.
#pragma once

#include <cstdint>
#include <type_traits>
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

// VEC consecutive elements as loaded, not yet converted: one 16-byte vector (VEC == kVec16<T>) or
// one element (VEC == 1). Holding a chunk costs VEC * sizeof(T) bytes of registers, not VEC floats.
template <typename T, int VEC>
struct Chunk {
  static_assert(VEC == 1 || VEC == kVec16<T>, "VEC must be 1 (scalar) or one 16-byte vector");
  std::conditional_t<VEC == 1, T, uint4> raw;
};

// Load p[0..VEC) as one chunk: a 16-byte load (p 16-byte aligned) or a scalar load.
template <typename T, int VEC>
__device__ __forceinline__ Chunk<T, VEC> load_chunk(const T* p) {
  if constexpr (VEC == 1) return {p[0]};
  else return {*reinterpret_cast<const uint4*>(p)};
}

// A chunk's elements as floats.
template <typename T, int VEC>
__device__ __forceinline__ void to_floats(const Chunk<T, VEC>& c, float (&v)[VEC]) {
  const T* e = reinterpret_cast<const T*>(&c.raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = to_float(e[i]);
}

// Load VEC consecutive elements p[0..VEC) as floats (load_chunk, then to_floats).
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[VEC]) {
  to_floats<T, VEC>(load_chunk<T, VEC>(p), v);
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

// Store VEC floats to p[0..VEC): in 16-byte stores where VEC is a multiple of 4 (p 16-byte
// aligned), else one by one. A warp storing each lane's VEC floats one element at a time writes one
// 4-byte piece into each of 32 sectors per store, VEC times over; in 16-byte pieces it writes each
// sector in VEC / 4 stores at most. __stcg (st.global.cg.v4: kept in L2, not L1) because a plain
// float4 store may be split back into scalar stores by the compiler, and the values are read next
// by another kernel.
template <int VEC>
__device__ __forceinline__ void store_floats(float* p, const float (&v)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) __stcg(reinterpret_cast<float4*>(p + i), make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = v[i];
  }
}

__host__ __device__ inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace phase6
