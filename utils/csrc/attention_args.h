// Host-side validation shared by every attention op of the course: shapes, dtypes, devices and
// the mask's broadcast view. Each check names the argument it rejects.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "attention_mask.cuh"

namespace course {

struct AttentionShape {
  int64_t B, H, Sq, Sk, D;
};

// Grouped-query attention (MQA when H_kv = 1): H query heads share H_kv KV heads, query head h
// reads KV head h / (H / H_kv). H must be a multiple of H_kv; `name` is the tensor that holds H_kv
// in its dimension 1. Returns the group size H / H_kv.
inline int64_t check_kv_heads(int64_t H, int64_t H_kv, const char* name = "k") {
  TORCH_CHECK(H_kv >= 1 && H % H_kv == 0, "q's heads H=", H, " must be a multiple of ", name,
              "'s KV heads H_kv=", H_kv, " (", name, ".shape[1])");
  return H / H_kv;
}

// A sliding window (with causal masking): query i sees keys j with i - window < j <= i. An op takes
// window = 0 for none. Returns the window the kernel applies: 0 (none) also when window >= Sq,
// since then no row i < Sq loses a key j >= 0.
inline int64_t check_window(int64_t window, bool causal, int64_t Sq) {
  TORCH_CHECK(window >= 0, "window must be >= 1 (or 0 for no window), got ", window);
  TORCH_CHECK(window == 0 || causal, "window=", window, " needs is_causal=True (query i sees keys ",
              "i - window < j <= i)");
  return window >= Sq ? 0 : window;
}

// q [B,H,Sq,D], k [B,H,Sk,D], v [B,H,Sk,D]: CUDA, contiguous, of `dtype`, same device.
// grouped: k and v may have H_kv heads instead of H (check_kv_heads). rows_contiguous: only the
// rows (D) need be contiguous, any other strides (a kernel that reads them checks what else it needs).
inline AttentionShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                at::ScalarType dtype, bool grouped = false, bool rows_contiguous = false) {
  const at::Tensor* tensors[] = {&q, &k, &v};
  const char* names[] = {"q", "k", "v"};
  for (int t = 0; t < 3; ++t) {
    const at::Tensor& x = *tensors[t];
    TORCH_CHECK(x.is_cuda(), names[t], " must be a CUDA tensor, got device ", x.device());
    TORCH_CHECK(x.scalar_type() == dtype, names[t], " must be ", dtype, ", got ", x.scalar_type());
    TORCH_CHECK(x.dim() == 4, names[t], " must be 4-D [B, H, S, D], got ", x.sizes());
    if (rows_contiguous) {
      TORCH_CHECK(x.stride(3) == 1, names[t], "'s last dim (D) must be contiguous (stride 1), got strides ",
                  x.strides());
    } else {
      TORCH_CHECK(x.is_contiguous(), names[t], " must be contiguous");
    }
    TORCH_CHECK(x.device() == q.device(), names[t], " must be on the same device as q");
  }
  const AttentionShape s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  TORCH_CHECK(k.size(0) == s.B && (grouped || k.size(1) == s.H), "k must have q's batch and heads, got ",
              k.sizes(), " for q ", q.sizes());
  if (grouped) check_kv_heads(s.H, k.size(1));
  TORCH_CHECK(k.size(3) == s.D, "k must have q's head dim D=", s.D, ", got ", k.size(3));
  TORCH_CHECK(v.sizes() == k.sizes(), "v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(s.Sq > 0 && s.Sk > 0 && s.B > 0 && s.H > 0, "q, k, v must not be empty");
  return s;
}

// key_lengths [B] (int32 or int64, on q's device) as the kernels read it: clamped to [0, Sk] (a
// length past Sk means every key, a negative one none) and converted to int32, a few bytes per
// batch. An undefined tensor when there is none.
inline at::Tensor clamped_key_lengths(const c10::optional<at::Tensor>& key_lengths, const AttentionShape& s,
                                      const at::Tensor& q) {
  if (!key_lengths.has_value() || !key_lengths->defined()) return at::Tensor();
  const at::Tensor& kl = *key_lengths;
  TORCH_CHECK(kl.is_cuda() && kl.device() == q.device(), "key_lengths must be on q's device");
  TORCH_CHECK(kl.scalar_type() == at::kInt || kl.scalar_type() == at::kLong,
              "key_lengths must be int32 or int64, got ", kl.scalar_type());
  TORCH_CHECK(kl.dim() == 1 && kl.size(0) == s.B, "key_lengths must be [B] = [", s.B, "], got ", kl.sizes());
  return kl.clamp(0, s.Sk).to(at::kInt).contiguous();
}

// Broadcast view of an optional mask: bool (true = attend) or float32 (added to the scores).
inline MaskView make_mask_view(const c10::optional<at::Tensor>& mask, const AttentionShape& s,
                               const at::Tensor& q) {
  MaskView view;
  if (!mask.has_value() || !mask->defined()) return view;
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.is_cuda() && m.device() == q.device(), "mask must be on q's device");
  TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat,
              "mask must be bool or float32, got ", m.scalar_type());
  TORCH_CHECK(m.dim() <= 4, "mask must broadcast to [B, H, Sq, Sk], got ", m.sizes());
  const int64_t target[4] = {s.B, s.H, s.Sq, s.Sk};
  int64_t strides[4] = {0, 0, 0, 0};
  const int64_t pad = 4 - m.dim();
  for (int64_t d = 0; d < m.dim(); ++d) {
    const int64_t size = m.size(d);
    TORCH_CHECK(size == target[d + pad] || size == 1, "mask of shape ", m.sizes(),
                " does not broadcast to [B, H, Sq, Sk] = [", s.B, ", ", s.H, ", ", s.Sq, ", ",
                s.Sk, "]");
    strides[d + pad] = size == 1 ? 0 : m.stride(d);
  }
  view.ptr = m.data_ptr();
  view.kind = m.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
  view.stride_b = strides[0];
  view.stride_h = strides[1];
  view.stride_q = strides[2];
  view.stride_k = strides[3];
  return view;
}

