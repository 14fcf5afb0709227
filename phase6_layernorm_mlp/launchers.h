// Host entry points of the phase's kernels (defined in the .cu files, called by ops.cpp).
// Pointers are raw device pointers of contiguous tensors; nullptr means "absent" for the optional
// ones. Every launcher enqueues on `stream` and returns; the caller checks the launch.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "types.h"

namespace phase6 {

// The current device's SM count: the launchers size their grids by it.
inline int sm_count() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 1 ? sms : 1;
}

// y = LN(x (+ residual)) * gamma + beta over rows of `hidden` elements; with residual, the sum
// x + residual is also written to `sum`. gamma and beta may be nullptr.
void launch_layer_norm(DType dtype, const void* x, const void* residual, const void* gamma,
                       const void* beta, void* y, void* sum, int64_t rows, int64_t hidden,
                       float eps, cudaStream_t stream);

// y = gelu(x) elementwise over n elements.
void launch_gelu(DType dtype, const void* x, void* y, int64_t n, Activation act, cudaStream_t stream);

// dx = dy * gelu'(x) elementwise over n elements.
void launch_gelu_backward(DType dtype, const void* dy, const void* x, void* dx, int64_t n, Activation act,
                          cudaStream_t stream);

// LayerNorm backward (layer_norm_backward.cu), s the LayerNorm's input (x, or add_layer_norm's sum):
// ds = dLN/ds^T dy (+ dsum), and with dgamma / dbeta ([hidden], s's dtype; both nullptr for none)
// the parameter gradients, through partial_dgamma / partial_dbeta (FP32 [partial_rows, hidden]
// scratch: one row of column sums of dy * xhat and dy per block; nullptr with dgamma). gamma and
// dsum may be nullptr. layer_norm_backward_partial_rows gives the partial_rows the launch will use
// for these arguments, so that the caller sizes the scratch.
int64_t layer_norm_backward_partial_rows(DType dtype, const void* dy, const void* s, const void* gamma,
                                         const void* dsum, const void* ds, int64_t rows, int64_t hidden);
void launch_layer_norm_backward(DType dtype, const void* dy, const void* s, const void* gamma, const void* dsum,
                                void* ds, float* partial_dgamma, float* partial_dbeta, int64_t partial_rows,
                                void* dgamma, void* dbeta, int64_t rows, int64_t hidden, float eps,
                                cudaStream_t stream);

// C[M, N] = act(A[M, K] W[N, K]^T + bias[N]) + residual[M, N], FP32 (bias, residual optional).
// variant in [0, kLinearVariants) picks the kernel and its tile configuration: the first
// kStagedVariants are linear.cu's (loads staged through registers), the next kAsyncVariants
// linear_async.cu's (cp.async pipeline), then linear_rows.cu's (few rows: a warp per output
// column) and linear_tf32x3.cu's (tensor cores, 3xTF32). The Python API picks by M (LINEAR_DEFAULT,
// or LINEAR_ROWS for few rows).
constexpr int kStagedVariants = 3;
constexpr int kAsyncVariants = 3;
constexpr int kRowsVariant = kStagedVariants + kAsyncVariants;
constexpr int kTf32x3Variant = kRowsVariant + 1;
constexpr int kLinearVariants = kTf32x3Variant + 1;
void launch_linear(const float* A, const float* W, const float* bias, const float* residual, float* C,
                   int64_t M, int64_t N, int64_t K, Activation act, int variant, cudaStream_t stream);

// One linear call's operands, as the GEMM kernels' launchers take them.
struct LinearArgs {
  const float* A;
  const float* W;
  const float* bias;      // nullptr: none
  const float* residual;  // nullptr: none
  float* C;
  int64_t M, N, K;
  Activation act;
  cudaStream_t stream;
};
void launch_linear_staged(const LinearArgs& p, int config);  // config in [0, kStagedVariants)
void launch_linear_async(const LinearArgs& p, int config);   // config in [0, kAsyncVariants)
void launch_linear_rows(const LinearArgs& p);
void launch_linear_tf32x3(const LinearArgs& p);

}  // namespace phase6
