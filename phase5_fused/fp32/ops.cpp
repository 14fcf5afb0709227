// Phase 5 ops: validation (each error names the argument), then the launch of one version of the
// fused kernel on the current CUDA stream.
//   phase5_fused::attention_teaching(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse)
//   phase5_fused::attention_v2(...), attention_v3(...), attention_v4(...), attention_tf32x3(...): the
//       same arguments
//   phase5_fused::attention_fast(..., variant, window=0)   also takes k, v with H_kv heads
//       (grouped-query attention, H % H_kv == 0) and a sliding window (with is_causal; 0 = none),
//       and every D that is a multiple of 8 up to 256 (the others take fused.h's kVersionD only)
//   phase5_fused::attention_fastest(..., window=0)   the fast kernel's arguments but no variant: version 6
//       where it takes the inputs, the fast kernel elsewhere (fused.h's fastest_is_version6)
//   phase5_fused::attention_fast_inference(...), attention_fastest_inference(...)   the same ops without
//       an autograd formula
//   phase5_fused::attention_fastest_out(q, k, v, mask, is_causal, scale, stride, key_lengths, window=0)
//       -> out   attention_fastest_inference without return_lse: no lse allocated, out alone returned
// Each returns (out [B, H, Sq, D], lse [B, H, Sq] or an empty tensor when return_lse is false).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "attention_args.h"
#include "fused.h"

namespace {

// kVersionD as the error messages print it: "32, 64, 80, 96, 128".
std::string version_head_dims() {
  std::string text;
  for (int d : phase5::kVersionD) text += (text.empty() ? "" : ", ") + std::to_string(d);
  return text;
}

struct Prepared {
  phase5::FusedParams params;
  at::Tensor out, lse, key_lengths;  // lse undefined unless asked for; key_lengths kept alive until the launch
  int D;
};

// fast: the fast kernel, which takes every multiple of 8 up to 256 as D, k, v with H_kv heads and a
// window (0 = none); the other versions are called with false and 0.
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
                 int64_t stride, const c10::optional<at::Tensor>& key_lengths, bool return_lse,
                 bool fast = false, int64_t window = 0) {
  const course::AttentionShape s = course::check_qkv(q, k, v, at::kFloat, fast);
  if (fast) {
    TORCH_CHECK(phase5::fast_supports_head_dim(s.D), "q: head dim D=", s.D, " is not supported by the fast "
                "kernel: use a multiple of ", phase5::kHeadDimStep, " from ", phase5::kMinHeadDim, " to ",
                phase5::kMaxHeadDim);
  } else {
    TORCH_CHECK(phase5::version_supports_head_dim(s.D), "q: head dim D=", s.D, " is not supported by the "
                "versions other than the fast kernel (", version_head_dims(), "; the fast kernel takes every "
                "multiple of ", phase5::kHeadDimStep, " from ", phase5::kMinHeadDim, " to ", phase5::kMaxHeadDim, ")");
  }
  const at::Tensor* tensors[] = {&q, &k, &v};
  const char* names[] = {"q", "k", "v"};
  for (int t = 0; t < 3; ++t)
    TORCH_CHECK(reinterpret_cast<uintptr_t>(tensors[t]->data_ptr()) % 16 == 0, names[t],
                " must be 16-byte aligned (the kernels read rows with 16-byte loads)");

  Prepared prep;
  prep.D = static_cast<int>(s.D);
  prep.out = at::empty_like(q);
  if (return_lse) prep.lse = at::empty({s.B, s.H, s.Sq}, q.options());

  phase5::FusedParams& p = prep.params;
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr<float>();
  p.v = v.data_ptr<float>();
  p.o = prep.out.data_ptr<float>();
  p.lse = return_lse ? prep.lse.data_ptr<float>() : nullptr;
  p.B = s.B;
  p.H = s.H;
  p.Sq = s.Sq;
  p.Sk = s.Sk;
  p.H_kv = k.size(1);
  p.head_dim = prep.D;
  p.window = course::check_window(window, is_causal, s.Sq);
  p.scale = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(s.D)));
  p.masking = course::make_masking(mask, is_causal, stride, s, q);
  prep.key_lengths = course::clamped_key_lengths(key_lengths, s, q);
  p.key_lengths = prep.key_lengths.defined() ? prep.key_lengths.data_ptr<int>() : nullptr;
  return prep;
}

// A version with one tile configuration per D (all but the fast kernel), launched.
template <void (*Launch)(const phase5::FusedParams&, int, cudaStream_t)>
Prepared run_version(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
                     int64_t stride, const c10::optional<at::Tensor>& key_lengths, bool return_lse) {
  const c10::cuda::CUDAGuard guard(q.device());
  Prepared prep = prepare(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse);
  Launch(prep.params, prep.D, c10::cuda::getCurrentCUDAStream());
  return prep;
}

