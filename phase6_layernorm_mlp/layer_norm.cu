// LayerNorm forward (Ba, Kiros & Hinton 2016) over the last dimension, with an optional fused
// residual add:  s = x (+ r),  y = (s - mu) / sqrt(sigma^2 + eps) * gamma + beta,
// mu and sigma^2 the mean and (biased) variance of the row of `hidden` elements.
// Storage FP32, FP16 or BF16; all statistics and arithmetic in FP32.
//
// Versions (the launcher picks one per call; "chunk" = one 16-byte vector, or one element where
// the row or a pointer is not 16-byte aligned):
//   1. layer_norm_cached_kernel<.., kWarpPerRow = true>: one warp per row, the row held in
//      registers (up to 8 chunks per lane: hidden <= 1024 FP32 / 2048 FP16), warp-shuffle
//      reductions only, no shared memory and no __syncthreads. For small and medium hidden.
//   2. layer_norm_cached_kernel<.., kWarpPerRow = false>: one block per row (up to 512 threads,
//      4 or 8 chunks per thread in registers, hidden <= 16384 FP32 / 32768 FP16), block
//      reductions through shared memory. A warp per row would need 32+ registers of row per lane
//      from hidden 4096 on.
//   3. layer_norm_streaming_kernel: one block per row for rows too long for registers; reads the
//      row three times (the second and third reads come from L2). Any hidden size.
//
// Statistics: shifted two-pass. Every element is first shifted by the row's first element,
// d = (x - x[0]) + (r - r[0]) (each difference exact in FP32 when the row's values are within a
// factor 2 of each other, as with a large offset), then pass 1 sums d for mean_d, and pass 2 sums
// (d - mean_d)^2 from the registers; y = (d - mean_d) * rstd, since s - mu = d - mean_d. No step
// rounds a value of the size of the offset, so a row with mean 1e4 and standard deviation 0.1
// keeps full FP32 accuracy (README: two-pass vs Welford).
#include <cstdint>

#include "common.cuh"
#include "launchers.h"
#include "vec_io.cuh"

namespace phase6 {
namespace {

constexpr int kWarpRowsPerBlock = 4;       // version 1: 4 warps (rows) per 128-thread block
constexpr int kStreamingThreads = 512;     // version 3
constexpr int kMaxChunksPerLane = 8;       // register budget of versions 1 and 2
constexpr int kMaxBlockThreads = 512;      // version 2: 8 chunks of 8 halves = 64 floats of row
                                           // per thread need ~128 registers: 512 threads at most

// Sum over the team that owns a row: its warp (version 1) or its block (versions 2, 3).
template <bool kWarpPerRow>
__device__ __forceinline__ float team_sum(float v, float* scratch) {
  if constexpr (kWarpPerRow) return course::warp_reduce_sum(v);
  else return course::block_reduce_sum(v, scratch);
}

// One chunk of the row, shifted: d = (x - Kx) + (r - Kr), with Kx = x[0], Kr = r[0] of the row.
// Each difference is exact (or rounded relative to the spread, not the offset), so d carries no
// rounding error of the size of a large common offset, not even the rounding of x + r. With a
// residual the sum s = x + r is also written (rounded to T: it is the block's new residual stream).
template <typename T, int VEC>
__device__ __forceinline__ void load_shifted(const T* x, const T* r, T* sum, int64_t offset, float Kx,
                                             float Kr, float (&d)[VEC]) {
  float xv[VEC];
  load_vec<T, VEC>(x + offset, xv);
  if (r != nullptr) {
    float rv[VEC], s[VEC];
    load_vec<T, VEC>(r + offset, rv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      s[e] = xv[e] + rv[e];
      d[e] = (xv[e] - Kx) + (rv[e] - Kr);
    }
    if (sum != nullptr) store_vec<T, VEC>(sum + offset, s);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) d[e] = xv[e] - Kx;
  }
}

// y = (d - mean_d) * rstd * gamma + beta for one chunk, stored at offset (within the row: c0).
template <typename T, int VEC>
__device__ __forceinline__ void normalize_store(const float (&d)[VEC], float mean_d, float rstd,
                                                const T* gamma, const T* beta, T* y, int64_t offset,
                                                int64_t c0) {
  float out[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) out[e] = (d[e] - mean_d) * rstd;
  if (gamma != nullptr) {
    float g[VEC];
    load_vec<T, VEC>(gamma + c0, g);
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] *= g[e];
  }
  if (beta != nullptr) {
    float b[VEC];
    load_vec<T, VEC>(beta + c0, b);
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] += b[e];
  }
  store_vec<T, VEC>(y + offset, out);
}

