// How every version is launched: the (query tile, head, batch) grid, the shared-memory opt-in, and
// the dispatch from the op's run-time dtype and head dim to the compiled kernels.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "hopper_kernel.cuh"
#include "shared_memory_opt_in.h"

namespace hopper {

// One CTA per tile: Tile::kBM query rows of each (head, batch).
template <class Tile>
dim3 tile_grid(const Params& p) {
  return dim3((p.Sq + Tile::kBM - 1) / Tile::kBM, p.H, p.B);
}

// The tiles of tile_grid, for the kernels that schedule them themselves (v6, v7).
template <class Tile>
int64_t tile_count(const Params& p) {
  const dim3 grid = tile_grid<Tile>(p);
  return static_cast<int64_t>(grid.x) * grid.y * grid.z;
}

// Launch kKernel on `grid` with kThreads threads and kSmem bytes of dynamic shared memory per CTA.
template <void (*kKernel)(Params), int kSmem, int kThreads>
void launch_on_grid(const Params& p, dim3 grid, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  course::opt_in_shared_memory<kKernel>(device, kSmem);
  kKernel<<<grid, kThreads, kSmem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launch kKernel with one CTA per tile (v1-v5).
template <void (*kKernel)(Params), int kSmem, int kThreads, class Tile>
void launch_kernel(const Params& p, cudaStream_t stream) {
  launch_on_grid<kKernel, kSmem, kThreads>(p, tile_grid<Tile>(p), stream);
}

template <typename T>
struct TypeTag {
  using type = T;
};

// launch(TypeTag<T>{}, std::integral_constant<int, D>{}) for the element type and head dim given at
// run time (supported_head_dim).
template <typename Launch>
void dispatch(int D, Dtype dtype, Launch&& launch) {
  TORCH_CHECK(supported_head_dim(D), "head dim D=", D, " (q.size(3)) is not supported: use 64 or 128");
  const bool bf16 = dtype == Dtype::kBFloat16;
  if (D == 64) {
    bf16 ? launch(TypeTag<__nv_bfloat16>{}, std::integral_constant<int, 64>{})
         : launch(TypeTag<__half>{}, std::integral_constant<int, 64>{});
  } else {
    bf16 ? launch(TypeTag<__nv_bfloat16>{}, std::integral_constant<int, 128>{})
         : launch(TypeTag<__half>{}, std::integral_constant<int, 128>{});
  }
}

}  // namespace hopper
