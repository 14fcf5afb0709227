// Phase 2's ops: validation (each check names the argument), allocation, launch on the current
// CUDA stream, launch check. Registered as torch.ops.phase2_naive.{matmul_qk, softmax,
// matmul_av, attention}.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "attention_args.h"
#include "naive_kernels.h"

namespace phase2_naive {
namespace {

// The course's phases 2-4 share one contract: head dims 1..128 (the kernels here have no limit
// of their own; the cap keeps every phase interchangeable behind the same API).
constexpr int64_t kMaxHeadDim = 128;

void check_head_dim(int64_t D, const char* name) {
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, "head dim D=", D, " (", name,
              ".shape[-1]) is not supported: phase2_naive supports 1 <= D <= ", kMaxHeadDim);
}

void check_float4d(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 4, name, " must be 4-D, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(x.numel() > 0, name, " must not be empty");
}

at::Tensor matmul_qk(const at::Tensor& q, const at::Tensor& k, double scale) {
  check_float4d(q, "q");
  check_float4d(k, "k");
  TORCH_CHECK(k.device() == q.device(), "k must be on q's device");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "k must be [B, H, Sk, D] matching q ", q.sizes(), ", got ", k.sizes());
  check_head_dim(q.size(3), "q");
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
  at::Tensor s = at::empty({B, H, Sq, Sk}, q.options());
  launch_naive_qk(q.data_ptr<float>(), k.data_ptr<float>(), s.data_ptr<float>(), B * H, Sq, Sk, D,
                  static_cast<float>(scale), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return s;
}

// Writes softmax(s + mask) into p (p may be s itself).
void softmax_into(const at::Tensor& s, at::Tensor& p, const c10::optional<at::Tensor>& mask,
                  bool is_causal) {
  const course::AttentionShape shape{s.size(0), s.size(1), s.size(2), s.size(3), 0};
  const course::AttentionMasking masking = course::make_masking(mask, is_causal, 1, shape, s);
  launch_naive_softmax(s.data_ptr<float>(), p.data_ptr<float>(), shape.B, shape.H, shape.Sq,
                       shape.Sk, masking, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor softmax(const at::Tensor& s, const c10::optional<at::Tensor>& mask, bool is_causal) {
  check_float4d(s, "s");
  const c10::cuda::CUDAGuard guard(s.device());
  at::Tensor p = at::empty_like(s);
  softmax_into(s, p, mask, is_causal);
  return p;
}

at::Tensor matmul_av(const at::Tensor& p, const at::Tensor& v) {
  check_float4d(p, "p");
  check_float4d(v, "v");
  TORCH_CHECK(v.device() == p.device(), "v must be on p's device");
  TORCH_CHECK(v.size(0) == p.size(0) && v.size(1) == p.size(1) && v.size(2) == p.size(3),
              "v must be [B, H, Sk, D] with p = [B, H, Sq, Sk] = ", p.sizes(), ", got ", v.sizes());
  check_head_dim(v.size(3), "v");
  const c10::cuda::CUDAGuard guard(p.device());
  const int64_t B = p.size(0), H = p.size(1), Sq = p.size(2), Sk = p.size(3), D = v.size(3);
  at::Tensor o = at::empty({B, H, Sq, D}, v.options());
  launch_naive_av(p.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(), B * H, Sq, Sk, D,
                  c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return o;
}

// The three kernels composed: S = scale Q K^T, P = softmax(S + mask) in place, O = P V.
// Extra memory: one [B, H, Sq, Sk] float32 buffer.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, bool is_causal, double scale) {
  course::check_qkv(q, k, v, at::kFloat);
  check_head_dim(q.size(3), "q");
  at::Tensor s = matmul_qk(q, k, scale);
  const c10::cuda::CUDAGuard guard(q.device());
  softmax_into(s, s, mask, is_causal);
  return matmul_av(s, v);
}

}  // namespace
}  // namespace phase2_naive

TORCH_LIBRARY(phase2_naive, m) {
  m.def("matmul_qk(Tensor q, Tensor k, float scale) -> Tensor");
  m.def("softmax(Tensor s, Tensor? mask, bool is_causal) -> Tensor");
  m.def("matmul_av(Tensor p, Tensor v) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(phase2_naive, CUDA, m) {
  m.impl("matmul_qk", &phase2_naive::matmul_qk);
  m.impl("softmax", &phase2_naive::softmax);
  m.impl("matmul_av", &phase2_naive::matmul_av);
  m.impl("attention", &phase2_naive::attention);
}
