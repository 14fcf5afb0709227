// Phase 5 backward ops (namespace phase5_fused_bwd): validation that names the argument, then the
// preprocessing (D_i) and the backward kernel on the current CUDA stream.
//   attention_backward_fp32(q, k, v, out, lse, dout, dlse, mask, is_causal, scale, stride, key_lengths,
//       variant, window) -> (dq, dk, dv)   float32; variant 0: bwd_fp32.cu (FFMA, every head dim), 1:
//       bwd_tf32x3.cu (3xTF32 tensor cores, D = 32, 64, 96, 128)
//   attention_backward_tc(..., the same arguments) -> (dq, dk, dv)   float16 / bfloat16 (stride must
//       be 1); bwd_tc.cu, variant 0 (4 warps, Bc = 64) or 1 (8 warps, Bc = 128), D up to 128, or
//       bwd_tc_2d.cu, variant 2 (8 warps, FlashAttention-2's two-dimensional warp tiles), every D
//   variant -1 (the schema's default, autograd's): default_variant below.
// window (with is_causal): a sliding window, query i sees keys i - window < j <= i; 0 for none.
// k, v may have H_kv heads (H a multiple of H_kv): the kernels write dK, dV per query head and the op
// sums each group (bwd_prepare.h, sum_over_groups); dk, dv have k's shape.
// out and lse are the forward's outputs (lse: [B, H, Sq] float32, natural log); dlse, optional, is
// the gradient of lse when the caller used it. Head dims: the FP32 forward's own rule (fused.h), and the
// tensor-core kernel's own (bwd.h: every multiple of 8 up to 256, as its forward; variants 0 and 1
// up to 128).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "bwd.h"
#include "bwd_prepare.h"
#include "shared_memory_opt_in.h"

namespace {

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

constexpr int64_t kDefaultVariant = -1;

// The variant that variant -1 runs: at D = 64 and 128, where the variants tables measured a variant
// faster than 0 (causal and not), the fastest of them that this GPU holds: FP32 1 (3xTF32); FP16 and
// BF16 2 where a block may have its shared memory (sm_80, sm_90), else 1 (sm_86, sm_89: 99 KB).
// FP16 and BF16 take the same rule at the tile widths 32 and 96 (the head-dims variants table
// measured variant 2 fastest there too); above D = 128 they run variant 2, the only one that takes
// it. FP32 runs 0 at every other head dim, until measured. q's D is checked later by prepare (0 if
// q is not 4-D).
int64_t default_variant(const at::Tensor& q, bool tensor_cores) {
  const int64_t D = q.dim() == 4 ? q.size(3) : 0;
  if (!tensor_cores) return D == 64 || D == 128 ? 1 : 0;
  if (!phase5_bwd::tc_supports_head_dim(D)) return 0;  // refused by prepare
  if (D > phase5_bwd::kTcRowTileMaxD) return 2;        // the only variant that takes it
  const int limit = course::shared_memory_per_block(c10::cuda::current_device());
  return phase5_bwd::tc_backward_2d_smem_bytes(static_cast<int>(D)) <= limit ? 2 : 1;
}

Grads attention_backward_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                              const c10::optional<at::Tensor>& dlse, const c10::optional<at::Tensor>& mask,
                              bool is_causal, c10::optional<double> scale, int64_t stride,
                              const c10::optional<at::Tensor>& key_lengths,
                              int64_t variant, int64_t window) {
  const c10::cuda::CUDAGuard guard(q.device());
  if (variant == kDefaultVariant) variant = default_variant(q, /*tensor_cores=*/false);
  TORCH_CHECK(variant == 0 || variant == 1, "variant must be 0 (FFMA) or 1 (3xTF32 tensor cores) for the FP32 "
              "backward, or -1 (the default), got ", variant);
  phase5_bwd::Prepared prep =
      phase5_bwd::prepare(q, k, v, out, lse, dout, dlse, mask, is_causal, scale, stride, key_lengths, window,
                          variant == 1 ? phase5_bwd::Kernel::kFp32TensorCores : phase5_bwd::Kernel::kFp32);
  if (variant == 1) {
    phase5_bwd::launch_tf32x3_backward(prep.params, prep.D, c10::cuda::getCurrentCUDAStream());
  } else {
    phase5_bwd::launch_fp32_backward(prep.params, prep.D, c10::cuda::getCurrentCUDAStream());
  }
  return {prep.dq, phase5_bwd::sum_over_groups(prep.dk, k.size(1)), phase5_bwd::sum_over_groups(prep.dv, k.size(1))};
}

Grads attention_backward_tc(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                            const c10::optional<at::Tensor>& dlse, const c10::optional<at::Tensor>& mask,
                            bool is_causal, c10::optional<double> scale, int64_t stride,
                            const c10::optional<at::Tensor>& key_lengths,
                            int64_t variant, int64_t window) {
  const c10::cuda::CUDAGuard guard(q.device());
  if (variant == kDefaultVariant) variant = default_variant(q, /*tensor_cores=*/true);
  TORCH_CHECK(variant >= 0 && variant <= 2, "variant must be 0, 1 or 2 for the tensor-core backward, or -1 (the "
              "default), got ", variant);
  phase5_bwd::Prepared prep = phase5_bwd::prepare(q, k, v, out, lse, dout, dlse, mask, is_causal, scale, stride,
                                                  key_lengths, window, phase5_bwd::Kernel::kTensorCores);
  const phase5_bwd::DType kind =
      q.scalar_type() == at::kHalf ? phase5_bwd::DType::kHalf : phase5_bwd::DType::kBFloat16;
  phase5_bwd::launch_tc_backward(prep.params, prep.D, kind, static_cast<int>(variant),
                                 c10::cuda::getCurrentCUDAStream());
  // The FP32 dQ, converted once at the end; dK, dV summed over each group of query heads.
  return {prep.dq.to(q.scalar_type()), phase5_bwd::sum_over_groups(prep.dk, k.size(1)),
          phase5_bwd::sum_over_groups(prep.dv, k.size(1))};
}

}  // namespace

TORCH_LIBRARY(phase5_fused_bwd, m) {
  for (const char* name : {"attention_backward_fp32", "attention_backward_tc"}) {
    const std::string schema = std::string(name) +
        "(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, Tensor? dlse, Tensor? mask, "
        "bool is_causal, float? scale, int stride, Tensor? key_lengths, int variant=-1, int window=0) -> "
        "(Tensor, Tensor, Tensor)";
    m.def(schema.c_str());
  }
}

TORCH_LIBRARY_IMPL(phase5_fused_bwd, CUDA, m) {
  m.impl("attention_backward_fp32", &attention_backward_fp32);
  m.impl("attention_backward_tc", &attention_backward_tc);
}
