// What TMA reads in place: rows contiguous (check_qkv's rows_contiguous), the other strides positive
// multiples of 16 bytes (a dim of size 1 is never stepped over), data 16-byte aligned. hopper_ops.cpp
// checks it before it builds a tensor map; the autograd formula (hopper_autograd.cpp) copies what
// fails it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace hopper {

inline bool tma_strides_ok(const at::Tensor& x) {
  for (int d = 0; d < 3; ++d)
    if (x.size(d) != 1 && (x.stride(d) <= 0 || x.stride(d) * x.element_size() % 16 != 0)) return false;
  return true;
}

inline bool tma_aligned(const at::Tensor& x) { return reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 == 0; }

}  // namespace hopper
