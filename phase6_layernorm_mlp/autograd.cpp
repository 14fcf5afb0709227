// Autograd of layer_norm, add_layer_norm and gelu in C++ (linear's is registered from Python,
// __init__.py). A formula registered from Python runs Python on every call of its op, forward and
// backward; these ops run once or twice per transformer block, where a training step's CPU time is
// spent (the final lesson's README, "Autograd in C++"). The LayerNorm formulas are those of
// layer_norm_backward.cu's header: ds from the row, dgamma and dbeta summed over the rows, and for
// add_layer_norm both x and the residual receive ds; gelu's is dy * gelu'(x) (gelu.cuh).
//
// Each op is called through the dispatcher below the autograd key: the CUDA kernels on real
// tensors, the fake implementations (__init__.py) when torch.compile traces the step.
#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

at::Tensor layer_norm_op(const at::Tensor& x, const OptionalTensor& weight, const OptionalTensor& bias, double eps) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("phase6_layernorm_mlp::layer_norm", "")
      .typed<at::Tensor(const at::Tensor&, const OptionalTensor&, const OptionalTensor&, double)>();
  return op.call(x, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_op(const at::Tensor& x, const at::Tensor& residual,
                                                     const OptionalTensor& weight, const OptionalTensor& bias,
                                                     double eps) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("phase6_layernorm_mlp::add_layer_norm", "")
      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                                const OptionalTensor&, double)>();
  return op.call(x, residual, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_op(const at::Tensor& dy, const at::Tensor& s,
                                                                      const OptionalTensor& weight,
                                                                      const OptionalTensor& dsum, double eps,
                                                                      bool param_grads) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("phase6_layernorm_mlp::layer_norm_backward", "")
      .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                            const OptionalTensor&, const OptionalTensor&, double,
                                                            bool)>();
  return op.call(dy, s, weight, dsum, eps, param_grads);
}

at::Tensor gelu_op(const at::Tensor& x, const std::string& approximate) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("phase6_layernorm_mlp::gelu", "")
      .typed<at::Tensor(const at::Tensor&, const std::string&)>();
  return op.call(x, approximate);
}

at::Tensor gelu_backward_op(const at::Tensor& dy, const at::Tensor& x, const std::string& approximate) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("phase6_layernorm_mlp::gelu_backward", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::string&)>();
  return op.call(dy, x, approximate);
}

// What the forward keeps for the backward besides tensors: eps, and whether gamma and beta want
// gradients (then the kernel sums the columns too).
void save_scalars(AutogradContext* ctx, const OptionalTensor& weight, const OptionalTensor& bias, double eps) {
  const auto wants = [](const OptionalTensor& p) { return p.has_value() && p->requires_grad(); };
  ctx->saved_data["eps"] = eps;
  ctx->saved_data["param_grads"] = wants(weight) || wants(bias);
  ctx->saved_data["has_bias"] = bias.has_value();
}

OptionalTensor present(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

// (ds, dgamma, dbeta) from the saved s (the LayerNorm's input) and gamma; dgamma, dbeta undefined
// where no gradient is wanted (an absent bias gets none).
variable_list ln_backward(AutogradContext* ctx, const at::Tensor& dy, const OptionalTensor& dsum) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& s = saved[0];
  const bool param_grads = ctx->saved_data["param_grads"].toBool();
  const at::Tensor dy_c = dy.defined() ? dy.contiguous() : at::zeros_like(s);
  auto [ds, dweight, dbias] = layer_norm_backward_op(dy_c, s, present(saved[1]), dsum,
                                                     ctx->saved_data["eps"].toDouble(), param_grads);
  const bool has_weight = saved[1].defined(), has_bias = ctx->saved_data["has_bias"].toBool();
  return {ds, param_grads && has_weight ? dweight : at::Tensor(), param_grads && has_bias ? dbias : at::Tensor()};
}

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& weight,
                            const OptionalTensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight.value_or(at::Tensor())});
    save_scalars(ctx, weight, bias, eps);
    return layer_norm_op(x, weight, bias, eps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = ln_backward(ctx, grads[0], std::nullopt);  // (dx, dweight, dbias)
    return {g[0], g[1], g[2], at::Tensor()};
  }
};

class AddLayerNormFunction : public torch::autograd::Function<AddLayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual,
                               const OptionalTensor& weight, const OptionalTensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, s] = add_layer_norm_op(x, residual, weight, bias, eps);
    ctx->save_for_backward({s, weight.value_or(at::Tensor())});  // s = x + residual: the LayerNorm's input
    save_scalars(ctx, weight, bias, eps);
    return {y, s};
  }

  // grads: (dy, dsum), dsum the gradient that reached the sum output directly. s = x + residual:
  // both receive ds.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = ln_backward(ctx, grads[0], grads[1].defined() ? OptionalTensor(grads[1].contiguous()) : std::nullopt);
    return {g[0], g[0], g[1], g[2], at::Tensor()};
  }
};

class GeluFunction : public torch::autograd::Function<GeluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& approximate) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x});
    ctx->saved_data["approximate"] = approximate;
    return gelu_op(x, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {gelu_backward_op(grads[0].contiguous(), saved[0], ctx->saved_data["approximate"].toStringRef()),
            at::Tensor()};
  }
};

at::Tensor layer_norm_autograd(const at::Tensor& x, const OptionalTensor& weight, const OptionalTensor& bias,
                               double eps) {
  return LayerNormFunction::apply(x, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_autograd(const at::Tensor& x, const at::Tensor& residual,
                                                           const OptionalTensor& weight, const OptionalTensor& bias,
                                                           double eps) {
  auto out = AddLayerNormFunction::apply(x, residual, weight, bias, eps);
  return {out[0], out[1]};
}

at::Tensor gelu_autograd(const at::Tensor& x, const std::string& approximate) {
  return GeluFunction::apply(x, approximate);
}

}  // namespace

TORCH_LIBRARY_IMPL(phase6_layernorm_mlp, Autograd, m) {
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("add_layer_norm", &add_layer_norm_autograd);
  m.impl("gelu", &gelu_autograd);
}
