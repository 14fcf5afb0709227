// Autograd of the Hopper forward op (phase5_fused_hopper::attention) in C++: its backward is
// attention_backward (hopper_bwd.cu) on the saved q, k, v, out and lse, run as kBwdDefaultVariant.
// The other fused forwards register theirs from Python (../backward/autograd.py), which runs Python
// on every call of the op; this one is the op a training step on an H100 calls in every block
// (the final lesson's README, "Autograd in C++", measures the difference). attention_inference, the
// same forward without a formula, has no autograd kernel at all.
//
// Both ops are called through the dispatcher below the autograd key: the CUDA kernels on real
// tensors, the fake implementations (__init__.py) when torch.compile traces a training step.
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "hopper_attention.h"
#include "hopper_tma.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor> attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                bool is_causal, double scale, const OptionalTensor& key_lengths,
                                                bool return_lse, int64_t version) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("phase5_fused_hopper::attention", "")
      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                                                double, const OptionalTensor&, bool, int64_t)>();
  return op.call(q, k, v, is_causal, scale, key_lengths, return_lse, version);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& dout, const OptionalTensor& dlse, bool is_causal, std::optional<double> scale,
    const OptionalTensor& key_lengths, int64_t variant) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("phase5_fused_hopper::attention_backward", "")
      .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
          const at::Tensor&, const OptionalTensor&, bool, std::optional<double>, const OptionalTensor&, int64_t)>();
  return op.call(q, k, v, out, lse, dout, dlse, is_causal, scale, key_lengths, variant);
}

// x itself where TMA reads it in place (views of the qkv projection, O and dO in [B, S, H, D]
// memory), else a contiguous copy. A traced tensor (torch.compile's functional fakes) has no data
// pointer: its strides alone decide, as they decide the real tensor's copy at run time.
at::Tensor tma_readable(const at::Tensor& x) {
  const bool traced = x.key_set().has_any(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
  if (x.stride(3) == 1 && hopper::tma_strides_ok(x) && (traced || hopper::tma_aligned(x))) return x;
  return x.contiguous();
}

class HopperAttentionFunction : public torch::autograd::Function<HopperAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               bool is_causal, double scale, const OptionalTensor& key_lengths, bool return_lse,
                               int64_t version) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = attention_op(q, k, v, is_causal, scale, key_lengths, return_lse, version);
    ctx->save_for_backward({q, k, v, out, lse, key_lengths.value_or(at::Tensor())});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    return {out, lse};
  }

  // grads: (dout, dlse); dlse where a caller differentiated the logsumexp too.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    TORCH_CHECK(lse.dim() == 3, "the forward ran without its logsumexp (return_lse=False): call it through "
                "phase5_fused.hopper.attention, which asks for it when an input requires grad");
    const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const OptionalTensor dlse = grads[1].defined() ? OptionalTensor(grads[1].contiguous()) : std::nullopt;
    const OptionalTensor key_lengths = saved[5].defined() ? OptionalTensor(saved[5]) : std::nullopt;
    auto [dq, dk, dv] = attention_backward_op(tma_readable(q), tma_readable(k), tma_readable(v), tma_readable(out),
                                              lse, tma_readable(dout), dlse, ctx->saved_data["is_causal"].toBool(),
                                              ctx->saved_data["scale"].toDouble(), key_lengths,
                                              hopper::kBwdDefaultVariant);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      bool is_causal, double scale, const OptionalTensor& key_lengths,
                                                      bool return_lse, int64_t version) {
  auto outputs = HopperAttentionFunction::apply(q, k, v, is_causal, scale, key_lengths, return_lse, version);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(phase5_fused_hopper, Autograd, m) {
  m.impl("attention", &attention_autograd);
}
