// Flash-decoding: the split kernel (and, by default, the merge of its splits).
//
// A decoding step has few query rows (Sq new tokens x H query heads) and a long KV cache. One block
// per (sequence, head) would leave most of the GPU idle (B * H_kv blocks for 132 SMs), so the keys
// of each sequence are cut into num_splits contiguous ranges and the grid is
//
//     (split s, sequence b x KV head hk, row chunk)
//
// Block (s, b * H_kv + hk, c) owns KV head hk of sequence b and the query rows that read it: the
// G = H / H_kv query heads x Sq new tokens (R = G * Sq rows, up to kMaxRows of them per block). It
// streams its key range of K and V through shared memory once (cp.async, 16-byte copies, double
// buffered: kStages = 2), runs the online softmax in FP32 with exp2 (scores pre-scaled by log2(e)), and writes
// its rows' partial output O_s = sum_j p_j v_j / l and logsumexp lse_s = m + log2(l) (base 2).
// The block that finishes a row group last merges its splits (decode_merge.cuh merge_if_last), or
// the merge kernel decode_merge.cu does; with one split this kernel writes the final output itself.
//
// Masking is bottom-right causal: the Sq queries are the last Sq tokens of a sequence of L keys,
// so query i sees keys j <= L - Sq + i (L >= Sq). Math runs on CUDA cores: a decoding step does
// 2 R D multiply-adds per key against 2 D elements read, too little work per byte for tensor
// cores to matter while R is small (README: where they would).
#include <cmath>

#include "decode.h"
#include "decode_common.cuh"
#include "decode_merge.cuh"
#include "decode_stream.cuh"

namespace phase5_decode {
namespace {

// Shared-memory stages of K and V: two. This kernel is bound by its instruction issue, not by the
// loads in flight (README "Why about half"), so the deeper ring of decode_split_tc.cu would buy it
// nothing but shared memory (and blocks per SM).
constexpr int kStages = kCudaCoreStages;

// The K/V tile (decode_stream.cuh) and how this kernel's threads share its work.
template <typename T, int D>
struct Tile : KvTile<T, D, false> {
  using KvTile<T, D, false>::kBc;
  // Scores: thread t takes key t % kBc and the rows r = t / kBc + n * kThreadsPerKey.
  static constexpr int kThreadsPerKey = kThreads / kBc;
  static constexpr int kScoreRows = kMaxRows / kThreadsPerKey;
  // Softmax and P V: a group of kGroup threads owns a row, each thread kPvWidth of its D outputs
  // (a warp per row from D = 128 on, so that 4 rows keep the 4 warps busy); group g owns the rows
  // r = g + n * kRowGroups.
  static constexpr int kPvWidth = D / 32 > 4 ? D / 32 : 4;
  static constexpr int kGroup = D / kPvWidth;
  static constexpr int kRowGroups = kThreads / kGroup;
  static constexpr int kPvRows = (kMaxRows + kRowGroups - 1) / kRowGroups;
  // Scores row stride, padded by kGroup floats: the groups of a warp reading one key's
  // probability from their own rows hit different banks.
  static constexpr int kSStride = kBc + kGroup;

  static_assert(kThreads % kBc == 0 && kMaxRows % kThreadsPerKey == 0, "score threads cover the tile evenly");
  static_assert(kGroup <= 32 && 32 % kGroup == 0, "a row's group of threads lies inside one warp");
  static_assert(merge_smem_bytes(kThreads / 32) <= 2 * kCudaCoreStages * KvTile<T, D, false>::kTileElems * sizeof(T),
                "the in-kernel merge fits in the K/V tiles");
};

template <typename T, int D>
constexpr size_t smem_bytes(int rows_per_block) {
  using Tl = Tile<T, D>;
  // K and V, kStages each; the block's queries (FP32); its scores / probabilities (FP32).
  return 2 * kStages * Tl::kTileElems * sizeof(T) + static_cast<size_t>(rows_per_block) * (D + Tl::kSStride) * sizeof(float);
}

// Maximum (op = max) or sum over the kGroup lanes of a row's group (aligned lanes of one warp).
template <int kGroup>
__device__ __forceinline__ float group_max(float x, unsigned mask) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(mask, x, offset));
  return x;
}

