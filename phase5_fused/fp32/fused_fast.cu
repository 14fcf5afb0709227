// Phase 5, the fast fused FP32 attention kernel: the same function as fused_teaching.cu (read that
// one first), organized like an SGEMM so that the FP32 FFMA pipes stay busy.
//
// What changes against the teaching kernel, and why (README.md has the numbers):
//   1. Register tiling. 256 threads form a 16 x 16 grid. Thread (ty, tx) owns TM = Br/16 query rows
//      (ty, ty+16, ...) and TN = Bc/16 key columns (tx, tx+16, ...) of the Br x Bc score tile S, and
//      the same TM rows times D/16 columns of O. Each float4 read from shared memory feeds TM or TN
//      FMAs, like SGEMM's outer product, instead of one.
//   2. Q K^T in float4 steps along D: Q and K stay row-major in shared memory (no transpose), rows
//      padded by 4 floats so the 16 threads reading 16 K rows hit 32 different banks.
//   3. cp.async (16 bytes, zero-fill past the end) for every tile. K and V are double-buffered the
//      FlashAttention-2 way: V_j is in flight while S_j = Q K_j^T and its softmax run, K_{j+1} is in
//      flight while O += P_j V_j runs. Each load has half an iteration to land.
//   4. exp2f with the softmax scale folded into log2(e): x = s * scale * log2(e) is one FMUL, and
//      exp(s*scale - m) = exp2(x - m') with m' the running max in log2 units (one MUFU.EX2).
//   5. The row sum l stays a per-thread partial (each of the 16 threads of a row sums its own
//      columns): the 16 partials are added once, after the last tile, not once per tile.
//   6. Tiles are skipped, not masked: for causal, key tiles above the block's diagonal are never
//      loaded; for key_lengths, tiles past the batch's length neither; for a sliding window, tiles
//      below the window of the block's first row neither (the loop starts at the tile of key
//      i0 - window + 1). Tiles that need no masking at all (the bulk) take a branch without any
//      per-score test.
//   7. Strided attention gathers: tile slot t holds key row j = t * stride, so only the keys a query
//      may see are loaded and multiplied: the work falls as 1/stride.
//   8. The heaviest query blocks (the last rows, under causal masking) are scheduled first.
//   9. Grouped-query attention is index arithmetic: query head h reads KV head h / (H / H_kv), so
//      the H / H_kv query heads of a group read the same K and V rows (from L2 after the first).
//
// Tile configurations (template instances), per D; variant 0 is the default:
//   D=32:  Br=64, Bc=64             D=80: Br=64, Bc=64           D=96: Br=64, Bc=64
//   D=64:  v0 Br=128, Bc=64 (2 blocks/SM, ~100 B of spills)   v1 Br=64, Bc=64 (2 blocks/SM)
//   D=128: v0 Br=64,  Bc=64 (1 block/SM, 200 registers)       v1 Br=64, Bc=32 (2 blocks/SM)
// The defaults are the variants that won at S=4096 in the committed run (run.py's variant rows).
// run.py times every variant at S=4096 and records which one wins.
// Every other D (a multiple of 8 up to 256) runs on padded tiles of D_TILE columns, the next multiple
// of 32 (launch_padded), the columns past D zero-filled on load and never stored; one configuration
// per D_TILE, the fewer rows the wider, so that O fits 128 registers and the shared memory 99 KiB:
//   D_TILE=32, 64: Br=64, Bc=64     96, 128: Br=64, Bc=32     160-224: Br=32, Bc=32     256: Br=32, Bc=16
//
// The pieces versions 2-5 share are in fused_tiles.cuh: the tile configuration, the loaders, the
// Q K^T and P V products, the launch.
#include <cuda_runtime.h>
#include <math_constants.h>

#include <c10/util/Exception.h>

#include "common.cuh"
#include "cp_async.cuh"
#include "fused.h"
#include "fused_tiles.cuh"

