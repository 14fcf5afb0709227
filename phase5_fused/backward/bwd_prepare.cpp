// Phase 5 backward: the checks and allocations every backward op shares (bwd_prepare.h).
#include "bwd_prepare.h"

#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "../fp32/fused.h"
#include "attention_args.h"

namespace phase5_bwd {
namespace {

// D is one of a kernel's compiled head dims.
template <std::size_t N>
bool listed(const int (&dims)[N], int64_t D) {
  for (int d : dims)
    if (d == D) return true;
  return false;
}

// A tensor of q's device, the given dtype and shape, contiguous (rows_contiguous: its last dim only).
void check_like(const at::Tensor& x, const char* name, const at::Tensor& q, at::ScalarType dtype,
                at::IntArrayRef shape, bool rows_contiguous = false) {
  TORCH_CHECK(x.is_cuda() && x.device() == q.device(), name, " must be on q's device ", q.device());
  TORCH_CHECK(x.scalar_type() == dtype, name, " must be ", dtype, ", got ", x.scalar_type());
  TORCH_CHECK(x.sizes() == shape, name, " must have shape ", shape, ", got ", x.sizes());
  if (rows_contiguous) {
    TORCH_CHECK(x.stride(-1) == 1, name, "'s last dim (D) must be contiguous (stride 1), got strides ", x.strides());
  } else {
    TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
  }
}

RowStrides row_strides(const at::Tensor& x) { return {x.stride(0), x.stride(1), x.stride(2)}; }

void check_aligned(const at::Tensor& x, const char* name) {
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 == 0, name,
              " must start at a 16-byte aligned address (the kernel's 16-byte cp.async or TMA loads need it)");
}

}  // namespace

Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                 const at::Tensor& lse, const at::Tensor& dout, const c10::optional<at::Tensor>& dlse,
                 const c10::optional<at::Tensor>& mask, bool is_causal, c10::optional<double> scale,
                 int64_t stride, const c10::optional<at::Tensor>& key_lengths, int64_t window, Kernel kernel,
                 int64_t dq_row_multiple) {
  const bool tc = kernel == Kernel::kTensorCores || kernel == Kernel::kHopper;  // FP16 / BF16
  at::ScalarType dtype = at::kFloat;
  if (tc) {
    dtype = q.scalar_type();
    TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
                "q must be float16 or bfloat16 for the tensor-core backward, got ", dtype);
  }
  // The Hopper kernel reads q, k, v, dout through TMA maps and D_i reads out and dout through their
  // strides: views whose rows are contiguous are read in place (its op checks what TMA needs).
  // Every kernel takes grouped K/V heads (H a multiple of H_kv).
  const bool views = kernel == Kernel::kHopper;
  const course::AttentionShape s = course::check_qkv(q, k, v, dtype, /*grouped=*/true, /*rows_contiguous=*/views);
  if (kernel == Kernel::kTensorCores) {
    TORCH_CHECK(tc_supports_head_dim(s.D), "q: head dim D=", s.D, " is not supported by the tensor-core "
                "backward (a multiple of ", kTcHeadDimStep, " up to ", kTcMaxHeadDim, ")");
    TORCH_CHECK(s.Sq <= std::numeric_limits<int>::max() && s.Sk <= std::numeric_limits<int>::max(),
                "q and k sequence lengths must fit in int32 for the tensor-core backward");
  }
  if (kernel == Kernel::kFp32TensorCores) {
    TORCH_CHECK(listed(kTf32x3SupportedD, s.D), "q: head dim D=", s.D,
                " is not supported by the 3xTF32 backward (variant 1 takes 32, 64, 96, 128): use variant 0");
  }
  if (tc) {
    TORCH_CHECK(stride == 1, "stride must be 1 for the tensor-core backward, got ", stride);
  } else {
    TORCH_CHECK(phase5::fast_supports_head_dim(s.D), "q: head dim D=", s.D, " is not supported by the FP32 "
                "backward (the FP32 forward's: a multiple of ", phase5::kHeadDimStep, " from ",
                phase5::kMinHeadDim, " to ", phase5::kMaxHeadDim, ")");
  }
  check_like(out, "out", q, dtype, q.sizes(), views);
  check_like(dout, "dout", q, dtype, q.sizes(), views);
  const std::vector<int64_t> rows{s.B, s.H, s.Sq};
  check_like(lse, "lse", q, at::kFloat, rows);
  if (dlse.has_value() && dlse->defined()) check_like(*dlse, "dlse", q, at::kFloat, rows);
  if (kernel != Kernel::kFp32) {
    check_aligned(q, "q");
    check_aligned(k, "k");
    check_aligned(v, "v");
    check_aligned(dout, "dout");
  }

  Prepared prep;
  prep.D = static_cast<int>(s.D);
  // dQ collects one part per key block: FP32, zeroed, added to with atomics.
  const int64_t dq_rows = (s.Sq + dq_row_multiple - 1) / dq_row_multiple * dq_row_multiple;
  prep.dq = at::zeros({s.B, s.H, dq_rows, s.D}, q.options().dtype(at::kFloat));
  // dK, dV contiguous, whatever k's layout: k's shape for the Hopper kernel, which sums a group's
  // heads in its registers; one head per query head for the others (sum_over_groups adds them).
  const int64_t H_kv = k.size(1);
  const int64_t dkv_heads = kernel == Kernel::kHopper ? H_kv : s.H;
  prep.dk = at::empty({s.B, dkv_heads, s.Sk, s.D}, k.options());
  prep.dv = at::empty({s.B, dkv_heads, s.Sk, s.D}, v.options());
  prep.delta = at::empty(rows, q.options().dtype(at::kFloat));

  BwdParams& p = prep.params;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.delta = prep.delta.data_ptr<float>();
  p.dq = prep.dq.data_ptr<float>();
  p.dk = prep.dk.data_ptr();
  p.dv = prep.dv.data_ptr();
  p.B = s.B;
  p.H = s.H;
  p.H_kv = H_kv;
  p.Sq = s.Sq;
  p.Sk = s.Sk;
  p.scale = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(s.D)));
  p.masking = course::make_masking(mask, is_causal, stride, s, q);
  p.window = static_cast<int>(course::check_window(window, is_causal, s.Sq));  // < Sq: fits in int
  prep.key_lengths = course::clamped_key_lengths(key_lengths, s, q);
  p.key_lengths = prep.key_lengths.defined() ? prep.key_lengths.data_ptr<int>() : nullptr;

  const DType kind = dtype == at::kFloat  ? DType::kFloat
                                 : dtype == at::kHalf ? DType::kHalf
                                                      : DType::kBFloat16;
  const float* dlse_ptr = dlse.has_value() && dlse->defined() ? dlse->data_ptr<float>() : nullptr;
  launch_preprocess(out.data_ptr(), row_strides(out), dout.data_ptr(), row_strides(dout), dlse_ptr,
                    prep.delta.data_ptr<float>(), s.B, s.H, s.Sq, prep.D, kind, c10::cuda::getCurrentCUDAStream());
  return prep;
}

at::Tensor sum_over_groups(const at::Tensor& per_query_head, int64_t H_kv) {
  const int64_t B = per_query_head.size(0), H = per_query_head.size(1);
  if (H == H_kv) return per_query_head;
  // Query head h belongs to K/V head h / G: the G heads of a group are adjacent.
  return per_query_head.view({B, H_kv, H / H_kv, per_query_head.size(2), per_query_head.size(3)}).sum(2);
}

}  // namespace phase5_bwd
