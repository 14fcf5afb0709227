// Flash-decoding on tensor cores: the split kernel of decode_split.cu with both
// products on mma.sync (FP16/BF16, D = 64 and 128).
//
// Why tensor cores for a memory-bound step: decode_split.cu spends most of its instructions
// feeding CUDA cores (shared-memory loads of q, of probabilities and of V, conversions to FP32)
// and runs out of issue slots well before the GPU runs out of DRAM bandwidth. A block's R <= 16
// query rows are exactly one m16 tile: S = Q K^T and O += P V become mma.sync m16n8k16 with the
// rows past R zero. Most of each mma is wasted (R = 4 uses a quarter of it) and it does not matter:
// one mma does 16 x 8 x 16 multiply-adds for one issue slot, and K and V reach the tensor cores
// through ldmatrix, four 8 x 8 tiles per instruction, converted nowhere.
//
// Block (split s, sequence b x KV head hk, row chunk) as in decode_split.cu; its 4 warps divide
// each tile of kBc keys into 4 slices of kKeys and run FlashAttention-2's loop on their slice:
//   S = Q K_w^T (Q in registers as A fragments for the whole kernel, K_w through ldmatrix),
//   online softmax on the accumulator fragments (rows g and g + 8 of each thread, base 2),
//   O_w += P V_w (P from the accumulators as A fragments, V_w through ldmatrix.trans).
// At the end the 4 warps' (m, l, O) are merged through shared memory exactly as decode_merge.cuh
// merges splits, and the block writes its rows (store_result); with several splits the block that
// finishes its row group last then merges the splits (merge_if_last).
//
// K and V stream through a ring of kStages stages of swizzled tiles (decode_stream.cuh KvTile): 3
// where the device lets a block hold them, so that the copies of two tiles (64 KB) are in flight
// while one is used, and of three while the block waits. The
// arithmetic (README "More bytes in flight: a deeper ring"): a stage is 16 KB of K and 16 KB of V
// (D = 64 and 128, FP16 and BF16 alike), so a block takes
//     stages   shared memory
//       2        64 KB     every GPU with cp.async
//       3        96 KB     sm_80 (163 KB a block) and sm_90 (227 KB): two blocks per SM; sm_86 and
//                          sm_89 (99 KB a block): one
//       4       128 KB     sm_80 and sm_90 only, one block per SM (sm_90: 228 KB per SM, 1 KB of
//                          it reserved per block)
// Both 2 and 3 are compiled (decode.h tensor_core_stages); decode/__init__.py's choose_stages
// picks the deepest that fits the device's limit per block. Four stages would give a lone block
// one more tile in flight and cost sm_90 the second block per SM (at B = 64 the grid's 512 blocks
// are two waves of 264, not four of 132, and one block's set-up and final merge no longer hide
// behind the other's copies).
#include <cmath>

#include "../tensor_cores/tc_mma.cuh"  // tc::ldmatrix_x4(_trans), tc::mma_16816, tc::pack2, tc::exp2_approx
#include "decode.h"
#include "decode_common.cuh"
#include "decode_merge.cuh"
#include "decode_stream.cuh"

