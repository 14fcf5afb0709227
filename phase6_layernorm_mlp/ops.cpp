// Phase 6 ops: validation (each error names its argument), output allocation, launch on the
// current CUDA stream, launch check, and registration as torch.ops.phase6_layernorm_mlp.*.
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "launchers.h"

namespace phase6 {
namespace {

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(),
              " (as x), got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// gamma / beta: [hidden] of x's dtype, or absent.
const void* optional_param(const std::optional<at::Tensor>& p, const char* name, const at::Tensor& x) {
  if (!p.has_value()) return nullptr;
  check_tensor(*p, name, x);
  TORCH_CHECK(p->dim() == 1 && p->size(0) == x.size(-1), name, " must have shape [", x.size(-1),
              "] (the last dimension of x), got ", p->sizes());
  return p->data_ptr();
}

std::tuple<at::Tensor, at::Tensor> layer_norm_impl(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                   const std::optional<at::Tensor>& weight,
                                                   const std::optional<at::Tensor>& bias, double eps) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got device ", x.device());
  const DType dtype = to_dtype(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dimension, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const void* gamma = optional_param(weight, "weight", x);
  const void* beta = optional_param(bias, "bias", x);
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;
  TORCH_CHECK(rows < (int64_t{1} << 31), "x has too many rows (", rows, "), at most 2^31 - 1");
  at::Tensor y = at::empty_like(x);
  at::Tensor sum;
  const void* r = nullptr;
  if (residual.has_value()) {
    check_tensor(*residual, "residual", x);
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape ", x.sizes(), ", got ",
                residual->sizes());
    r = residual->data_ptr();
    sum = at::empty_like(x);
  }
  if (rows == 0) return {y, sum};
  launch_layer_norm(dtype, x.data_ptr(), r, gamma, beta, y.data_ptr(), sum.defined() ? sum.data_ptr() : nullptr,
                    rows, hidden, static_cast<float>(eps), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, sum};
}

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps) {
  return std::get<0>(layer_norm_impl(x, std::nullopt, weight, bias, eps));
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias, double eps) {
  return layer_norm_impl(x, residual, weight, bias, eps);
}