template <int kGroup>
__device__ __forceinline__ float group_sum(float x, unsigned mask) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(mask, x, offset);
  return x;
}

template <typename T, int D, bool kPaged>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const Params p) {
  using Tl = Tile<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);                                     // [kStages][kBc][kStride]
  T* sV = sK + kStages * Tl::kTileElems;                                  // [kStages][kBc][kStride]
  float* sQ = reinterpret_cast<float*>(sV + kStages * Tl::kTileElems);    // [R_c][D]
  float* sS = sQ + p.rows_per_block * D;                            // [R_c][kSStride]

  const int tid = threadIdx.x;
  const int split = blockIdx.x;
  const int bh = blockIdx.y;  // b * H_kv + hk
  const int b = bh / p.H_kv;
  const int hk = bh % p.H_kv;
  const int row0 = blockIdx.z * p.rows_per_block;         // first of this block's rows among the R
  const int rows = min(p.rows_per_block, p.rows - row0);  // R_c (the last chunk may be shorter)
  const int64_t grow0 = static_cast<int64_t>(bh) * p.rows + row0;  // its index among all B * H * Sq rows
  const int64_t total_rows = static_cast<int64_t>(p.B) * p.H_kv * p.rows;

  // 1-2. This split's keys [start, end) (decode_stream.cuh: an equal share of the sequence's L
  //      keys, whole tiles); a bad length or page makes the block write NaN for its rows.
  int start, end;
  const bool bad = split_keys<Tl::kBc, kPaged>(p, b, split, start, end);
  const int L = p.lengths[b];

  float m[Tl::kPvRows], l[Tl::kPvRows], o[Tl::kPvRows][Tl::kPvWidth];  // running max, sum, output (base 2)