namespace phase5_decode {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 16;  // the m16 of mma.sync: a block's R_c <= kMaxRows query rows
static_assert(kMaxRows <= kTileRows, "a block's rows fit one m16 tile");

template <typename T, int D>
struct TcTile : KvTile<T, D, true> {
  using KvTile<T, D, true>::kBc;
  using KvTile<T, D, true>::kTileElems;
  static constexpr int kKeys = kBc / kWarps;  // keys of a tile per warp
  static_assert(kKeys % 16 == 0, "a warp's slice is whole k16 steps of P V (and whole swizzle groups of 8 rows: "
                "a key's swizzle is the same counted from the tile or from the warp's slice)");
  // The merge of the warps' results reuses the K/V tiles: O [kWarps][16][D] and m, l [kWarps][16].
  static constexpr size_t kMergeBytes = static_cast<size_t>(kWarps) * kTileRows * (D + 2) * sizeof(float);
  // The block's shared memory: kStages stages of K and V (decode/__init__.py's tensor_core_smem_bytes).
  static constexpr size_t smem_bytes(int stages) { return 2 * static_cast<size_t>(stages) * kTileElems * sizeof(T); }
  static_assert(kMergeBytes <= smem_bytes(2), "the merge fits in the K/V tiles of the shallowest ring");
  static_assert(merge_smem_bytes(kWarps) <= smem_bytes(2), "so does the in-kernel merge of the splits");
};

template <typename T, int D, bool kPaged, int kStages>
__global__ void __launch_bounds__(kThreads) decode_split_tc_kernel(const Params p) {
  using Tl = TcTile<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);       // [kStages][kBc][D], swizzled (KvTile)
  T* sV = sK + kStages * Tl::kTileElems;    // [kStages][kBc][D], swizzled (KvTile)

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;     // fragment row g (and g + 8), column pair 2t
  const int split = blockIdx.x;
  const int bh = blockIdx.y;                // b * H_kv + hk
  const int b = bh / p.H_kv;
  const int hk = bh % p.H_kv;
  const int row0 = blockIdx.z * p.rows_per_block;
  const int rows = min(p.rows_per_block, p.rows - row0);
  const int64_t grow0 = static_cast<int64_t>(bh) * p.rows + row0;
  const int64_t total_rows = static_cast<int64_t>(p.B) * p.H_kv * p.rows;

  // 1. This split's keys [start, end) (decode_stream.cuh); a bad length or page: NaN rows.
  int start, end;
  const bool bad = split_keys<Tl::kBc, kPaged>(p, b, split, start, end);
  const int L = p.lengths[b];

  float o[D / 8][4];                                     // O of rows g, g + 8: n8 tiles of D
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (base 2) and partial sum
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  if (!bad) {
    // 2. Q as mma A fragments for all D / 16 k-steps, rows past R_c zero (their results are dropped).
    uint32_t qa[D / 16][4];
    {
      const T* q = static_cast<const T*>(p.q) + grow0 * D;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = g + 8 * (r % 2), col = kk * 16 + 2 * t + 8 * (r / 2);
          qa[kk][r] = row < rows ? *reinterpret_cast<const uint32_t*>(q + row * D + col) : 0u;
        }
      }
    }
    // The last key rows g and g + 8 see (bottom-right causal: key j <= L - Sq + i for query i).
    const int limit[2] = {L - p.Sq + (row0 + g) % p.Sq, L - p.Sq + (row0 + g + 8) % p.Sq};

    // 3. K and V stream through the ring of kStages stages of shared memory (decode_stream.cuh):
    //    tiles 0 .. kStages-2 first; at the top of each iteration the copies of the tile kStages - 1
    //    ahead start (into the stage the last iteration used), then the wait for this tile's copies
    //    (the kStages - 1 younger groups may still fly) and the barrier that shows it to all warps.
    const KvStream<T, D, true, kPaged, kStages> stream{p, b, hk, bh, start, end, sK, sV};
    const int num_tiles = course::ceil_div(end - start, Tl::kBc);
    stream.prologue(num_tiles);
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int stage = stream.stage(tile);
      const int key0 = start + tile * Tl::kBc + warp * Tl::kKeys;  // this warp's first key
      stream.fetch_ahead(tile, num_tiles);
      course::cp_async_wait<kStages - 1>();
      __syncthreads();
      const T* k_slice = sK + stage * Tl::kTileElems + warp * Tl::kKeys * D;
      const T* v_slice = sV + stage * Tl::kTileElems + warp * Tl::kKeys * D;

      // 4. S = Q K_w^T: per k-step, one ldmatrix.x4 gives the B fragments of 16 keys (8 x 8 tiles
      //    (keys n..n+7 | n+8..n+15) x (columns kk*16 .. +7 | +8 .. +15)).
      float s[Tl::kKeys / 8][4];
