// Host interface of the decoding kernels (decode_split.cu, decode_split_tc.cu, decode_merge.cu; the
// merge itself in decode_merge.cuh), called by decode_ops.cpp.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>
#include <cuda_runtime.h>

namespace phase5_decode {

// Head dims with a compiled kernel (decode/__init__.py's SUPPORTED_D names the same set).
inline bool supported_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// Page sizes (keys per page) a paged cache may use: powers of two, so a key's page and its slot in
// the page are a shift and a mask (decode/__init__.py's PAGE_SIZES names the same set).
inline bool supported_page_size(int64_t n) { return n == 16 || n == 32 || n == 64 || n == 128 || n == 256; }

// The most query rows (query heads x new tokens of one KV head) one block of the split kernel
// holds; more rows are cut into chunks of the grid's z axis.
constexpr int kMaxRows = 16;

// The most key ranges (splits) one sequence is cut into (decode/__init__.py's MAX_SPLITS): the
// merge kernel keeps one weight per split in shared memory.
constexpr int kMaxSplits = 1024;

// Everything both kernels read. Rows: the B * H * Sq query rows in q's order, so the rows that read
// KV head hk of sequence b are the R = (H / H_kv) * Sq consecutive rows from (b * H_kv + hk) * R on.
struct Params {
  const void* q;            // [B, H, Sq, D]
  const void* k;            // contiguous [B, H_kv, S_max, D], or paged [num_pages, H_kv, page_size, D]
  const void* v;            // same layout as k
  const int* lengths;       // [B] valid keys per sequence
  const int* page_table;    // [B, max_pages], or nullptr for a contiguous cache
  void* out;                // [B, H, Sq, D] in q's dtype
  float* lse;               // [B, H, Sq] natural logsumexp of each row
  float* o_part;            // [num_splits, B * H * Sq, D] each split's normalised output (num_splits > 1)
  float* lse_part;          // [num_splits, B * H * Sq] each split's logsumexp in base 2 (num_splits > 1)
  int* arrivals;            // [B * H_kv, row chunks] splits finished per row group, at zero between calls, for
                            // the in-kernel merge (num_splits > 1); nullptr: the merge kernel runs instead
  int B, H, H_kv, Sq;
  int rows;                 // R = (H / H_kv) * Sq rows per KV head
  int rows_per_block;       // R_c <= kMaxRows
  int num_splits;
  int64_t capacity;         // keys one sequence can hold: S_max, or max_pages * page_size
  int page_shift;           // log2(page_size) (paged)
  int num_pages, max_pages; // (paged)
  float scale_log2;         // scale * log2(e): scores in base 2, so exp2 replaces exp
};

// Head dims and dtypes of the tensor-core split kernel (decode/__init__.py's TENSOR_CORE_D and
// TENSOR_CORE_DTYPES name the same sets).
inline bool tensor_core_head_dim(int64_t d) { return d == 64 || d == 128; }

// Stages of the split kernels' cp.async ring of K and V tiles (decode_stream.cuh). The CUDA-core
// kernel has two; the tensor-core kernel is compiled with 2 and 3, and the caller picks the deepest
// the device's shared memory per block holds (decode/__init__.py: CUDA_CORE_STAGES,
// TENSOR_CORE_STAGES, choose_stages).
constexpr int kCudaCoreStages = 2;
inline bool tensor_core_stages(int64_t s) { return s == 2 || s == 3; }

// One decoding step. Shapes, dtypes, devices and stages are checked by the caller; o_part / lse_part are
// fp32 workspaces when p.num_splits > 1. Launches the split kernel (on tensor cores if asked,
// decode_split_tc.cu, with a ring of `stages` stages; the CUDA-core kernel takes kCudaCoreStages),
// which with num_splits > 1 also merges the splits where p.arrivals is set; where it is not, the
// merge kernel follows. On `stream`; each launch is checked.
void launch_decode(const Params& p, at::ScalarType dtype, int64_t D, bool paged, bool tensor_cores, int stages,
                   cudaStream_t stream);

// The tensor-core split kernel alone (FP16/BF16, tensor_core_head_dim, tensor_core_stages).
void launch_split_tc(const Params& p, at::ScalarType dtype, int64_t D, bool paged, int stages, cudaStream_t stream);

// The merge alone (decode_merge.cu): out and lse from the p.num_splits partials.
void launch_merge(const Params& p, at::ScalarType dtype, int64_t D, cudaStream_t stream);

}  // namespace phase5_decode
