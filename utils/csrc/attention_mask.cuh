// What every attention kernel of the course needs to know about which keys a query may see:
// an optional mask (boolean or additive, broadcastable to [B, H, Sq, Sk]), causal masking with
// torch SDPA's alignment (query i sees keys j <= i), and strided sparse attention (query i sees
// keys j with j % stride == 0). Shared by phases 2-5 so that every kernel means the same thing.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>
#include <cmath>

namespace course {

enum class MaskKind : int { kNone = 0, kBool = 1, kAdditive = 2 };

// A broadcast view of the user's mask: element (b, h, i, j) lives at
// ptr[b*stride_b + h*stride_h + i*stride_q + j*stride_k]; broadcast dimensions have stride 0.
struct MaskView {
  const void* ptr = nullptr;
  MaskKind kind = MaskKind::kNone;
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_k = 0;
};

// Everything that decides whether score (i, j) is kept, and what is added to it.
struct AttentionMasking {
  MaskView mask;
  bool causal = false;
  int stride = 1;  // 1: dense
};

// The additive term for score (b, h, i, j): 0 when visible, -inf when hidden, or the user's
// additive mask value. Causal and stride hide before the user's mask is consulted.
__device__ __forceinline__ float mask_bias(const AttentionMasking& m, int64_t b, int64_t h,
                                           int64_t i, int64_t j) {
  if (m.causal && j > i) return -INFINITY;
  if (m.stride > 1 && (j % m.stride) != 0) return -INFINITY;
  if (m.mask.kind == MaskKind::kNone) return 0.0f;
  const int64_t offset =
      b * m.mask.stride_b + h * m.mask.stride_h + i * m.mask.stride_q + j * m.mask.stride_k;
  if (m.mask.kind == MaskKind::kBool)
    return static_cast<const bool*>(m.mask.ptr)[offset] ? 0.0f : -INFINITY;
  return static_cast<const float*>(m.mask.ptr)[offset];
}

}  // namespace course
