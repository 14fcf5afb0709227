// Micro-kernels for the Roofline's ceilings:
//   ffma_peak    the FP32 FFMA peak: each thread runs kChains independent multiply-add chains so the
//                FMA pipes never wait on a previous result;
//   l2_read      L2 bandwidth: every block reads a buffer that fits in L2 again and again (16-byte
//                loads that skip L1), so after the first pass every byte comes from L2;
//   smem_read    shared-memory (L1) bandwidth: each warp reads conflict-free 16-byte words of its
//                block's shared array in a loop.
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

__global__ void l2_read_kernel(const float4* __restrict__ buffer, int64_t n, int64_t passes, float* out) {
  constexpr int kInFlight = 4;  // independent loads per thread in flight
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t pass = 0; pass < passes; ++pass) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += kInFlight * stride) {
      float4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)  // cache-global loads: from L2, never L1
        v[u] = i + u * stride < n ? __ldcg(buffer + i + u * stride) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) { acc.x += v[u].x; acc.y += v[u].y; acc.z += v[u].z; acc.w += v[u].w; }
    }
  }
  const float total = acc.x + acc.y + acc.z + acc.w;
  if (total == 1.2345f) out[0] = total;
}

// Reads `passes` times a float32 buffer (a multiple of 4 elements, smaller than L2).
void l2_read(at::Tensor buffer, at::Tensor scratch, int64_t blocks, int64_t threads, int64_t passes) {
  TORCH_CHECK(buffer.is_cuda() && buffer.scalar_type() == at::kFloat && buffer.numel() % 4 == 0,
              "buffer must be CUDA float32 with a multiple of 4 elements");
  l2_read_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const float4*>(buffer.data_ptr<float>()), buffer.numel() / 4, passes,
      scratch.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

constexpr int kSmemThreads = 256;

__global__ void smem_read_kernel(int64_t iterations, float* out) {
  __shared__ float4 words[kSmemThreads];
  words[threadIdx.x] = make_float4(threadIdx.x, 1.f, 2.f, 3.f);
  __syncthreads();
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  int index = threadIdx.x;
  for (int64_t it = 0; it < iterations; ++it) {
    // Consecutive lanes read consecutive 16-byte words: four conflict-free wavefronts per warp.
    const float4 v = words[index];
    acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    index = (index + 32) & (kSmemThreads - 1);
  }
  const float total = acc.x + acc.y + acc.z + acc.w;
  if (total == 1.2345f) out[blockIdx.x] = total;
}

// blocks x 256 threads, each reading iterations 16-byte words from shared memory.
void smem_read(at::Tensor scratch, int64_t blocks, int64_t iterations) {
  TORCH_CHECK(scratch.is_cuda() && scratch.numel() >= blocks, "scratch must be CUDA with blocks elements");
  smem_read_kernel<<<blocks, kSmemThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(iterations,
                                                                                 scratch.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(course_ceilings, m) {
  m.def("ffma_peak(Tensor(a!) scratch, int blocks, int threads, int iterations) -> ()");
  m.def("l2_read(Tensor buffer, Tensor(a!) scratch, int blocks, int threads, int passes) -> ()");
  m.def("smem_read(Tensor(a!) scratch, int blocks, int iterations) -> ()");
}

TORCH_LIBRARY_IMPL(course_ceilings, CUDA, m) {
  m.impl("ffma_peak", &ffma_peak);
  m.impl("l2_read", &l2_read);
  m.impl("smem_read", &smem_read);
}