#pragma unroll
  for (int n = 0; n < Tl::kPvRows; ++n) {
    m[n] = -INFINITY;
    l[n] = 0.0f;
#pragma unroll
    for (int e = 0; e < Tl::kPvWidth; ++e) o[n][e] = 0.0f;
  }
  const int group = tid / Tl::kGroup;       // the row group of this thread (softmax, P V)
  const int group_lane = tid % Tl::kGroup;  // its place in the group: outputs group_lane * kPvWidth ...
  const unsigned group_mask =  // the lanes of this thread's group, for its shuffles
      Tl::kGroup == 32 ? course::kFullMask : ((1u << (Tl::kGroup % 32)) - 1) << ((tid % 32) & ~(Tl::kGroup - 1));

  if (!bad) {
    // 3. Stage the block's query rows in shared memory as FP32, times scale * log2(e).
    const T* q = static_cast<const T*>(p.q) + grow0 * D;
    for (int idx = tid; idx < rows * D; idx += kThreads) sQ[idx] = to_float(q[idx]) * p.scale_log2;

    // 4. K and V stream through the two stages of shared memory (decode_stream.cuh's ring): a
    //    tile's rows at or past `end` are zero-filled.
    const KvStream<T, D, false, kPaged, kStages> stream{p, b, hk, bh, start, end, sK, sV};

    const int num_tiles = course::ceil_div(end - start, Tl::kBc);
    stream.prologue(num_tiles);
    for (int t = 0; t < num_tiles; ++t) {
      const int stage = stream.stage(t);
      const int tile_start = start + t * Tl::kBc;
      // 5. Start copying the next tile into the other stage; it lands while this one is used.
      stream.fetch_ahead(t, num_tiles);
      // 6. Wait for this tile's copies (all groups but the newest), then for every thread's.
      course::cp_async_wait<kStages - 1>();
      __syncthreads();

      // 7. Scores s = (scale log2(e) q) . k for this thread's key and rows, masked bottom-right
      //    causal (key <= L - Sq + i for query i) and to the split's end.
      {
        const int j = tid % Tl::kBc;
        const int first = tid / Tl::kBc;
        const T* k_row = sK + stage * Tl::kTileElems + j * Tl::kStride;
        float acc[Tl::kScoreRows];
#pragma unroll
        for (int n = 0; n < Tl::kScoreRows; ++n) acc[n] = 0.0f;
#pragma unroll 4
        for (int c = 0; c < Tl::kChunks; ++c) {
          float kf[Tl::kVec];
          load_as_float<Tl::kVec>(k_row + c * Tl::kVec, kf);
#pragma unroll
          for (int n = 0; n < Tl::kScoreRows; ++n) {
            const int r = first + n * Tl::kThreadsPerKey;
            if (r < rows) {
              const float4* qv = reinterpret_cast<const float4*>(sQ + r * D + c * Tl::kVec);
#pragma unroll
              for (int w = 0; w < Tl::kVec / 4; ++w) {
                const float4 x = qv[w];  // the same address across the warp: a broadcast
                acc[n] = fmaf(x.x, kf[4 * w], acc[n]);
                acc[n] = fmaf(x.y, kf[4 * w + 1], acc[n]);
                acc[n] = fmaf(x.z, kf[4 * w + 2], acc[n]);
                acc[n] = fmaf(x.w, kf[4 * w + 3], acc[n]);
              }
            }
          }
        }
        const int key = tile_start + j;
#pragma unroll
        for (int n = 0; n < Tl::kScoreRows; ++n) {
          const int r = first + n * Tl::kThreadsPerKey;
          if (r < rows) {
            const int limit = L - p.Sq + (row0 + r) % p.Sq;  // the last key query i sees
            sS[r * Tl::kSStride + j] = (key < end && key <= limit) ? acc[n] : -INFINITY;
          }
        }
      }
      __syncthreads();

      // 8. Online softmax, one row per group of threads: the tile's row maximum, the new running
      //    maximum m, p = 2^(s - m) written over the scores, l and O rescaled by 2^(m_old - m).
      // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax TODO (Lines 10-13) as Step 8 here, once the teaching kernel's tests pass: for each of this thread's rows (r = group + n * kRowGroups, r < rows), a group of kGroup threads shares the row (kGroup-strided keys of the tile, the tile's max and its sum combined by shuffles, group_max / group_sum with group_mask), the scores are already in log2 units (exp2f), P is written over the scores in sS for Step 9, and each thread rescales only its kPvWidth outputs of O; a row with no visible key yet gives zeros, never NaN (README: Design)
#pragma unroll
      for (int n = 0; n < Tl::kPvRows; ++n) {
        const int r = group + n * Tl::kRowGroups;
        if (r < rows) {
          float* s_row = sS + r * Tl::kSStride;
          float tile_max = -INFINITY;
          for (int j = group_lane; j < Tl::kBc; j += Tl::kGroup) tile_max = fmaxf(tile_max, s_row[j]);
          tile_max = group_max<Tl::kGroup>(tile_max, group_mask);
          const float m_new = fmaxf(m[n], tile_max);
          const float base = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet: p = 0, not NaN
          const float alpha = exp2f(m[n] - base);
          float tile_sum = 0.0f;
          for (int j = group_lane; j < Tl::kBc; j += Tl::kGroup) {
            const float prob = exp2f(s_row[j] - base);
            s_row[j] = prob;
            tile_sum += prob;
          }
          tile_sum = group_sum<Tl::kGroup>(tile_sum, group_mask);
          l[n] = l[n] * alpha + tile_sum;
          m[n] = m_new;
#pragma unroll
          for (int e = 0; e < Tl::kPvWidth; ++e) o[n][e] *= alpha;
        }
      }
      // END SOLUTION
      __syncwarp();  // a group reads the probabilities its other lanes wrote

      // 9. O += P V: each thread its kPvWidth outputs of its rows, one piece of V row j per key.
      {
        const T* v_tile = sV + stage * Tl::kTileElems + group_lane * Tl::kPvWidth;
        for (int j = 0; j < Tl::kBc; ++j) {
          float vf[Tl::kPvWidth];
          load_as_float<Tl::kPvWidth>(v_tile + j * Tl::kStride, vf);
#pragma unroll
          for (int n = 0; n < Tl::kPvRows; ++n) {
            const int r = group + n * Tl::kRowGroups;
            if (r < rows) {
              const float prob = sS[r * Tl::kSStride + j];
#pragma unroll
              for (int e = 0; e < Tl::kPvWidth; ++e) o[n][e] = fmaf(prob, vf[e], o[n][e]);
            }
          }
        }
      }
      // 10. Every thread is done with this stage and the probabilities before they are overwritten.
      __syncthreads();
    }
  }

  // 11. Write each row: O / l and its logsumexp (NaN for a bad length or page). One split writes
  //     the output in q's dtype and the natural-log lse; several write FP32 partials for the merge.
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's Line 15 TODO as Step 11 here, once the teaching kernel's tests pass: for each of this thread's rows (r = group + n * kRowGroups, r < rows, global row grow0 + r), O / l (zeros when l = 0) and the logsumexp in log2 units, m + log2(l) (-inf when l = 0), both NaN when the block is `bad`; each lane of the row's group stores its kPvWidth outputs with store_result (decode_stream.cuh: one split writes O in q's dtype and the natural-log lse, several the FP32 partials for the merge), one lane per row also the lse (README: How the partial results merge exactly)
  const float nan = __int_as_float(0x7fffffff);
#pragma unroll
  for (int n = 0; n < Tl::kPvRows; ++n) {
    const int r = group + n * Tl::kRowGroups;
    if (r < rows) {
      const int64_t grow = grow0 + r;
      const float inv_l = bad ? nan : (l[n] > 0.0f ? 1.0f / l[n] : 0.0f);
      const float lse2 = bad ? nan : (l[n] > 0.0f ? m[n] + log2f(l[n]) : -INFINITY);
      float out[Tl::kPvWidth];
#pragma unroll
      for (int e = 0; e < Tl::kPvWidth; ++e) out[e] = o[n][e] * inv_l;
      store_result<T, D>(p, split, total_rows, grow, group_lane * Tl::kPvWidth, out, lse2, group_lane == 0);
    }
  }
  // END SOLUTION

  // 12. Several splits, in-kernel merge: the block that finishes its row group last merges it.
  if (p.num_splits > 1 && p.arrivals != nullptr) merge_if_last<T, D>(p, grow0, rows, smem);
}

