// Torch op of the Hopper attention kernels (namespace phase5_fused_hopper): validation that names
// the argument, the TMA tensor maps, then the launch of one version on the current CUDA stream.
//   attention(q, k, v, is_causal, scale, key_lengths, return_lse, version) -> (out, lse)
// lse is [B, H, Sq] FP32 when return_lse, else an empty tensor. version: 1 to 4 (hopper_v*.cu).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "attention_args.h"
#include "hopper_attention.h"

namespace {

// cuTensorMapEncodeTiled is a driver API function: fetched through the runtime, so that the
// extension needs no -lcuda at link time.
using EncodeTiled = decltype(&cuTensorMapEncodeTiled);

EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                                    &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && ptr != nullptr,
                "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs a CUDA 12+ driver)");
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

// x [B, H, S, D] as TMA sees it: a 3-D tensor (D, S, B*H) with boxes of 64 columns x `rows` rows,
// written to shared memory with the 128-byte swizzle; out-of-bounds elements read as zeros.
CUtensorMap make_tensor_map(const at::Tensor& x, int rows) {
  const uint64_t D = x.size(3), S = x.size(2), BH = x.size(0) * x.size(1);
  const cuuint64_t dims[3] = {D, S, BH};
  const cuuint64_t strides[2] = {D * x.element_size(), S * D * x.element_size()};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult r = encode_tiled()(
      &map, x.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
      x.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r), ") for shape ",
              x.sizes());
  return map;
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             bool is_causal, double scale,
                                             const c10::optional<at::Tensor>& key_lengths, bool return_lse,
                                             int64_t version) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q must be float16 or bfloat16 for the Hopper kernel, got ", q.scalar_type());
  const course::AttentionShape s = course::check_qkv(q, k, v, q.scalar_type());
  TORCH_CHECK(hopper::supported_head_dim(s.D), "head dim D=", s.D, " (q.size(3)) is not supported: use 64 or 128");
  TORCH_CHECK(version >= 1 && version <= 4, "version must be 1, 2, 3 or 4, got ", version);
  TORCH_CHECK(s.Sq <= std::numeric_limits<int>::max() && s.Sk <= std::numeric_limits<int>::max() &&
                  s.B * s.H <= std::numeric_limits<int>::max(),
              "q and k sequence lengths and B * H must fit in int32");
  TORCH_CHECK(s.B <= 65535 && s.H <= 65535, "q must have at most 65535 batches and heads (grid limits), got ",
              q.sizes());
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(reinterpret_cast<std::uintptr_t>(x->data_ptr()) % 16 == 0,
                "q, k and v must start at 16-byte aligned addresses (TMA needs it): pass x.clone()");

  const c10::cuda::CUDAGuard guard(q.device());
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major == 9 && prop->minor == 0, "the Hopper attention kernel needs a Hopper GPU (sm_90: "
              "TMA, wgmma, setmaxnreg); this GPU is sm_", prop->major, prop->minor);

  at::Tensor lengths;
  if (key_lengths.has_value() && key_lengths->defined()) {
    const at::Tensor& kl = *key_lengths;
    TORCH_CHECK(kl.is_cuda() && kl.device() == q.device(), "key_lengths must be on q's device");
    TORCH_CHECK(kl.scalar_type() == at::kInt || kl.scalar_type() == at::kLong,
                "key_lengths must be int32 or int64, got ", kl.scalar_type());
    TORCH_CHECK(kl.dim() == 1 && kl.size(0) == s.B, "key_lengths must be [B] = [", s.B, "], got ", kl.sizes());
    // Lengths past Sk mean "all keys", negative ones "no key": clamp, then int32 for the kernel.
    lengths = kl.clamp(0, s.Sk).to(at::kInt).contiguous();
  }
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor lse = return_lse ? at::empty({s.B, s.H, s.Sq}, q.options().dtype(at::kFloat))
                              : at::empty({0}, q.options().dtype(at::kFloat));

  // The kernels fold c = scale log2 e into the exponent and take the row max of the unscaled
  // scores, which needs c > 0. Otherwise, the same scores from a copy of q: q -> -q with -scale,
  // and a scale that is zero in FP32 (all scores 0) as q -> 0 with c = 1.
  float c = static_cast<float>(scale) * 1.4426950408889634f;
  at::Tensor q_in = q;
  if (!(c > 0.0f)) {
    c = -c;
    q_in = c > 0.0f ? q.neg() : at::zeros_like(q);
    if (!(c > 0.0f)) c = 1.0f;
  }

  hopper::Params p;
  p.q_map = make_tensor_map(q_in, hopper::kBM);
  p.k_map = make_tensor_map(k, hopper::kBN);
  p.v_map = make_tensor_map(v, hopper::kBN);
  p.o = out.data_ptr();
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  p.key_lengths = lengths.defined() ? lengths.data_ptr<int>() : nullptr;
  p.B = static_cast<int>(s.B);
  p.H = static_cast<int>(s.H);
  p.H_kv = static_cast<int>(k.size(1));
  p.Sq = static_cast<int>(s.Sq);
  p.Sk = static_cast<int>(s.Sk);
  p.scale_log2 = c;
  p.causal = is_causal ? 1 : 0;
  const auto dtype = q.scalar_type() == at::kBFloat16 ? hopper::Dtype::kBFloat16 : hopper::Dtype::kFloat16;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int D = static_cast<int>(s.D);
  if (version == 1) {
    hopper::launch_v1(p, D, dtype, stream);
  } else if (version == 2) {
    hopper::launch_v2(p, D, dtype, stream);
  } else if (version == 3) {
    hopper::launch_v3(p, D, dtype, stream);
  } else {
    hopper::launch_v4(p, D, dtype, stream);
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(phase5_fused_hopper, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, bool is_causal, float scale, Tensor? key_lengths, "
        "bool return_lse, int version) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(phase5_fused_hopper, CUDA, m) { m.impl("attention", &attention); }