// Versions 1 and 2: the row lives in registers, NV chunks of VEC elements per thread.
template <typename T, int VEC, int NV, bool kWarpPerRow>
__global__ void __launch_bounds__(kWarpPerRow ? kWarpRowsPerBlock * course::kWarpSize : kMaxBlockThreads)
layer_norm_cached_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                         const T* __restrict__ gamma, const T* __restrict__ beta,
                                         T* __restrict__ y, T* __restrict__ sum, int64_t rows,
                                         int64_t hidden, float eps) {
  static_assert(NV >= 1 && NV <= kMaxChunksPerLane, "NV chunks per thread must fit the register budget");
  __shared__ float scratch[course::kWarpSize];
  const int team = kWarpPerRow ? course::kWarpSize : blockDim.x;
  const int rank = kWarpPerRow ? threadIdx.x % course::kWarpSize : threadIdx.x;
  const int64_t row = kWarpPerRow
      ? static_cast<int64_t>(blockIdx.x) * (blockDim.x / course::kWarpSize) + threadIdx.x / course::kWarpSize
      : static_cast<int64_t>(blockIdx.x);
  if (row >= rows) return;  // uniform over the row's team (a whole warp, or the whole block)
  const int64_t base = row * hidden;
  const int64_t chunks = hidden / VEC;

  // BEGIN SOLUTION: Steps 1-3, this row's statistics with the row read once: its shift K, the shifted row d = s - K held in registers (load_shifted reads a chunk and writes the sum), the mean of d, then the variance of d from the registers, each summed over the row's team (team_sum), and rstd from the variance and eps. The placeholders below only keep the kernel compiling: replace them (README: LayerNorm, two-pass vs Welford)
  // STUB: float d[NV][VEC] = {};
  // STUB: const float mean_d = 0.0f, rstd = 0.0f;
  // Step 1: the shift K = (x[0], r[0]) of the row, the same values in every thread of the row.
  const float Kx = to_float(x[base]);
  const float Kr = residual != nullptr ? to_float(residual[base]) : 0.0f;

  // Step 2 (pass 1): load the row into registers as d = s - K; mean_d = sum(d) / hidden.
  float d[NV][VEC];
  float local = 0.0f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = rank + static_cast<int64_t>(i) * team;
    if (c < chunks) {
      load_shifted<T, VEC>(x, residual, sum, base + c * VEC, Kx, Kr, d[i]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) local += d[i][e];
    }
  }
  const float mean_d = team_sum<kWarpPerRow>(local, scratch) / static_cast<float>(hidden);

  // Step 3 (pass 2, registers only): sigma^2 = sum((d - mean_d)^2) / hidden, never negative.
  local = 0.0f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = rank + static_cast<int64_t>(i) * team;
    if (c < chunks) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float t = d[i][e] - mean_d;
        local += t * t;
      }
    }
  }
  const float rstd = rsqrtf(team_sum<kWarpPerRow>(local, scratch) / static_cast<float>(hidden) + eps);
  // END SOLUTION

  // Step 4: y = (d - mean_d) * rstd * gamma + beta  (s - mu = d - mean_d exactly as computed).
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = rank + static_cast<int64_t>(i) * team;
    if (c < chunks) normalize_store<T, VEC>(d[i], mean_d, rstd, gamma, beta, y, base + c * VEC, c * VEC);
  }
}

// Version 3: rows too long for registers. The same three steps, each streaming over the row.
template <typename T, int VEC>
__global__ void __launch_bounds__(kStreamingThreads)
layer_norm_streaming_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                            const T* __restrict__ gamma, const T* __restrict__ beta,
                            T* __restrict__ y, T* __restrict__ sum, int64_t hidden, float eps) {
  __shared__ float scratch[course::kWarpSize];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * hidden;
  const int64_t chunks = hidden / VEC;
  // BEGIN SOLUTION: the same statistics for a row too long for registers: the shift K, the mean of d = s - K in a first pass over the row (it writes the sum), the variance of d in a second pass that reads x and r again, each a block reduction, and rstd; pass 3 below normalizes. Replace the placeholders below (README: LayerNorm)
  // STUB: const float Kx = 0.0f, Kr = 0.0f, mean_d = 0.0f, rstd = 0.0f;
  const float Kx = to_float(x[base]);
  const float Kr = residual != nullptr ? to_float(residual[base]) : 0.0f;

  // Pass 1: mean of d = s - K (writes the sum s once).
  float local = 0.0f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float d[VEC];
    load_shifted<T, VEC>(x, residual, sum, base + c * VEC, Kx, Kr, d);
#pragma unroll
    for (int e = 0; e < VEC; ++e) local += d[e];
  }
  const float mean_d = course::block_reduce_sum(local, scratch) / static_cast<float>(hidden);

  // Pass 2: variance of d, re-reading x and r (not the rounded sum).
  local = 0.0f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float d[VEC];
    load_shifted<T, VEC>(x, residual, nullptr, base + c * VEC, Kx, Kr, d);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float t = d[e] - mean_d;
      local += t * t;
    }
  }
  const float rstd = rsqrtf(course::block_reduce_sum(local, scratch) / static_cast<float>(hidden) + eps);
  // END SOLUTION

  // Pass 3: normalize, scale, shift.
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float d[VEC];
    load_shifted<T, VEC>(x, residual, nullptr, base + c * VEC, Kx, Kr, d);
    normalize_store<T, VEC>(d, mean_d, rstd, gamma, beta, y, base + c * VEC, c * VEC);
  }
}

