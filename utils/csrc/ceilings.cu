// Micro-kernel for the Roofline's compute ceiling: the FP32 FFMA peak. Each thread runs kChains
// independent multiply-add chains so the FMA pipes never wait on a previous result.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include "common.cuh"

namespace {

constexpr int kChains = 8;

__global__ void ffma_chains_kernel(float* out, float a, float b, int64_t iterations) {
  float acc[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) acc[c] = threadIdx.x * 1e-3f + c;
#pragma unroll 8
  for (int64_t it = 0; it < iterations; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) acc[c] = fmaf(acc[c], a, b);
  }
  float total = 0.0f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) total += acc[c];
  // Written only when impossible in practice, so the compiler cannot drop the chains.
  if (total == 1.2345f) out[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

// Runs blocks x threads threads, each doing iterations * kChains FFMAs (2 FLOP each).
void ffma_peak(at::Tensor scratch, int64_t blocks, int64_t threads, int64_t iterations) {
  TORCH_CHECK(scratch.is_cuda() && scratch.scalar_type() == at::kFloat, "scratch must be CUDA float32");
  TORCH_CHECK(scratch.numel() >= blocks * threads, "scratch must hold blocks * threads floats");
  ffma_chains_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      scratch.data_ptr<float>(), 0.999f, 1e-4f, iterations);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(course_ceilings, m) {
  m.def("ffma_peak(Tensor(a!) scratch, int blocks, int threads, int iterations) -> ()");
}

TORCH_LIBRARY_IMPL(course_ceilings, CUDA, m) { m.impl("ffma_peak", &ffma_peak); }
