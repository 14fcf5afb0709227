// Host interface of the lesson's intermediate versions of the tensor-core kernel, called by
// tc_ops.cpp (README "Versions"; the fast kernel, tc_attention.h, is the last version):
//   1 tc_v1_mma.cu        mma.sync m16n8k16, fragments read from plain tiles by 32/16-bit loads
//   2 tc_v2_ldmatrix.cu   + ldmatrix.x4 (.trans for V): one instruction per four 8x8 matrices
//   3 tc_v3_swizzle.cu    + XOR-swizzled tiles: ldmatrix without bank conflicts
//   4 tc_v4_cp_async.cu   + cp.async: K/V blocks stream through a ring while the last one computes
//   5 tc_v5_exp2.cu       + the softmax in log2 units: one FFMA and one ex2.approx per score
//   6 tc_v6_lazy.cu       + lazy rescaling: O and l rescaled only where P would pass 2^8
// Each computes out = softmax(scale q k^T) v (causal: top-left aligned, query i sees keys j <= i)
// for q [B, H, Sq, D], k and v [B, H, Sk, D], out shaped like q: contiguous, 16-byte aligned,
// float16 or bfloat16 (checked by the caller), D in {64, 128}; no mask, key padding, grouped heads,
// window or logsumexp (the fast kernel's). Launches on `stream` and checks the launch.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

namespace phase5_tc {

inline bool version_head_dim(int64_t d) { return d == 64 || d == 128; }

using VersionLauncher = void (*)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                                 bool causal, float scale, cudaStream_t stream);

void launch_tc_v1_mma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, bool causal,
                      float scale, cudaStream_t stream);
void launch_tc_v2_ldmatrix(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                           bool causal, float scale, cudaStream_t stream);
void launch_tc_v3_swizzle(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                          bool causal, float scale, cudaStream_t stream);
void launch_tc_v4_cp_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                           bool causal, float scale, cudaStream_t stream);
void launch_tc_v5_exp2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, bool causal,
                       float scale, cudaStream_t stream);
void launch_tc_v6_lazy(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, bool causal,
                       float scale, cudaStream_t stream);

// The launchers in version order: version n (1-based) is kVersionLaunchers[n - 1].
inline constexpr VersionLauncher kVersionLaunchers[] = {launch_tc_v1_mma,      launch_tc_v2_ldmatrix,
                                                        launch_tc_v3_swizzle,  launch_tc_v4_cp_async,
                                                        launch_tc_v5_exp2,     launch_tc_v6_lazy};
inline constexpr int kVersions = sizeof(kVersionLaunchers) / sizeof(kVersionLaunchers[0]);

}  // namespace phase5_tc