template <typename T, int D, bool kPaged>
void launch_split(const Params& p, cudaStream_t stream) {
  launch_split_grid<decode_split_kernel<T, D, kPaged>, smem_bytes<T, D>(kMaxRows)>(p, smem_bytes<T, D>(p.rows_per_block),
                                                                                 stream);
}

template <typename T, int D>
void launch_for_layout(const Params& p, bool paged, cudaStream_t stream) {
  if (paged) {
    launch_split<T, D, true>(p, stream);
  } else {
    launch_split<T, D, false>(p, stream);
  }
}

template <typename T>
void launch_for_head_dim(const Params& p, int64_t D, bool paged, cudaStream_t stream) {
  switch (D) {
    case 64: launch_for_layout<T, 64>(p, paged, stream); break;
    case 128: launch_for_layout<T, 128>(p, paged, stream); break;
    case 256: launch_for_layout<T, 256>(p, paged, stream); break;
    default: TORCH_CHECK(false, "head dim D=", D, " (q.size(3)) is not supported: use 64, 128 or 256");
  }
}

}  // namespace

void launch_decode(const Params& p, at::ScalarType dtype, int64_t D, bool paged, bool tensor_cores, int stages,
                   cudaStream_t stream) {
  if (tensor_cores) {
    launch_split_tc(p, dtype, D, paged, stages, stream);
    if (p.num_splits > 1 && p.arrivals == nullptr) launch_merge(p, dtype, D, stream);
    return;
  }
  switch (dtype) {
    case at::kHalf: launch_for_head_dim<__half>(p, D, paged, stream); break;
    case at::kBFloat16: launch_for_head_dim<__nv_bfloat16>(p, D, paged, stream); break;
    case at::kFloat: launch_for_head_dim<float>(p, D, paged, stream); break;
    default: TORCH_CHECK(false, "q must be float16, bfloat16 or float32, got ", dtype);
  }
  if (p.num_splits > 1 && p.arrivals == nullptr) launch_merge(p, dtype, D, stream);
}

}  // namespace phase5_decode
