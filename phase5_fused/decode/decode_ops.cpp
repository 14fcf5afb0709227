// Torch op of the decoding lesson (namespace phase5_fused_decode): validation that names the
// argument, the workspaces, then the launch of decode_split.cu or decode_split_tc.cu (and, without
// fused_merge, decode_merge.cu) on the current CUDA stream.
//   attention(q, k_cache, v_cache, cache_lengths, page_table, scale, num_splits, rows_per_block,
//             tensor_cores, stages, fused_merge) -> (out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] float32)
// The values of cache_lengths and page_table are not read here (that would wait for the GPU):
// the kernel checks them and writes NaN rows for a bad sequence (phase5_fused/decode/README.md).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "attention_args.h"
#include "decode.h"
#include "zeroed_counters.h"

namespace {

constexpr int64_t kMaxSq = 16;        // new query tokens per sequence (decode/__init__.py: MAX_SQ)

void check_cache_tensor(const at::Tensor& x, const char* name, const at::Tensor& q) {
  TORCH_CHECK(x.is_cuda() && x.device() == q.device(), name, " must be a CUDA tensor on q's device ", q.device(),
              ", got ", x.device());
  TORCH_CHECK(x.scalar_type() == q.scalar_type(), name, " must have q's dtype ", q.scalar_type(), ", got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 4, name, " must be 4-D, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous (a KV cache is never copied)");
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 == 0, name,
              " must start at a 16-byte aligned address (the kernel copies it in 16-byte pieces)");
}

void check_int_tensor(const at::Tensor& x, const char* name, int64_t dim, const at::Tensor& q) {
  TORCH_CHECK(x.is_cuda() && x.device() == q.device(), name, " must be a CUDA tensor on q's device ", q.device(),
              ", got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kInt, name, " must be int32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == dim, name, " must be ", dim, "-D, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& cache_lengths,
                                             const c10::optional<at::Tensor>& page_table, double scale,
                                             int64_t num_splits, int64_t rows_per_block, bool tensor_cores,
                                             int64_t stages, bool fused_merge) {
  // q [B, H, Sq, D]: CUDA, contiguous, float16 / bfloat16 / float32, 1 <= Sq <= 16, D supported.
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor, got device ", q.device());
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "q must be float16, bfloat16 or float32, got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 4, "q must be 4-D [B, H, Sq, D], got ", q.sizes());
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3);
  TORCH_CHECK(B > 0 && H > 0, "q must not be empty, got ", q.sizes());
  TORCH_CHECK(Sq >= 1 && Sq <= kMaxSq, "q.size(2) (Sq, new tokens per sequence) must be in [1, ", kMaxSq, "], got ",
              Sq);
  TORCH_CHECK(phase5_decode::supported_head_dim(D), "head dim D=", D, " (q.size(3)) is not supported: use 64, 128 or 256");
  TORCH_CHECK(!tensor_cores || ((q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) &&
                                phase5_decode::tensor_core_head_dim(D)),
              "the tensor-core kernel takes float16 or bfloat16 q with D = 64 or 128, got ", q.scalar_type(),
              " and D=", D);

  // k_cache / v_cache: contiguous [B, H_kv, S_max, D] or paged [num_pages, H_kv, page_size, D].
  check_cache_tensor(k_cache, "k_cache", q);
  check_cache_tensor(v_cache, "v_cache", q);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
              v_cache.sizes());
  const int64_t H_kv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D, "k_cache must have q's head dim D=", D, ", got ", k_cache.sizes());
  course::check_kv_heads(H, H_kv, "k_cache");
  const bool paged = page_table.has_value() && page_table->defined();
  int64_t capacity = 0, page_size = 0, max_pages = 0;
  if (paged) {
    page_size = k_cache.size(2);
    TORCH_CHECK(phase5_decode::supported_page_size(page_size), "k_cache.size(2) (page_size) must be 16, 32, 64, 128 "
                "or 256, got ", page_size);
    TORCH_CHECK(k_cache.size(0) > 0, "k_cache must hold at least one page");
    check_int_tensor(*page_table, "page_table", 2, q);
    TORCH_CHECK(page_table->size(0) == B, "page_table must be [B=", B, ", max_pages], got ", page_table->sizes());
    max_pages = page_table->size(1);
    capacity = max_pages * page_size;
  } else {
    TORCH_CHECK(k_cache.size(0) == B, "k_cache must be [B=", B, ", H_kv, S_max, D] (or pass page_table), got ",
                k_cache.sizes());
    capacity = k_cache.size(2);
  }
  TORCH_CHECK(capacity > 0 && capacity <= std::numeric_limits<int>::max(),
              "the cache must hold between 1 and 2^31 - 1 keys per sequence, got ", capacity);
  TORCH_CHECK(k_cache.size(0) <= std::numeric_limits<int>::max(), "k_cache has too many pages: ", k_cache.size(0));
  check_int_tensor(cache_lengths, "cache_lengths", 1, q);
  TORCH_CHECK(cache_lengths.size(0) == B, "cache_lengths must be [B=", B, "], got ", cache_lengths.sizes());

  // Launch geometry, from the caller (decode/__init__.py chooses it).
  TORCH_CHECK(num_splits >= 1 && num_splits <= phase5_decode::kMaxSplits, "num_splits must be in [1, ",
              phase5_decode::kMaxSplits, "], got ", num_splits);
  TORCH_CHECK(rows_per_block >= 1 && rows_per_block <= phase5_decode::kMaxRows, "rows_per_block must be in [1, ",
              phase5_decode::kMaxRows, "], got ", rows_per_block);
  TORCH_CHECK(tensor_cores ? phase5_decode::tensor_core_stages(stages) : stages == phase5_decode::kCudaCoreStages,
              "stages (the split kernel's ring of K/V tiles) must be ",
              tensor_cores ? "2 or 3 for the tensor-core kernel" : "2 for the CUDA-core kernel", ", got ", stages);
  const int64_t rows = (H / H_kv) * Sq;
  TORCH_CHECK(B * H_kv <= 65535 && (rows + rows_per_block - 1) / rows_per_block <= 65535,
              "too many sequences x KV heads (", B * H_kv, ") or query rows per KV head (", rows,
              ") for the grid (65535 each)");

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor o_part, lse_part, arrivals;
  if (num_splits > 1) {
    o_part = at::empty({num_splits, B * H * Sq, D}, q.options().dtype(at::kFloat));
    lse_part = at::empty({num_splits, B * H * Sq}, q.options().dtype(at::kFloat));
    // The in-kernel merge's counters, one per (sequence x KV head, row chunk): zero between calls.
    if (fused_merge)
      arrivals = course::zeroed_counters(B * H_kv * ((rows + rows_per_block - 1) / rows_per_block),
                                         q.get_device(), stream);
  }

  phase5_decode::Params p{};
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.lengths = cache_lengths.data_ptr<int>();
  p.page_table = paged ? page_table->data_ptr<int>() : nullptr;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_part = num_splits > 1 ? o_part.data_ptr<float>() : nullptr;
  p.lse_part = num_splits > 1 ? lse_part.data_ptr<float>() : nullptr;
  p.arrivals = arrivals.defined() ? arrivals.data_ptr<int>() : nullptr;
  p.B = static_cast<int>(B);
  p.H = static_cast<int>(H);
  p.H_kv = static_cast<int>(H_kv);
  p.Sq = static_cast<int>(Sq);
  p.rows = static_cast<int>(rows);
  p.rows_per_block = static_cast<int>(rows_per_block);
  p.num_splits = static_cast<int>(num_splits);
  p.capacity = capacity;
  p.page_shift = 0;
  while (paged && (int64_t{1} << p.page_shift) < page_size) ++p.page_shift;
  p.num_pages = static_cast<int>(k_cache.size(0));
  p.max_pages = static_cast<int>(max_pages);
  p.scale_log2 = static_cast<float>(scale) * 1.4426950408889634f;
  phase5_decode::launch_decode(p, q.scalar_type(), D, paged, tensor_cores, static_cast<int>(stages), stream);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(phase5_fused_decode, m) {
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lengths, Tensor? page_table, "
        "float scale, int num_splits, int rows_per_block, bool tensor_cores, int stages, bool fused_merge) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(phase5_fused_decode, CUDA, m) { m.impl("attention", &attention); }