// Backward of layer_norm / add_layer_norm: dy and s (the LayerNorm's input: x, or the sum output of
// add_layer_norm) of one shape; dsum (optional, s's shape) is added to ds. Returns ds and, with
// param_grads, dgamma and dbeta ([hidden], x's dtype; empty tensors otherwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& dy, const at::Tensor& s,
                                                                   const std::optional<at::Tensor>& weight,
                                                                   const std::optional<at::Tensor>& dsum, double eps,
                                                                   bool param_grads) {
  TORCH_CHECK(s.is_cuda(), "s must be a CUDA tensor, got device ", s.device());
  const DType dtype = to_dtype(s, "s");
  TORCH_CHECK(s.dim() >= 1 && s.size(-1) > 0, "s must have a non-empty last dimension, got ", s.sizes());
  TORCH_CHECK(s.is_contiguous(), "s must be contiguous");
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  check_tensor(dy, "dy", s);
  TORCH_CHECK(dy.sizes() == s.sizes(), "dy must have s's shape ", s.sizes(), ", got ", dy.sizes());
  const c10::cuda::CUDAGuard guard(s.device());
  const void* gamma = optional_param(weight, "weight", s);
  const void* extra = nullptr;
  if (dsum.has_value()) {
    check_tensor(*dsum, "dsum", s);
    TORCH_CHECK(dsum->sizes() == s.sizes(), "dsum must have s's shape ", s.sizes(), ", got ", dsum->sizes());
    extra = dsum->data_ptr();
  }
  const int64_t hidden = s.size(-1);
  const int64_t rows = s.numel() / hidden;
  at::Tensor ds = at::empty_like(s);
  at::Tensor dgamma = at::empty({param_grads ? hidden : 0}, s.options());
  at::Tensor dbeta = at::empty({param_grads ? hidden : 0}, s.options());
  if (rows == 0) return {ds, dgamma.zero_(), dbeta.zero_()};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t partial_rows = layer_norm_backward_partial_rows(dtype, dy.data_ptr(), s.data_ptr(), gamma, extra,
                                                                ds.data_ptr(), rows, hidden);
  at::Tensor partials;  // [2, partial_rows, hidden] FP32: dgamma's and dbeta's column sums per block
  float* pg = nullptr;
  float* pb = nullptr;
  if (param_grads) {
    partials = at::empty({2, partial_rows, hidden}, s.options().dtype(at::kFloat));
    pg = partials.data_ptr<float>();
    pb = pg + partial_rows * hidden;
  }
  launch_layer_norm_backward(dtype, dy.data_ptr(), s.data_ptr(), gamma, extra, ds.data_ptr(), pg, pb, partial_rows,
                             param_grads ? dgamma.data_ptr() : nullptr, param_grads ? dbeta.data_ptr() : nullptr,
                             rows, hidden, static_cast<float>(eps), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {ds, dgamma, dbeta};
}

Activation parse_activation(const std::string& name, const char* arg) {
  if (name == "none") return Activation::kNone;
  if (name == "gelu_tanh" || name == "tanh") return Activation::kGeluTanh;
  if (name == "gelu" || name == "gelu_erf") return Activation::kGeluErf;
  TORCH_CHECK(false, arg, " must be one of 'none', 'gelu_tanh', 'gelu', got '", name, "'");
}

at::Tensor gelu(const at::Tensor& x, const std::string& approximate) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got device ", x.device());
  const DType dtype = to_dtype(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(approximate == "tanh" || approximate == "none", "approximate must be 'tanh' or 'none', got '",
              approximate, "'");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  launch_gelu(dtype, x.data_ptr(), y.data_ptr(), x.numel(),
              approximate == "tanh" ? Activation::kGeluTanh : Activation::kGeluErf,
              c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// dx = dy * gelu'(x), dy and x of one shape and dtype.
at::Tensor gelu_backward(const at::Tensor& dy, const at::Tensor& x, const std::string& approximate) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got device ", x.device());
  const DType dtype = to_dtype(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  check_tensor(dy, "dy", x);
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must have x's shape ", x.sizes(), ", got ", dy.sizes());
  TORCH_CHECK(approximate == "tanh" || approximate == "none", "approximate must be 'tanh' or 'none', got '",
              approximate, "'");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  if (x.numel() == 0) return dx;
  launch_gelu_backward(dtype, dy.data_ptr(), x.data_ptr(), dx.data_ptr(), x.numel(),
                       approximate == "tanh" ? Activation::kGeluTanh : Activation::kGeluErf,
                       c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::string& activation, const std::optional<at::Tensor>& residual, int64_t variant) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(variant >= 0 && variant < kLinearVariants, "variant must be in [0, ", kLinearVariants, "), got ",
              variant);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32 (this SGEMM is FP32 only), got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "x must have at least 1 dimension [..., in_features]");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  check_tensor(weight, "weight", x);
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D [out_features, in_features], got ", weight.sizes());
  TORCH_CHECK(weight.size(1) == x.size(-1), "weight must be [out_features, in_features=", x.size(-1),
              "] (in_features = x.shape[-1]), got ", weight.sizes());
  const Activation act = parse_activation(activation, "activation");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t K = x.size(-1);
  const int64_t N = weight.size(0);
  int64_t M = 1;  // tokens: the product of x's leading dimensions
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  TORCH_CHECK(N < 65535LL * 128, "weight has too many rows (out_features ", N, ") for the grid");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const float* b = nullptr;
  if (bias.has_value()) {
    check_tensor(*bias, "bias", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must have shape [", N,
                "] (out_features), got ", bias->sizes());
    b = bias->data_ptr<float>();
  }
  const float* r = nullptr;
  if (residual.has_value()) {
    check_tensor(*residual, "residual", x);
    TORCH_CHECK(residual->sizes() == at::IntArrayRef(out_shape), "residual must have the output's shape ",
                at::IntArrayRef(out_shape), ", got ", residual->sizes());
    r = residual->data_ptr<float>();
  }
  at::Tensor out = at::empty(out_shape, x.options());
  if (M == 0 || N == 0) return out;
  launch_linear(x.data_ptr<float>(), weight.data_ptr<float>(), b, r, out.data_ptr<float>(), M, N, K, act,
                static_cast<int>(variant), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace phase6

TORCH_LIBRARY(phase6_layernorm_mlp, m) {
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor)");
  m.def("gelu(Tensor x, str approximate) -> Tensor");
  m.def("layer_norm_backward(Tensor dy, Tensor s, Tensor? weight, Tensor? dsum, float eps, bool param_grads) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("gelu_backward(Tensor dy, Tensor x, str approximate) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, str activation, Tensor? residual, int variant=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(phase6_layernorm_mlp, CUDA, m) {
  m.impl("layer_norm", &phase6::layer_norm);
  m.impl("add_layer_norm", &phase6::add_layer_norm);
  m.impl("gelu", &phase6::gelu);
  m.impl("layer_norm_backward", &phase6::layer_norm_backward);
  m.impl("gelu_backward", &phase6::gelu_backward);
  m.impl("linear", &phase6::linear);
}
