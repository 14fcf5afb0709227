// Torch ops of the tensor-core fused attention (namespace phase5_fused_tc): validation that names
// the argument, then the launch of tc_attention.cu on the current CUDA stream.
//   attention(q, k, v, mask, is_causal, scale, key_lengths, window=0) -> out
//   attention_out(q, k, v, mask, is_causal, scale, key_lengths, out, window=0)   writes into `out`
//   attention_lse(q, k, v, mask, is_causal, scale, key_lengths, window=0) -> (out, lse)   lse [B, H, Sq]
//       float32, the rows' natural-log logsumexp (-inf for a row with no visible key), what the backward needs
//   attention_version(q, k, v, is_causal, scale, version) -> out   the lesson's version 1-6 (tc_versions.h):
//       D in {64, 128}, no mask, key padding, grouped heads, window or lse
//   attention_version_out(q, k, v, is_causal, scale, version, out)   the same, written into `out`
// k and v may have H_kv heads (grouped-query attention, H % H_kv == 0); window: a sliding window with
// is_causal (query i sees keys i - window < j <= i), 0 for none.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "attention_args.h"
#include "tc_attention.h"
#include "tc_versions.h"

namespace {

void check_aligned(const at::Tensor& x, const char* name) {
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 == 0, name,
              " must start at a 16-byte aligned address (its 16-byte cp.async loads and stores "
              "need it): pass a fresh tensor or x.clone()");
}

// The checks that every op of this file makes of q, k, v and out (the shapes `s` of q, k, v).
void check_io(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const course::AttentionShape& s) {
  TORCH_CHECK(s.Sq <= std::numeric_limits<int>::max() && s.Sk <= std::numeric_limits<int>::max(),
              "q and k sequence lengths must fit in int32");
  TORCH_CHECK(s.B <= 65535 && s.H <= 65535, "q must have at most 65535 batches and heads (grid limits), got ",
              q.sizes());
  TORCH_CHECK(out.is_cuda() && out.device() == q.device(), "out must be on q's device");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out must be ", q.scalar_type(), ", got ", out.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  check_aligned(q, "q");
  check_aligned(k, "k");
  check_aligned(v, "v");
  check_aligned(out, "out");
}

// Checks, then the launch; lse: nullptr or [B, H, Sq] float32 that the kernel fills.
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
         bool is_causal, double scale, const c10::optional<at::Tensor>& key_lengths, at::Tensor& out,
         float* lse, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q must be float16 or bfloat16 for the tensor-core kernel, got ", q.scalar_type());
  const course::AttentionShape s = course::check_qkv(q, k, v, q.scalar_type(), /*grouped=*/true);
  TORCH_CHECK(phase5_tc::supported_head_dim(s.D), "head dim D=", s.D, " (q.size(3)) is not supported: use a "
              "multiple of 8 from ", phase5_tc::kMinHeadDim, " to ", phase5_tc::kMaxHeadDim);
  const int64_t kernel_window = course::check_window(window, is_causal, s.Sq);  // < Sq: fits in int
  check_io(q, k, v, out, s);

  const c10::cuda::CUDAGuard guard(q.device());
  const course::AttentionMasking masking = course::make_masking(mask, is_causal, 1, s, q);
  const at::Tensor lengths = course::clamped_key_lengths(key_lengths, s, q);
  phase5_tc::launch_tc_attention(q, k, v, out, lse, lengths.defined() ? lengths.data_ptr<int>() : nullptr,
                                 masking, static_cast<float>(scale), static_cast<int>(kernel_window),
                                 c10::cuda::getCurrentCUDAStream());
}

void attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const c10::optional<at::Tensor>& mask, bool is_causal, double scale,
                   const c10::optional<at::Tensor>& key_lengths, at::Tensor out, int64_t window) {
  run(q, k, v, mask, is_causal, scale, key_lengths, out, nullptr, window);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, bool is_causal, double scale,
                     const c10::optional<at::Tensor>& key_lengths, int64_t window) {
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  run(q, k, v, mask, is_causal, scale, key_lengths, out, nullptr, window);
  return out;
}

std::tuple<at::Tensor, at::Tensor> attention_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const c10::optional<at::Tensor>& mask, bool is_causal,
                                                 double scale, const c10::optional<at::Tensor>& key_lengths,
                                                 int64_t window) {
  TORCH_CHECK(q.dim() == 4, "q must be 4-D [B, H, Sq, D], got ", q.sizes());
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  run(q, k, v, mask, is_causal, scale, key_lengths, out, lse.data_ptr<float>(), window);
  return {out, lse};
}

// Version 1-6 of the lesson (tc_versions.h) into `out`, for the headline problem only: D in
// {64, 128}, no mask, key padding, grouped heads, window or lse.
void attention_version_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                           double scale, int64_t version, at::Tensor out) {
  TORCH_CHECK(version >= 1 && version <= phase5_tc::kVersions, "version must be 1 to ", phase5_tc::kVersions,
              " (tc_v1_mma.cu ... tc_v6_lazy.cu), got ", version);
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q must be float16 or bfloat16 for the tensor-core kernel, got ", q.scalar_type());
  const course::AttentionShape s = course::check_qkv(q, k, v, q.scalar_type());
  TORCH_CHECK(phase5_tc::version_head_dim(s.D), "head dim D=", s.D, " (q.size(3)) is not supported by version ",
              version, ": use 64 or 128 (the fast kernel takes every multiple of 8 up to 256)");
  check_io(q, k, v, out, s);
  const c10::cuda::CUDAGuard guard(q.device());
  phase5_tc::kVersionLaunchers[version - 1](q, k, v, out, is_causal, static_cast<float>(scale),
                                            c10::cuda::getCurrentCUDAStream());
}

at::Tensor attention_version(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                             double scale, int64_t version) {
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  attention_version_out(q, k, v, is_causal, scale, version, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(phase5_fused_tc, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale, "
        "Tensor? key_lengths, int window=0) -> Tensor");
  m.def("attention_out(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale, "
        "Tensor? key_lengths, Tensor(a!) out, int window=0) -> ()");
  m.def("attention_lse(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale, "
        "Tensor? key_lengths, int window=0) -> (Tensor, Tensor)");
  m.def("attention_version(Tensor q, Tensor k, Tensor v, bool is_causal, float scale, int version) -> Tensor");
  m.def("attention_version_out(Tensor q, Tensor k, Tensor v, bool is_causal, float scale, int version, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(phase5_fused_tc, CUDA, m) {
  m.impl("attention", &attention);
  m.impl("attention_out", &attention_out);
  m.impl("attention_lse", &attention_lse);
  m.impl("attention_version", &attention_version);
  m.impl("attention_version_out", &attention_version_out);
}