namespace phase5 {
namespace {

// ------------------------------------------------------------------------------------------------
// The kernel. Grid: one block per (query block, batch*head), heaviest query blocks first.

template <typename Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) fused_fast_kernel(FusedParams p) {
  constexpr int D = Cfg::D, Br = Cfg::Br, Bc = Cfg::Bc, TM = Cfg::TM, TN = Cfg::TN;
  constexpr int VW = Cfg::VW, OC = Cfg::OC, LDQ = Cfg::LDQ;
  constexpr bool kWindow = Cfg::kWindow;  // a sliding window (its own instance: see FastConfig)
  // Padded instances: D is the tile width, the tensors' rows hold head_dim <= D floats, and the tile
  // columns past head_dim are zeros (they add nothing to S, and their O columns are not stored).
  constexpr bool kPadded = Cfg::kPadded;
  const int head_dim = kPadded ? p.head_dim : D;

  extern __shared__ float4 smem_f4[];
  float* Qs = reinterpret_cast<float*>(smem_f4);  // [Br][LDQ]  Q_i
  float* Ks = Qs + Br * LDQ;                      // [Bc][LDQ]  K_j (gathered when strided)
  float* Vs = Ks + Bc * LDQ;                      // [Bc][LDQ]  V_j
  float* Ps = Vs + Bc * LDQ;                      // [Br][LDP]  P_ij = exp(S_ij - m_i)

  const int tx = threadIdx.x % kTX;
  const int ty = threadIdx.x / kTX;

  // Which query block and head: blocks with the most key tiles (last rows, causal) start first.
  const int64_t BH = p.B * p.H;
  const int64_t n_qblocks = course::ceil_div<int64_t>(p.Sq, Br);
  const int64_t bh = blockIdx.x % BH;
  const int64_t qblock = n_qblocks - 1 - static_cast<int64_t>(blockIdx.x) / BH;
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qblock * Br;
  const int64_t bh_kv = b * p.H_kv + h / (p.H / p.H_kv);  // GQA: this query head's KV head

  const float* q_head = p.q + bh * p.Sq * head_dim;
  const float* k_head = p.k + bh_kv * p.Sk * head_dim;
  const float* v_head = p.v + bh_kv * p.Sk * head_dim;

  // The keys this block can see: j < kv_limit (padding), j <= last row (causal), j % stride == 0.
  const int64_t kv_limit =
      p.key_lengths ? static_cast<int64_t>(p.key_lengths[b]) : p.Sk;  // clamped on the host
  const int64_t i_last = (i0 + Br < p.Sq ? i0 + Br : p.Sq) - 1;
  const int64_t kv_end = p.masking.causal && i_last + 1 < kv_limit ? i_last + 1 : kv_limit;
  const int64_t stride = p.masking.stride;
  const int64_t n_slots = course::ceil_div<int64_t>(kv_end, stride);  // key slots t: j = t*stride
  const int64_t n_tiles = course::ceil_div<int64_t>(n_slots, Bc);
  // Sliding window: the first row i0 sees no key below i0 - window + 1 (and later rows fewer), so
  // the loop starts at the tile of the first slot t with t * stride >= i0 - window + 1.
  const int64_t window = kWindow ? p.window : 0;
  const int64_t key_first = kWindow && i0 - window + 1 > 0 ? i0 - window + 1 : 0;
  const int64_t tile_begin = course::ceil_div<int64_t>(key_first, stride) / Bc;

  // The user's mask only: causal, stride and padding are decided here from the slot's key index.
  course::AttentionMasking user_mask = p.masking;
  user_mask.causal = false;
  user_mask.stride = 1;
  const bool has_mask = p.masking.mask.kind != course::MaskKind::kNone;
  const float scale_log2 = p.scale * kLog2e;

  // Per-thread state: O accumulators (unnormalized), running max m (log2 units), partial sum l.
  float o[TM][OC * VW];
  float m[TM], l[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < OC * VW; ++c) o[i][c] = 0.0f;
  }

