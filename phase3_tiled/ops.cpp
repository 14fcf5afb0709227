// Phase 3's ops: validation (each check names the argument), allocation, launch on the current
// CUDA stream, launch check. Registered as torch.ops.phase3_tiled.{matmul_qk, softmax,
// matmul_av, attention}.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "attention_args.h"
#include "tiled_kernels.h"

namespace phase3_tiled {
namespace {

void check_tile(int64_t tile) {
  TORCH_CHECK(is_supported_tile(tile), "tile must be 8, 16 or 32, got ", tile);
}

at::Tensor matmul_qk(const at::Tensor& q, const at::Tensor& k, double scale, int64_t tile) {
  course::check_qk_operands(q, k, "phase3_tiled");
  check_tile(tile);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
  at::Tensor s = at::empty({B, H, Sq, Sk}, q.options());
  launch_tiled_qk(static_cast<int>(tile), q.data_ptr<float>(), k.data_ptr<float>(),
                  s.data_ptr<float>(), B * H, Sq, Sk, D, static_cast<float>(scale),
                  c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return s;
}

// Writes softmax(s + mask) into p (p may be s itself).
void softmax_into(const at::Tensor& s, at::Tensor& p, const c10::optional<at::Tensor>& mask,
                  bool is_causal) {
  const course::AttentionShape shape{s.size(0), s.size(1), s.size(2), s.size(3), 0};
  const course::AttentionMasking masking = course::make_masking(mask, is_causal, 1, shape, s);
  launch_block_softmax(s.data_ptr<float>(), p.data_ptr<float>(), shape.B, shape.H, shape.Sq,
                       shape.Sk, masking, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor softmax(const at::Tensor& s, const c10::optional<at::Tensor>& mask, bool is_causal) {
  course::check_float4d(s, "s");
  const c10::cuda::CUDAGuard guard(s.device());
  at::Tensor p = at::empty_like(s);
  softmax_into(s, p, mask, is_causal);
  return p;
}

at::Tensor matmul_av(const at::Tensor& p, const at::Tensor& v, int64_t tile) {
  course::check_av_operands(p, v, "phase3_tiled");
  check_tile(tile);
  const c10::cuda::CUDAGuard guard(p.device());
  const int64_t B = p.size(0), H = p.size(1), Sq = p.size(2), Sk = p.size(3), D = v.size(3);
  at::Tensor o = at::empty({B, H, Sq, D}, v.options());
  launch_tiled_av(static_cast<int>(tile), p.data_ptr<float>(), v.data_ptr<float>(),
                  o.data_ptr<float>(), B * H, Sq, Sk, D, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return o;
}

// The three kernels composed: S = scale Q K^T, P = softmax(S + mask) in place, O = P V.
// Extra memory: one [B, H, Sq, Sk] float32 buffer.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, bool is_causal, double scale,
                     int64_t tile) {
  course::check_qkv(q, k, v, at::kFloat);
  course::check_unfused_head_dim(q.size(3), "q", "phase3_tiled");
  check_tile(tile);
  at::Tensor s = matmul_qk(q, k, scale, tile);
  const c10::cuda::CUDAGuard guard(q.device());
  softmax_into(s, s, mask, is_causal);
  return matmul_av(s, v, tile);
}

}  // namespace
}  // namespace phase3_tiled

TORCH_LIBRARY(phase3_tiled, m) {
  m.def("matmul_qk(Tensor q, Tensor k, float scale, int tile) -> Tensor");
  m.def("softmax(Tensor s, Tensor? mask, bool is_causal) -> Tensor");
  m.def("matmul_av(Tensor p, Tensor v, int tile) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale, "
        "int tile) -> Tensor");
}

TORCH_LIBRARY_IMPL(phase3_tiled, CUDA, m) {
  m.impl("matmul_qk", &phase3_tiled::matmul_qk);
  m.impl("softmax", &phase3_tiled::softmax);
  m.impl("matmul_av", &phase3_tiled::matmul_av);
  m.impl("attention", &phase3_tiled::attention);
}
