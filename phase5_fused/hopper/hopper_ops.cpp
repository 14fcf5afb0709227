// Torch ops of the Hopper attention kernels (namespace phase5_fused_hopper): validation that names
// the argument, the TMA tensor maps, then the launch on the current CUDA stream.
//   attention(q, k, v, is_causal, scale, key_lengths, return_lse, version) -> (out, lse)
//       lse is [B, H, Sq] FP32 when return_lse, else an empty tensor. version: 1 to 8 (hopper_v*.cu).
//   attention_inference(...)   the same op without an autograd formula
//   attention_backward(q, k, v, out, lse, dout, dlse, is_causal, scale, key_lengths, variant)
//       -> (dq, dk, dv)   hopper_bwd.cu, after ../backward's checks and D_i (bwd_prepare.h);
//       k, v with H_kv heads (H a multiple of H_kv); q, k, v, dout in any layout TMA reads (check_tma_layout) and out
//       with contiguous rows, such as views of the qkv projection and of [B, S, H, D] (read in place);
//       dq, dk, dv contiguous. variant: 0 (dQ by keys) or 1 (dQ by columns).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>

#include "../backward/bwd_prepare.h"
#include "attention_args.h"
#include "hopper_attention.h"
#include "hopper_tma.h"

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

// The layout TMA reads (hopper_tma.h), or an error naming the argument.
void check_tma_layout(const at::Tensor& x, const char* name) {
  TORCH_CHECK(hopper::tma_strides_ok(x), name, "'s strides must be positive multiples of 16 bytes for TMA, got ",
              x.strides(), ": pass ", name, ".contiguous()");
  TORCH_CHECK(hopper::tma_aligned(x), name, " must start at a 16-byte aligned address (TMA needs it): pass ", name,
              ".clone()");
}

// x [B, H, S, D] as TMA sees it: a 4-D tensor (D, S, H, B) with x's strides and boxes of 64 columns x
// `rows` rows x 1 x 1, written to shared memory with the 128-byte swizzle; out-of-bounds elements
// read as zeros. A dim of size 1 gets a stride of one row: valid for TMA, and never used.
CUtensorMap make_tensor_map(const at::Tensor& x, int rows) {
  const int64_t e = x.element_size();
  auto stride_bytes = [&](int d) { return static_cast<cuuint64_t>((x.size(d) == 1 ? x.size(3) : x.stride(d)) * e); };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(x.size(3)), static_cast<cuuint64_t>(x.size(2)),
                              static_cast<cuuint64_t>(x.size(1)), static_cast<cuuint64_t>(x.size(0))};
  const cuuint64_t strides[3] = {stride_bytes(2), stride_bytes(1), stride_bytes(0)};  // bytes: S, head, batch
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = encode_tiled()(
      &map, x.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
      x.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r), ") for shape ",
              x.sizes(), " and strides ", x.strides());
  return map;
}

// The kernels index rows and (batch, head) pairs with 32-bit integers.
void check_fits_int32(int64_t B, int64_t H, int64_t Sq, int64_t Sk) {
  TORCH_CHECK(Sq <= std::numeric_limits<int>::max() && Sk <= std::numeric_limits<int>::max() &&
                  B * H <= std::numeric_limits<int>::max(),
              "q and k sequence lengths and B * H must fit in int32");
}