  if (tile_begin < n_tiles) {
    // Prologue: Q_i and the first K_j in one group.
    load_rows_async<D, Br, LDQ, kPadded>(Qs, q_head, i0, 1, p.Sq, head_dim);
    load_rows_async<D, Bc, LDQ, kPadded>(Ks, k_head, tile_begin * Bc, stride, kv_end, head_dim);
    course::cp_async_commit();
  }

  for (int64_t tile = tile_begin; tile < n_tiles; ++tile) {
    const int64_t t0 = tile * Bc;  // first key slot of this tile

    // Step 1: K_j (and Q_i) landed; every thread has finished P_{j-1} V_{j-1}, so V and P are free.
    course::cp_async_wait<0>();
    __syncthreads();
    // Step 2: start V_j; it lands while S_j and its softmax are computed.
    load_rows_async<D, Bc, LDQ, kPadded>(Vs, v_head, t0, stride, kv_end, head_dim);
    course::cp_async_commit();

    // Step 3: S_ij = Q_i K_j^T, TM x TN per thread, float4 steps along D.
    float s[TM][TN];
    float4 kf[TN];  // one step's K_j operands (the kernel owns its register arrays)
    qk_tile<Cfg>(s, kf, Qs, Ks, tx, ty);

    // Step 4: scale into log2 units, and mask where this tile needs it. A tile needs no test when
    // there is no user mask, all its keys are before kv_limit, (causal) all are <= the block's
    // first row, and (window) all are inside the last row's window.
    const int64_t last_key = (t0 + Bc - 1) * stride;
    const bool needs_check = has_mask || last_key >= kv_limit || (p.masking.causal && last_key > i0) ||
                             (kWindow && t0 * stride <= i_last - window);
    if (!needs_check) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int n = 0; n < TN; ++n) s[i][n] *= scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const int64_t row = i0 + ty + kTY * i;
#pragma unroll
        for (int n = 0; n < TN; ++n) {
          const int64_t key = (t0 + tx + kTX * n) * stride;
          float x = -CUDART_INF_F;
          if (row < p.Sq && key < kv_limit && !(p.masking.causal && key > row) &&
              !(kWindow && key <= row - window)) {
            const float bias = has_mask ? course::mask_bias(user_mask, b, h, row, key) : 0.0f;
            x = fmaf(s[i][n], scale_log2, bias * kLog2e);
          }
          s[i][n] = x;
        }
      }
    }

    // BEGIN SOLUTION: Port of fused_teaching.cu's online-softmax TODO (Lines 10-13) as Step 5 here, once the teaching kernel's tests pass: for this thread's TM rows, with the scores in log2 units (exp2f), a row's max shared by the kTX threads of the row (shuffles), and l kept as a per-thread partial sum (item 5 above) (README: The fast kernel)
    // Step 5: online softmax per row. m_new = max(m, rowmax(S_ij)); P = exp2(S_ij - m_new);
    // the old O and l are rescaled by alpha = exp2(m - m_new).
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float row_max = s[i][0];
#pragma unroll
      for (int n = 1; n < TN; ++n) row_max = fmaxf(row_max, s[i][n]);
#pragma unroll
      for (int offset = kTX / 2; offset > 0; offset >>= 1)  // the 16 threads of this row
        row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, offset));
      const float m_new = fmaxf(m[i], row_max);
      const float m_use = m_new == -CUDART_INF_F ? 0.0f : m_new;  // all hidden so far: no NaN
      const float alpha = exp2f(m[i] - m_use);
      float row_sum = 0.0f;
#pragma unroll
      for (int n = 0; n < TN; ++n) {
        s[i][n] = exp2f(s[i][n] - m_use);
        row_sum += s[i][n];
      }
      l[i] = fmaf(l[i], alpha, row_sum);
