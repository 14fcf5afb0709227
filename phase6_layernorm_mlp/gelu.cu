// GELU as its own elementwise kernel (the unfused baseline: one read and one write of the
// activation). The fused path applies the same gelu.cuh functions in the GEMM epilogue (linear.cu).
//
// Versions:
//   1. gelu_kernel<T, VEC = 16-byte vector>: float4 / 8-half loads and stores, grid-stride loop,
//      the n % VEC tail done with scalars by the first threads. Pointers 16-byte aligned.
//   2. gelu_kernel<T, VEC = 1>: scalar loads, for pointers that are not 16-byte aligned.
// gelu_backward_kernel: dx = dy * GELU'(x) (gelu.cuh's derivatives), in the same two versions.
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "gelu.cuh"
#include "launchers.h"
#include "vec_io.cuh"

namespace phase6 {
namespace {

constexpr int kThreads = 256;

template <typename T, int VEC, Activation ACT>
__global__ void __launch_bounds__(kThreads)
gelu_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  const int64_t vectors = n / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Whole vectors: load VEC elements, apply GELU in FP32, store VEC elements.
  for (int64_t i = first; i < vectors; i += stride) {
    float v[VEC];
    load_vec<T, VEC>(x + i * VEC, v);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = activate<ACT>(v[e]);
    store_vec<T, VEC>(y + i * VEC, v);
  }
  // Tail: the last n % VEC elements, one per thread.
  const int64_t tail = vectors * VEC + first;
  if (tail < n) y[tail] = from_float<T>(activate<ACT>(to_float(x[tail])));
}

// Backward: dx = dy * GELU'(x), the same vector body and scalar tail.
template <typename T, int VEC, Activation ACT>
__global__ void __launch_bounds__(kThreads)
gelu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, int64_t n) {
  const int64_t vectors = n / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < vectors; i += stride) {
    float g[VEC], v[VEC];
    load_vec<T, VEC>(dy + i * VEC, g);
    load_vec<T, VEC>(x + i * VEC, v);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = g[e] * activate_grad<ACT>(v[e]);
    store_vec<T, VEC>(dx + i * VEC, v);
  }
  const int64_t tail = vectors * VEC + first;
  if (tail < n) dx[tail] = from_float<T>(to_float(dy[tail]) * activate_grad<ACT>(to_float(x[tail])));
}

// Blocks for n elements in vectors of VEC: enough to fill the GPU several times over; the
// grid-stride loop does the rest.
int64_t grid_blocks(int64_t n, int vec) {
  constexpr int64_t kMaxBlocks = 132 * 32;
  return std::min(kMaxBlocks, std::max<int64_t>(1, course::ceil_div<int64_t>(n / vec, kThreads)));
}

template <typename T, Activation ACT>
void launch_backward_act(const void* dy, const void* x, void* dx, int64_t n, cudaStream_t stream) {
  const T* dyt = static_cast<const T*>(dy);
  const T* xt = static_cast<const T*>(x);
  T* dxt = static_cast<T*>(dx);
  if (aligned16(dy) && aligned16(x) && aligned16(dx)) {
    gelu_backward_kernel<T, kVec16<T>, ACT><<<static_cast<unsigned>(grid_blocks(n, kVec16<T>)), kThreads, 0, stream>>>(
        dyt, xt, dxt, n);
  } else {
    gelu_backward_kernel<T, 1, ACT><<<static_cast<unsigned>(grid_blocks(n, 1)), kThreads, 0, stream>>>(dyt, xt, dxt, n);
  }
}

template <typename T>
void launch_backward_typed(const void* dy, const void* x, void* dx, int64_t n, Activation act, cudaStream_t stream) {
  if (act == Activation::kGeluTanh) launch_backward_act<T, Activation::kGeluTanh>(dy, x, dx, n, stream);
  else launch_backward_act<T, Activation::kGeluErf>(dy, x, dx, n, stream);
}

template <typename T, Activation ACT>
void launch_act(const void* x, void* y, int64_t n, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  T* yt = static_cast<T*>(y);
  if (aligned16(x) && aligned16(y)) {
    gelu_kernel<T, kVec16<T>, ACT><<<static_cast<unsigned>(grid_blocks(n, kVec16<T>)), kThreads, 0, stream>>>(xt, yt, n);
  } else {
    gelu_kernel<T, 1, ACT><<<static_cast<unsigned>(grid_blocks(n, 1)), kThreads, 0, stream>>>(xt, yt, n);
  }
}

template <typename T>
void launch_typed(const void* x, void* y, int64_t n, Activation act, cudaStream_t stream) {
  if (act == Activation::kGeluTanh) launch_act<T, Activation::kGeluTanh>(x, y, n, stream);
  else launch_act<T, Activation::kGeluErf>(x, y, n, stream);
}

}  // namespace

void launch_gelu_backward(DType dtype, const void* dy, const void* x, void* dx, int64_t n, Activation act,
                          cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: launch_backward_typed<float>(dy, x, dx, n, act, stream); break;
    case DType::kFloat16: launch_backward_typed<__half>(dy, x, dx, n, act, stream); break;
    case DType::kBFloat16: launch_backward_typed<__nv_bfloat16>(dy, x, dx, n, act, stream); break;
  }
}

void launch_gelu(DType dtype, const void* x, void* y, int64_t n, Activation act, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: launch_typed<float>(x, y, n, act, stream); break;
    case DType::kFloat16: launch_typed<__half>(x, y, n, act, stream); break;
    case DType::kBFloat16: launch_typed<__nv_bfloat16>(x, y, n, act, stream); break;
  }
}

}  // namespace phase6