#pragma unroll
      for (int n = 0; n < Tl::kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int n = 0; n < Tl::kKeys / 16; ++n) {
          const int mat = lane / 8;
          const int key = n * 16 + (mat / 2) * 8 + lane % 8, chunk = kk * 2 + mat % 2;
          uint32_t kb[4];
          tc::ldmatrix_x4(kb, course::smem_u32(k_slice + Tl::at(key, chunk)));
          tc::mma_16816<T>(s[2 * n], qa[kk], kb[0], kb[1]);
          tc::mma_16816<T>(s[2 * n + 1], qa[kk], kb[2], kb[3]);
        }
      }

      // 5. Scale to base 2 and mask (past the split's end, bottom-right causal); online softmax
      //    on rows g (h = 0) and g + 8 (h = 1): a row's kKeys scores live in the 4 lanes of a quad.
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float row_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < Tl::kKeys / 8; ++n) {
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            const int key = key0 + n * 8 + 2 * t + e % 2;
            const float x = s[n][e] * p.scale_log2;
            s[n][e] = key < end && key <= limit[h] ? x : -INFINITY;
            row_max = fmaxf(row_max, s[n][e]);
          }
        }
        row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, 1));
        row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, 2));
        const float m_new = fmaxf(m[h], row_max);
        const float base = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet: p = 0, not NaN
        alpha[h] = tc::exp2_approx(m[h] - base);
        float row_sum = 0.0f;
#pragma unroll
        for (int n = 0; n < Tl::kKeys / 8; ++n) {
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            s[n][e] = tc::exp2_approx(s[n][e] - base);
            row_sum += s[n][e];
          }
        }
        l[h] = l[h] * alpha[h] + row_sum;
        m[h] = m_new;
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }

      // 6. O += P V_w: P's accumulators of keys 16c .. 16c + 15 are the A fragment of k-step c;
      //    one ldmatrix.x4.trans gives V's B fragments of two n8 tiles of D.
#pragma unroll
      for (int c = 0; c < Tl::kKeys / 16; ++c) {
        const uint32_t pa[4] = {tc::pack2<T>(s[2 * c][0], s[2 * c][1]), tc::pack2<T>(s[2 * c][2], s[2 * c][3]),
                                tc::pack2<T>(s[2 * c + 1][0], s[2 * c + 1][1]),
                                tc::pack2<T>(s[2 * c + 1][2], s[2 * c + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
          const int mat = lane / 8;
          const int key = c * 16 + (mat % 2) * 8 + lane % 8, chunk = n * 2 + mat / 2;
          uint32_t vb[4];
          tc::ldmatrix_x4_trans(vb, course::smem_u32(v_slice + Tl::at(key, chunk)));
          tc::mma_16816<T>(o[2 * n], pa, vb[0], vb[1]);
          tc::mma_16816<T>(o[2 * n + 1], pa, vb[2], vb[3]);
        }
      }
      // 7. Every warp is done with this stage before the next fetch_ahead overwrites it.
      __syncthreads();
    }
  }

  // 8. Merge the 4 warps' results (each saw a quarter of every tile) through shared memory, the
  //    tiles' space reused: M = max_w m_w, O = sum_w 2^(m_w - M) O_w / sum_w 2^(m_w - M) l_w.
  course::cp_async_wait<0>();
  __syncthreads();
  float* sO = reinterpret_cast<float*>(smem);                      // [kWarps][16][D]
  float* sM = sO + kWarps * kTileRows * D;                         // [kWarps][16]
  float* sL = sM + kWarps * kTileRows;                             // [kWarps][16]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = l[h];
    total += __shfl_xor_sync(course::kFullMask, total, 1);
    total += __shfl_xor_sync(course::kFullMask, total, 2);
    const int row = g + 8 * h;
    if (t == 0) {
      sM[warp * kTileRows + row] = m[h];
      sL[warp * kTileRows + row] = total;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      float* dst = sO + (warp * kTileRows + row) * D + n * 8 + 2 * t;
      dst[0] = o[n][2 * h];
      dst[1] = o[n][2 * h + 1];
    }
  }
  __syncthreads();

  // 9. Write each row (4 columns per thread): O / l and its base-2 logsumexp, NaN when bad.
  const float nan = __int_as_float(0x7fffffff);
  for (int idx = tid; idx < rows * (D / 4); idx += kThreads) {
    const int row = idx / (D / 4), col = (idx % (D / 4)) * 4;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, sM[w * kTileRows + row]);
    float l_all = 0.0f, out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = exp2f(sM[w * kTileRows + row] - m_all);
        l_all += weight * sL[w * kTileRows + row];
        const float* src = sO + (w * kTileRows + row) * D + col;
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = fmaf(weight, src[e], out[e]);
      }
    }
    const float inv_l = bad ? nan : (l_all > 0.0f ? 1.0f / l_all : 0.0f);
    const float lse2 = bad ? nan : (l_all > 0.0f ? m_all + log2f(l_all) : -INFINITY);
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] *= inv_l;
    store_result<T, D>(p, split, total_rows, grow0 + row, col, out, lse2, col == 0);
  }

  // 10. Several splits, in-kernel merge: the block that finishes its row group last merges it.
  if (p.num_splits > 1 && p.arrivals != nullptr) merge_if_last<T, D>(p, grow0, rows, smem);
}