#pragma unroll
      for (int c = 0; c < OC * VW; ++c) o[i][c] *= alpha;
      m[i] = m_new;
    }
    // END SOLUTION

    // Step 6: P_ij to shared memory (every thread needs whole rows of P for P V).
    store_p<Cfg>(Ps, s, tx, ty);
    __syncthreads();  // P visible; every thread is done with K_j

    // Step 7: start K_{j+1}; it lands while P V runs. (An empty group keeps the count uniform.)
    if (tile + 1 < n_tiles)
      load_rows_async<D, Bc, LDQ, kPadded>(Ks, k_head, t0 + Bc, stride, kv_end, head_dim);
    course::cp_async_commit();
    course::cp_async_wait<1>();  // everything but K_{j+1}: V_j has landed
    __syncthreads();

    // Step 8: O_i += P_ij V_j: per 4 keys, TM float4 of P and OC vectors of V per key.
    float4 pf[TM];     // P_ij operands
    float vf[OC][VW];  // V_j operands
    pv_tile<Cfg>(o, pf, vf, Ps, Vs, tx, ty);
  }
  course::cp_async_wait<0>();  // nothing may be left in flight when the block exits

  // BEGIN SOLUTION: Port of fused_teaching.cu's Line 15 TODO as Step 9 here, once the teaching kernel's tests pass: for this thread's TM rows, the kTX partial sums of a row added first, then O / l stored VW floats at a time (a padded instance stores only the chunks before head_dim), and the logsumexp (one thread per row) brought back from log2 units (README: The fast kernel)
  // Step 9: O_i = O_i / l_i (zeros for fully masked rows), logsumexp = (m + log2 l) * ln 2.
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    float l_total = l[i];
#pragma unroll
    for (int offset = kTX / 2; offset > 0; offset >>= 1)
      l_total += __shfl_xor_sync(course::kFullMask, l_total, offset);
    const int64_t row = i0 + ty + kTY * i;
    if (row >= p.Sq) continue;
    const float inv = l_total > 0.0f ? 1.0f / l_total : 0.0f;
    float out[OC * VW];
#pragma unroll
    for (int c = 0; c < OC * VW; ++c) out[c] = o[i][c] * inv;
    float* o_row = p.o + (bh * p.Sq + row) * head_dim;
#pragma unroll
    for (int c = 0; c < OC; ++c) {
      const int col = (c * kTX + tx) * VW;  // padded instances: a chunk is wholly in or past head_dim
      if (!kPadded || col < head_dim) store_vec<VW>(o_row + col, out + c * VW);
    }
    if (p.lse != nullptr && tx == 0)
      p.lse[bh * p.Sq + row] = l_total > 0.0f ? (m[i] + log2f(l_total)) * kLn2 : -CUDART_INF_F;
  }
  // END SOLUTION
}

// A TileConfig under this file's own name, so the kernels keep the names that the committed ncu
// tables record (fused_fast_kernel<FastConfig<...>>). A sliding window takes its own instance
// (FastWindowConfig): its tests cost the plain kernel registers (Br=128 at D=64 spilled 16 bytes
// more, ptxas, CUDA 13.0).
template <int D, int BR, int BC, int MIN_BLOCKS>
struct FastConfig : TileConfig<D, BR, BC, MIN_BLOCKS> {
  static constexpr bool kWindow = false;
  static constexpr bool kPadded = false;
};
template <int D, int BR, int BC, int MIN_BLOCKS>
struct FastWindowConfig : TileConfig<D, BR, BC, MIN_BLOCKS> {
  static constexpr bool kWindow = true;
  static constexpr bool kPadded = false;
};
// The padded instances: D_TILE columns of tile for a head dim read at run time (p.head_dim).
template <int D_TILE, int BR, int BC, int MIN_BLOCKS, bool WINDOW>
struct FastPaddedConfig : TileConfig<D_TILE, BR, BC, MIN_BLOCKS> {
  static constexpr bool kWindow = WINDOW;
  static constexpr bool kPadded = true;
  static_assert(TileConfig<D_TILE, BR, BC, MIN_BLOCKS>::kSmemBytes <= course::kSmemPerBlockEverywhere,
                "padded tiles must fit the shared memory a block may have on every GPU (99 KiB)");
};