Prepared run_fast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
                  int64_t stride, const c10::optional<at::Tensor>& key_lengths, bool return_lse,
                  int64_t variant, int64_t window) {
  const c10::cuda::CUDAGuard guard(q.device());
  Prepared prep = prepare(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse, true, window);
  phase5::launch_fast(prep.params, prep.D, static_cast<int>(variant), c10::cuda::getCurrentCUDAStream());
  return prep;
}

// Version 6 where fused.h's rule says it takes the inputs, else the fast kernel (default tiles).
Prepared run_fastest(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
                     int64_t stride, const c10::optional<at::Tensor>& key_lengths, bool return_lse,
                     int64_t window) {
  // (a q or k that is not 4-D goes to the fast kernel's checks, which name it)
  if (q.dim() == 4 && k.dim() == 4 && phase5::fastest_is_version6(q.size(3), q.size(1), k.size(1), stride, window))
    return run_version<phase5::launch_tf32x3>(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse);
  return run_fast(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse, 0, window);
}

// What the (out, lse) ops return: lse an empty tensor where it was not asked for.
std::tuple<at::Tensor, at::Tensor> out_and_lse(const Prepared& prep) {
  return {prep.out, prep.lse.defined() ? prep.lse : at::empty({0}, prep.out.options())};
}

template <void (*Launch)(const phase5::FusedParams&, int, cudaStream_t)>
std::tuple<at::Tensor, at::Tensor> attention_version(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
    int64_t stride, const c10::optional<at::Tensor>& key_lengths, bool return_lse) {
  return out_and_lse(run_version<Launch>(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse));
}

std::tuple<at::Tensor, at::Tensor> attention_fast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
    int64_t stride, const c10::optional<at::Tensor>& key_lengths, bool return_lse,
    int64_t variant, int64_t window) {
  return out_and_lse(run_fast(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse, variant, window));
}

std::tuple<at::Tensor, at::Tensor> attention_fastest(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
    int64_t stride, const c10::optional<at::Tensor>& key_lengths, bool return_lse, int64_t window) {
  return out_and_lse(run_fastest(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse, window));
}

// The course API's common call: no logsumexp asked for, so none allocated, and out alone returned.
at::Tensor attention_fastest_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const c10::optional<at::Tensor>& mask, bool is_causal,
                                 c10::optional<double> scale, int64_t stride,
                                 const c10::optional<at::Tensor>& key_lengths, int64_t window) {
  return run_fastest(q, k, v, mask, is_causal, scale, stride, key_lengths, false, window).out;
}

}  // namespace

TORCH_LIBRARY(phase5_fused, m) {
  // The versions with one tile configuration per D share one signature.
  for (const char* name : {"attention_teaching", "attention_v2", "attention_v3", "attention_v4",
                           "attention_tf32x3"}) {
    const std::string schema = std::string(name) +
        "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float? scale, int stride, "
        "Tensor? key_lengths, bool return_lse) -> (Tensor, Tensor)";
    m.def(schema.c_str());
  }
  // The fast kernel and the fastest version twice: attention_fast and attention_fastest are
  // differentiable (their autograd formula, registered in Python, runs on every call), the _inference
  // ops have none, so a call that records no gradient reaches the kernel without a trip through Python.
  for (const char* name : {"attention_fastest", "attention_fastest_inference"}) {
    const std::string schema = std::string(name) +
        "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float? scale, int stride, "
        "Tensor? key_lengths, bool return_lse, int window=0) -> (Tensor, Tensor)";
    m.def(schema.c_str());
  }
  m.def("attention_fastest_out(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float? scale, "
        "int stride, Tensor? key_lengths, int window=0) -> Tensor");
  for (const char* name : {"attention_fast", "attention_fast_inference"}) {
    const std::string schema = std::string(name) +
        "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float? scale, int stride, "
        "Tensor? key_lengths, bool return_lse, int variant, int window=0) -> (Tensor, Tensor)";
    m.def(schema.c_str());
  }
}

TORCH_LIBRARY_IMPL(phase5_fused, CUDA, m) {
  m.impl("attention_teaching", &attention_version<phase5::launch_teaching>);
  m.impl("attention_v2", &attention_version<phase5::launch_v2>);
  m.impl("attention_v3", &attention_version<phase5::launch_v3>);
  m.impl("attention_v4", &attention_version<phase5::launch_v4>);
  m.impl("attention_tf32x3", &attention_version<phase5::launch_tf32x3>);
  m.impl("attention_fast", &attention_fast);
  m.impl("attention_fast_inference", &attention_fast);
  m.impl("attention_fastest", &attention_fastest);
  m.impl("attention_fastest_inference", &attention_fastest);
  m.impl("attention_fastest_out", &attention_fastest_out);
}