template <typename T, int D, bool kPaged, int kStages>
void launch_ring(const Params& p, cudaStream_t stream) {
  constexpr size_t kSmem = TcTile<T, D>::smem_bytes(kStages);
  launch_split_grid<decode_split_tc_kernel<T, D, kPaged, kStages>, kSmem>(p, kSmem, stream);
}

// The ring of `stages` stages (tensor_core_stages; the caller chose it from the device's limit),
// checked against that limit here too, so a direct call of the op gets a message, not a failed launch.
template <typename T, int D, bool kPaged>
void launch_split_tc(const Params& p, int stages, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const size_t need = TcTile<T, D>::smem_bytes(stages);
  const int limit = course::shared_memory_per_block(device);
  TORCH_CHECK(need <= static_cast<size_t>(limit), "stages=", stages, " needs ", need, " bytes of shared memory per "
              "block at D=", D, ", and this GPU allows ", limit, ": use fewer stages (decode.choose_stages)");
  if (stages == 3) {
    launch_ring<T, D, kPaged, 3>(p, stream);
  } else {
    launch_ring<T, D, kPaged, 2>(p, stream);
  }
}

template <typename T>
void launch_tc_for_head_dim(const Params& p, int64_t D, bool paged, int stages, cudaStream_t stream) {
  switch (D) {
    case 64:
      paged ? launch_split_tc<T, 64, true>(p, stages, stream) : launch_split_tc<T, 64, false>(p, stages, stream);
      break;
    case 128:
      paged ? launch_split_tc<T, 128, true>(p, stages, stream) : launch_split_tc<T, 128, false>(p, stages, stream);
      break;
    default: TORCH_CHECK(false, "head dim D=", D, " (q.size(3)) has no tensor-core decode kernel: use 64 or 128");
  }
}

}  // namespace

void launch_split_tc(const Params& p, at::ScalarType dtype, int64_t D, bool paged, int stages, cudaStream_t stream) {
  switch (dtype) {
    case at::kHalf: launch_tc_for_head_dim<__half>(p, D, paged, stages, stream); break;
    case at::kBFloat16: launch_tc_for_head_dim<__nv_bfloat16>(p, D, paged, stages, stream); break;
    default: TORCH_CHECK(false, "the tensor-core decode kernel takes float16 or bfloat16, got ", dtype);
  }
}

}  // namespace phase5_decode