template <typename T, int VEC, int NV>
void launch_warp(const T* x, const T* r, const T* g, const T* b, T* y, T* s, int64_t rows,
                 int64_t hidden, float eps, cudaStream_t stream) {
  const int64_t blocks = course::ceil_div<int64_t>(rows, kWarpRowsPerBlock);
  layer_norm_cached_kernel<T, VEC, NV, true><<<static_cast<unsigned>(blocks), kWarpRowsPerBlock * course::kWarpSize, 0, stream>>>(
      x, r, g, b, y, s, rows, hidden, eps);
}

template <typename T, int VEC, int NV>
void launch_block(const T* x, const T* r, const T* g, const T* b, T* y, T* s, int64_t rows,
                  int64_t hidden, float eps, cudaStream_t stream) {
  const int64_t chunks = hidden / VEC;
  const int threads = static_cast<int>(course::ceil_div<int64_t>(course::ceil_div<int64_t>(chunks, NV),
                                                                 course::kWarpSize) * course::kWarpSize);
  layer_norm_cached_kernel<T, VEC, NV, false><<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, r, g, b, y, s, rows, hidden, eps);
}

// Pick the version and the chunk width for one call.
template <typename T, int VEC>
void launch_typed_vec(const T* x, const T* r, const T* g, const T* b, T* y, T* s, int64_t rows,
                      int64_t hidden, float eps, cudaStream_t stream) {
  const int64_t chunks = hidden / VEC;
  const int64_t warp = course::kWarpSize;
  if (chunks <= 1 * warp) launch_warp<T, VEC, 1>(x, r, g, b, y, s, rows, hidden, eps, stream);
  else if (chunks <= 2 * warp) launch_warp<T, VEC, 2>(x, r, g, b, y, s, rows, hidden, eps, stream);
  else if (chunks <= 4 * warp) launch_warp<T, VEC, 4>(x, r, g, b, y, s, rows, hidden, eps, stream);
  else if (chunks <= 8 * warp) launch_warp<T, VEC, 8>(x, r, g, b, y, s, rows, hidden, eps, stream);
  else if (chunks <= 4 * 256) launch_block<T, VEC, 4>(x, r, g, b, y, s, rows, hidden, eps, stream);
  else if (chunks <= 8 * kMaxBlockThreads) launch_block<T, VEC, 8>(x, r, g, b, y, s, rows, hidden, eps, stream);
  else
    layer_norm_streaming_kernel<T, VEC><<<static_cast<unsigned>(rows), kStreamingThreads, 0, stream>>>(x, r, g, b, y, s, hidden, eps);
}

template <typename T>
void launch_typed(const void* x, const void* r, const void* g, const void* b, void* y, void* s,
                  int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  // 16-byte vectors only where every row starts aligned and every pointer is aligned.
  const bool vec = hidden % kVec16<T> == 0 && aligned16(x) && aligned16(y) &&
                   (r == nullptr || (aligned16(r) && aligned16(s))) && (g == nullptr || aligned16(g)) &&
                   (b == nullptr || aligned16(b));
  const T* xt = static_cast<const T*>(x);
  const T* rt = static_cast<const T*>(r);
  const T* gt = static_cast<const T*>(g);
  const T* bt = static_cast<const T*>(b);
  T* yt = static_cast<T*>(y);
  T* st = static_cast<T*>(s);
  if (vec) launch_typed_vec<T, kVec16<T>>(xt, rt, gt, bt, yt, st, rows, hidden, eps, stream);
  else launch_typed_vec<T, 1>(xt, rt, gt, bt, yt, st, rows, hidden, eps, stream);
}

}  // namespace

void launch_layer_norm(DType dtype, const void* x, const void* residual, const void* gamma,
                       const void* beta, void* y, void* sum, int64_t rows, int64_t hidden,
                       float eps, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      launch_typed<float>(x, residual, gamma, beta, y, sum, rows, hidden, eps, stream);
      break;
    case DType::kFloat16:
      launch_typed<__half>(x, residual, gamma, beta, y, sum, rows, hidden, eps, stream);
      break;
    case DType::kBFloat16:
      launch_typed<__nv_bfloat16>(x, residual, gamma, beta, y, sum, rows, hidden, eps, stream);
      break;
  }
}

}  // namespace phase6
