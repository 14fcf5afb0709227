// Phase 4's ops: validation (each check names the argument), allocation, launch on the current
// CUDA stream, launch check. Registered as torch.ops.phase4_coalesced.{matmul_qk, softmax,
// matmul_av, attention}.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "attention_args.h"
#include "coalesced_kernels.h"

namespace phase4_coalesced {
namespace {

// Rows of S and tiles of a launch are counted in 32-bit grid dimensions.
constexpr int64_t kMaxGridRows = std::numeric_limits<int32_t>::max();

void check_rows(int64_t rows, const char* name) {
  TORCH_CHECK(rows <= kMaxGridRows, name, " has ", rows, " rows (B*H*Sq); at most ", kMaxGridRows,
              " are supported");
}

at::Tensor matmul_qk(const at::Tensor& q, const at::Tensor& k, double scale, bool causal) {
  course::check_qk_operands(q, k, "phase4_coalesced");
  check_rows(q.size(0) * q.size(1) * q.size(2), "q");
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
  at::Tensor s = at::empty({B, H, Sq, Sk}, q.options());
  launch_matmul_qk(q.data_ptr<float>(), k.data_ptr<float>(), s.data_ptr<float>(), B * H, Sq, Sk,
                   D, static_cast<float>(scale), causal, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return s;
}

// Writes softmax(s + mask) into p (p may be s itself).
void softmax_into(const at::Tensor& s, const at::Tensor& p, const c10::optional<at::Tensor>& mask,
                  bool causal) {
  course::check_float4d(s, "s");
  check_rows(s.size(0) * s.size(1) * s.size(2), "s");
  const c10::cuda::CUDAGuard guard(s.device());
  const course::AttentionShape shape{s.size(0), s.size(1), s.size(2), s.size(3), 0};
  const course::AttentionMasking masking = course::make_masking(mask, causal, 1, shape, s);
  launch_softmax(s.data_ptr<float>(), p.data_ptr<float>(), shape.B, shape.H, shape.Sq, shape.Sk,
                 masking, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor softmax(const at::Tensor& s, const c10::optional<at::Tensor>& mask, bool causal) {
  course::check_float4d(s, "s");
  at::Tensor p = at::empty_like(s);
  softmax_into(s, p, mask, causal);
  return p;
}

at::Tensor matmul_av(const at::Tensor& p, const at::Tensor& v, bool causal) {
  course::check_av_operands(p, v, "phase4_coalesced");
  check_rows(p.size(0) * p.size(1) * p.size(2), "p");
  const c10::cuda::CUDAGuard guard(p.device());
  const int64_t B = p.size(0), H = p.size(1), Sq = p.size(2), Sk = p.size(3), D = v.size(3);
  at::Tensor o = at::empty({B, H, Sq, D}, p.options());
  launch_matmul_av(p.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(), B * H, Sq, Sk, D,
                   causal, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return o;
}

// The three kernels composed: S = scale q k^T, P = softmax(S + mask) in place, O = P v.
// With causal, QK^T skips the tiles above the diagonal and AV stops each tile's reduction there.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, bool causal, double scale) {
  const course::AttentionShape shape = course::check_qkv(q, k, v, at::kFloat);
  course::check_unfused_head_dim(shape.D, "q", "phase4_coalesced");
  at::Tensor s = matmul_qk(q, k, scale, causal);
  softmax_into(s, s, mask, causal);
  return matmul_av(s, v, causal);
}

}  // namespace
}  // namespace phase4_coalesced

TORCH_LIBRARY(phase4_coalesced, m) {
  // causal = true skips work the causal softmax makes irrelevant: tiles of S above the diagonal
  // are left unwritten (matmul_qk), keys past a row tile's diagonal are not summed (matmul_av).
  // The Python API passes causal = false for the standalone kernels.
  m.def("matmul_qk(Tensor q, Tensor k, float scale, bool causal) -> Tensor");
  m.def("softmax(Tensor s, Tensor? mask, bool causal) -> Tensor");
  m.def("matmul_av(Tensor p, Tensor v, bool causal) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(phase4_coalesced, CUDA, m) {
  m.impl("matmul_qk", &phase4_coalesced::matmul_qk);
  m.impl("softmax", &phase4_coalesced::softmax);
  m.impl("matmul_av", &phase4_coalesced::matmul_av);
  m.impl("attention", &phase4_coalesced::attention);
}