// The kernels are compiled for sm_90a only.
void check_hopper_gpu() {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major == 9 && prop->minor == 0, "the Hopper attention kernel needs a Hopper GPU (sm_90: "
              "TMA, wgmma, setmaxnreg); this GPU is sm_", prop->major, prop->minor);
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             bool is_causal, double scale,
                                             const c10::optional<at::Tensor>& key_lengths, bool return_lse,
                                             int64_t version) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q must be float16 or bfloat16 for the Hopper kernel, got ", q.scalar_type());
  const course::AttentionShape s =
      course::check_qkv(q, k, v, q.scalar_type(), /*grouped=*/true, /*rows_contiguous=*/true);
  TORCH_CHECK(hopper::supported_head_dim(s.D), "head dim D=", s.D, " (q.size(3)) is not supported: use 64 or 128");
  TORCH_CHECK(version >= 1 && version <= hopper::kVersions, "version must be 1 to ", hopper::kVersions, ", got ",
              version);
  check_fits_int32(s.B, s.H, s.Sq, s.Sk);
  TORCH_CHECK(s.B <= 65535 && s.H <= 65535, "q must have at most 65535 batches and heads (grid limits), got ",
              q.sizes());
  check_tma_layout(q, "q");
  check_tma_layout(k, "k");
  check_tma_layout(v, "v");

  const c10::cuda::CUDAGuard guard(q.device());
  check_hopper_gpu();

  const at::Tensor lengths = course::clamped_key_lengths(key_lengths, s, q);
  // o in q's layout family: [B, Sq, H, D] memory seen as [B, H, Sq, D] when q's heads are interleaved
  // within a position (heads split from [B, S, H * D] activations: merging them back is then free),
  // else contiguous [B, H, Sq, D]. The op's fake (__init__.py) follows the same rule.
  const bool heads_inner = q.stride(1) < q.stride(2);
  at::Tensor out = heads_inner ? at::empty({s.B, s.Sq, s.H, s.D}, q.options()).transpose(1, 2)
                               : at::empty({s.B, s.H, s.Sq, s.D}, q.options());
  at::Tensor lse = return_lse ? at::empty({s.B, s.H, s.Sq}, q.options().dtype(at::kFloat))
                              : at::empty({0}, q.options().dtype(at::kFloat));

  // The kernels fold c = scale log2 e into the exponent (course::fold_scale: c > 0).
  const course::FoldedScale folded = course::fold_scale(q, static_cast<float>(scale));

  const int D = static_cast<int>(s.D);
  const hopper::TileSize tile = hopper::tile_size(static_cast<int>(version), D);
  hopper::Params p{};
  p.q_map = make_tensor_map(folded.q, tile.rows);
  p.k_map = make_tensor_map(k, tile.keys);
  p.v_map = make_tensor_map(v, tile.keys);
  p.o = out.data_ptr();
  p.o_stride_b = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.o_stride_s = out.stride(2);
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  p.key_lengths = lengths.defined() ? lengths.data_ptr<int>() : nullptr;
  p.B = static_cast<int>(s.B);
  p.H = static_cast<int>(s.H);
  p.H_kv = static_cast<int>(k.size(1));
  p.Sq = static_cast<int>(s.Sq);
  p.Sk = static_cast<int>(s.Sk);
  p.scale_log2 = folded.c;
  p.causal = is_causal ? 1 : 0;
  const auto dtype = q.scalar_type() == at::kBFloat16 ? hopper::Dtype::kBFloat16 : hopper::Dtype::kFloat16;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (version == 1) {
    hopper::launch_v1(p, D, dtype, stream);
  } else if (version == 2) {
    hopper::launch_v2(p, D, dtype, stream);
  } else if (version == 3) {
    hopper::launch_v3(p, D, dtype, stream);
  } else if (version == 4) {
    hopper::launch_v4(p, D, dtype, stream);
  } else if (version == 5) {
    hopper::launch_v5(p, D, dtype, stream);
  } else if (version == 6) {
    hopper::launch_v6(p, D, dtype, stream);
  } else if (version == 7) {
    hopper::launch_v7(p, D, dtype, stream);
  } else {
    hopper::launch_v8(p, D, dtype, stream);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& dout, const c10::optional<at::Tensor>& dlse, bool is_causal, c10::optional<double> scale,
    const c10::optional<at::Tensor>& key_lengths, int64_t variant) {
  const c10::cuda::CUDAGuard guard(q.device());
  check_hopper_gpu();
  // Checks, dk, dv, the zeroed dQ accumulator (whole kBwdBr-row tiles) and D_i on this stream; then
  // what only this kernel needs.
  phase5_bwd::Prepared prep = phase5_bwd::prepare(q, k, v, out, lse, dout, dlse, c10::nullopt, is_causal, scale, 1,
                                                  key_lengths, /*window=*/0, phase5_bwd::Kernel::kHopper,
                                                  hopper::kBwdBr);
  const phase5_bwd::BwdParams& b = prep.params;
  TORCH_CHECK(hopper::supported_head_dim(prep.D), "head dim D=", prep.D,
              " (q.size(3)) is not supported by the Hopper backward: use 64 or 128");
  check_fits_int32(b.B, b.H, b.Sq, b.Sk);
  check_tma_layout(q, "q");
  check_tma_layout(k, "k");
  check_tma_layout(v, "v");
  check_tma_layout(dout, "dout");
  hopper::BwdParams p;
  p.q_map = make_tensor_map(q, hopper::kBwdBr);
  p.k_map = make_tensor_map(k, hopper::kBwdBc);
  p.v_map = make_tensor_map(v, hopper::kBwdBc);
  p.do_map = make_tensor_map(dout, hopper::kBwdBr);
  p.lse = b.lse;
  p.delta = b.delta;
  p.dq_accum = prep.dq.data_ptr<float>();
  p.dk = b.dk;
  p.dv = b.dv;
  p.key_lengths = b.key_lengths;
  p.B = static_cast<int>(b.B);
  p.H = static_cast<int>(b.H);
  p.H_kv = static_cast<int>(k.size(1));
  p.Sq = static_cast<int>(b.Sq);
  p.Sk = static_cast<int>(b.Sk);
  p.n_qblocks = static_cast<int>(prep.dq.size(2) / hopper::kBwdBr);
  p.scale = b.scale;
  p.causal = is_causal ? 1 : 0;
  const auto dtype = q.scalar_type() == at::kBFloat16 ? hopper::Dtype::kBFloat16 : hopper::Dtype::kFloat16;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  hopper::launch_backward(p, prep.D, static_cast<int>(variant), dtype, stream);
  at::Tensor dq = at::empty(q.sizes(), q.options());  // contiguous (empty_like would keep a view's order)
  hopper::launch_dq_convert(p.dq_accum, dq.data_ptr(), b.B * b.H, p.Sq, prep.D, static_cast<int>(variant),
                            p.n_qblocks, p.scale, dtype, stream);
  return {dq, prep.dk, prep.dv};
}

}  // namespace

TORCH_LIBRARY(phase5_fused_hopper, m) {
  // The forward twice: attention is differentiable (its autograd formula, registered in Python, runs
  // on every call), attention_inference has none, so a call that records no gradient reaches the
  // kernel without a trip through Python.
  for (const char* name : {"attention", "attention_inference"}) {
    const std::string schema = std::string(name) +
        "(Tensor q, Tensor k, Tensor v, bool is_causal, float scale, Tensor? key_lengths, "
        "bool return_lse, int version) -> (Tensor, Tensor)";
    m.def(schema.c_str());
  }
  m.def("attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, Tensor? dlse, "
        "bool is_causal, float? scale, Tensor? key_lengths, int variant) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(phase5_fused_hopper, CUDA, m) {
  m.impl("attention", &attention);
  m.impl("attention_inference", &attention);
  m.impl("attention_backward", &attention_backward);
}