inline AttentionMasking make_masking(const c10::optional<at::Tensor>& mask, bool causal,
                                     int64_t stride, const AttentionShape& s, const at::Tensor& q) {
  TORCH_CHECK(stride >= 1, "stride must be >= 1, got ", stride);
  AttentionMasking m;
  m.mask = make_mask_view(mask, s, q);
  m.causal = causal;
  m.stride = static_cast<int>(stride);
  return m;
}

// The unfused phases (2-4) share one contract for their separate kernels: float32 4-D operands
// and head dims 1..128 (their kernels have no limit of their own; the cap keeps every phase
// interchangeable behind the same API). `phase` names the phase in the message.
constexpr int64_t kUnfusedMaxHeadDim = 128;

inline void check_unfused_head_dim(int64_t D, const char* name, const char* phase) {
  TORCH_CHECK(D >= 1 && D <= kUnfusedMaxHeadDim, "head dim D=", D, " (", name, ".shape[-1]) is not supported: ",
              phase, " supports 1 <= D <= ", kUnfusedMaxHeadDim);
}

inline void check_float4d(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 4, name, " must be 4-D, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(x.numel() > 0, name, " must not be empty");
}

// The operands of S = scale * q k^T: q [B, H, Sq, D], k [B, H, Sk, D].
inline void check_qk_operands(const at::Tensor& q, const at::Tensor& k, const char* phase) {
  check_float4d(q, "q");
  check_float4d(k, "k");
  TORCH_CHECK(k.device() == q.device(), "k must be on q's device");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "k must be [B, H, Sk, D] matching q ", q.sizes(), ", got ", k.sizes());
  check_unfused_head_dim(q.size(3), "q", phase);
}

// The operands of O = P v: p [B, H, Sq, Sk], v [B, H, Sk, D].
inline void check_av_operands(const at::Tensor& p, const at::Tensor& v, const char* phase) {
  check_float4d(p, "p");
  check_float4d(v, "v");
  TORCH_CHECK(v.device() == p.device(), "v must be on p's device");
  TORCH_CHECK(v.size(0) == p.size(0) && v.size(1) == p.size(1) && v.size(2) == p.size(3),
              "v must be [B, H, Sk, D] with p = [B, H, Sq, Sk] = ", p.sizes(), ", got ", v.sizes());
  check_unfused_head_dim(v.size(3), "v", phase);
}

// The scale as kernels that fold c = scale log2 e into the exponent take it: they take the row max
// of the unscaled scores, which needs c > 0. Otherwise the same scores come from a copy of q:
// q -> -q with -scale, and a scale that is zero in FP32 (all scores 0) as q -> 0 with c = 1.
struct FoldedScale {
  at::Tensor q;  // the q the kernel reads: q itself when c > 0
  float c;       // > 0
};
inline FoldedScale fold_scale(const at::Tensor& q, float scale) {
  const float c = scale * 1.4426950408889634f;
  if (c > 0.0f) return {q, c};
  if (-c > 0.0f) return {q.neg(), -c};
  return {at::zeros_like(q), 1.0f};
}

}  // namespace course