template <int D, int BR, int BC, int MIN_BLOCKS>
void launch_config(const FusedParams& p, cudaStream_t stream) {
  if (p.window > 0) {
    using Cfg = FastWindowConfig<D, BR, BC, MIN_BLOCKS>;
    launch_tiles<Cfg, fused_fast_kernel<Cfg>>(p, stream);
  } else {
    using Cfg = FastConfig<D, BR, BC, MIN_BLOCKS>;
    launch_tiles<Cfg, fused_fast_kernel<Cfg>>(p, stream);
  }
}

template <int D_TILE, int BR, int BC, int MIN_BLOCKS>
void launch_padded_config(const FusedParams& p, cudaStream_t stream) {
  if (p.window > 0) {
    using Cfg = FastPaddedConfig<D_TILE, BR, BC, MIN_BLOCKS, true>;
    launch_tiles<Cfg, fused_fast_kernel<Cfg>>(p, stream);
  } else {
    using Cfg = FastPaddedConfig<D_TILE, BR, BC, MIN_BLOCKS, false>;
    launch_tiles<Cfg, fused_fast_kernel<Cfg>>(p, stream);
  }
}

// A head dim without an instance of its own runs on the tiles of the next multiple of 32, D_TILE:
// the fewer rows per block the wider the tile, so that the registers hold O (TM rows x D_TILE / 16
// floats per thread) and the shared memory stays within 99 KiB on every GPU.
void launch_padded(const FusedParams& p, int D, cudaStream_t stream) {
  TORCH_CHECK(fast_supports_head_dim(D), "q: head dim D=", D, " is not supported by the fast kernel: use a "
              "multiple of ", kHeadDimStep, " from ", kMinHeadDim, " to ", kMaxHeadDim);
  switch (course::ceil_div(D, 32)) {
    // <D_TILE, Br, Bc, blocks per SM the registers are sized for>
    case 1: return launch_padded_config<32, 64, 64, 2>(p, stream);
    case 2: return launch_padded_config<64, 64, 64, 2>(p, stream);
    case 3: return launch_padded_config<96, 64, 32, 2>(p, stream);
    case 4: return launch_padded_config<128, 64, 32, 2>(p, stream);
    case 5: return launch_padded_config<160, 32, 32, 2>(p, stream);
    case 6: return launch_padded_config<192, 32, 32, 2>(p, stream);
    case 7: return launch_padded_config<224, 32, 32, 2>(p, stream);
    default: return launch_padded_config<256, 32, 16, 2>(p, stream);
  }
}

}  // namespace

int fast_variant_count(int D) { return (D == 64 || D == 128) ? 2 : 1; }

// Variant 0 of D = 64 and 128 needs more shared memory than sm_86/89 give a block (99 KiB): there
// the default is the first variant that fits this GPU.
template <int D, int BR, int BC, int MIN_BLOCKS>
bool fits_this_gpu() {
  return FastConfig<D, BR, BC, MIN_BLOCKS>::kSmemBytes <= course::shared_memory_per_block(c10::cuda::current_device());
}

void launch_fast(const FusedParams& p, int D, int variant, cudaStream_t stream) {
  TORCH_CHECK(variant >= 0 && variant < fast_variant_count(D), "variant must be in [0, ",
              fast_variant_count(D), ") for D=", D, ", got ", variant);
  switch (D) {
    // <D, Br, Bc, blocks per SM the registers are sized for>
    case 32: return launch_config<32, 64, 64, 2>(p, stream);
    case 64:
      return variant == 0 && fits_this_gpu<64, 128, 64, 2>() ? launch_config<64, 128, 64, 2>(p, stream)
                                                             : launch_config<64, 64, 64, 2>(p, stream);
    case 80: return launch_config<80, 64, 64, 2>(p, stream);
    case 96: return launch_config<96, 64, 64, 2>(p, stream);
    case 128:
      return variant == 0 && fits_this_gpu<128, 64, 64, 1>() ? launch_config<128, 64, 64, 1>(p, stream)
                                                             : launch_config<128, 64, 32, 2>(p, stream);
    default: return launch_padded(p, D, stream);
  }
}

}  // namespace phase5
