// Tags shared by host code (ops.cpp, a plain C++ file) and the kernels (.cu files).
#pragma once

namespace phase6 {

// Storage dtypes the kernels take; ops.cpp maps at::ScalarType onto these.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Activation applied elementwise or in a GEMM epilogue.
enum class Activation : int { kNone = 0, kGeluTanh = 1, kGeluErf = 2 };

}  // namespace phase6
