// Phase 5, tensor cores: FlashAttention-2 forward in FP16 / BF16 on mma.sync (sm_80+).
//
// Versions (one kernel, templated on dtype, the tile's head dim Dp, padding, the mask path and the
// window):
//   tc_attention_kernel<T, Dp, P, false, W>  fast path: no user mask. Causal blocks above the
//                                            diagonal are skipped, and only diagonal / tail /
//                                            key-padding blocks pay for per-element masking.
//   tc_attention_kernel<T, Dp, P, true, W>   slower correct path for a boolean or additive user
//                                            mask: every score looks up course::mask_bias.
//   W = true: a sliding window (query i sees keys i - window < j <= i): the loop starts at the block
//   of key q0 - window + 1, so the blocks below a query block's window are never loaded. Its own
//   instance: the window's tests cost registers that the plain path (W = false) keeps.
//   P = true (kPadded): a head dim D < Dp runs on the tiles of the next instantiated Dp (32, 64, ...,
//   256): D is the tensors' row pitch and its columns d >= D are zero-filled in shared memory (never
//   read) and never stored. P = false (D == Dp) compiles without those tests.
// All take grouped-query attention: query head h reads KV head h / (H / H_kv), an index; K and V
// are never copied per query head.
// What makes it fast, against the FP32 fused kernel of this phase (see README.md):
//   - both matmuls on tensor cores: mma.sync.m16n8k16, FP16/BF16 operands, FP32 accumulators;
//   - fragments loaded by ldmatrix.x4 (.trans for V) from XOR-swizzled tiles: no bank conflicts;
//   - K/V tiles streamed by cp.async through a kStages-deep ring, so the loads of block j+1 fly
//     while block j is computed, with one __syncthreads per block;
//   - softmax statistics m, l and the output accumulator stay in FP32 registers; only P is rounded
//     to FP16/BF16, to feed the second matmul;
//   - the scale folded into the exponent (one FFMA and one ex2 per score) and O rescaled lazily.
//
// Paper notation (Dao, "FlashAttention-2", Algorithm 1): a block of Br query rows Q_i is loaded
// once; for each block of Bc keys K_j, V_j: S = Q_i K_j^T, m_new = max(m, rowmax(S)),
// P = exp(S - m_new), l = e^(m - m_new) l + rowsum(P), O = e^(m - m_new) O + P V_j; finally O / l.
// Each of the 4 warps owns Br/4 query rows, so the row statistics never leave a warp.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "attention_args.h"
#include "common.cuh"
#include "cp_async.cuh"
#include "shared_memory_opt_in.h"
#include "tc_attention.h"
#include "tc_mma.cuh"

namespace phase5_tc {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * course::kWarpSize;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// Lazy rescaling: a warp raises its rows' running max only when a score exceeds it by more than
// this (log2 units), so P = 2^(c S - m) stays <= 2^8 between rescales.
constexpr float kLazyLog2 = 8.0f;

// The max of row lane/4 + 8r of an m16 tile of S (this thread's n8 fragments, then the 4 lanes
// that share the row).
template <int kN>
__device__ __forceinline__ float row_max_of(const float (&s)[kN][4], int r) {
  float x = -CUDART_INF_F;
#pragma unroll
  for (int nt = 0; nt < kN; ++nt) x = fmaxf(x, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
  x = fmaxf(x, __shfl_xor_sync(course::kFullMask, x, 1));
  return fmaxf(x, __shfl_xor_sync(course::kFullMask, x, 2));
}

// Tile sizes per tile head dim Dp: Br query rows per block (Br / 4 per warp), Bc keys per K/V
// block, kStages K/V blocks in the cp.async ring. Shared memory = (Br + 2 kStages Bc) Dp * 2 bytes;
// two blocks per SM must fit in 227 KB, and the S and O accumulators of a warp's Br/4 rows in at
// most 255 registers per thread. Dp = 64 and 128 take the tiles that measured fastest (README:
// "Tiles by measurement"): at Dp = 64 blocks of 64 keys in three stages (FlashAttention-2's
// 128 x 128 spills here, and measured slower); at Dp = 128 FlashAttention-2's 128 x 64 in two
// stages (README: "D = 128 on FlashAttention-2's tile"). At Dp = 160 a warp's 32 rows still
// fit with Bc = 32 (FlashAttention-2's 128 x 32); from Dp = 192 their O accumulator alone would take
// 192+ registers, so a warp owns 16 rows (Br = 64), and Bc is the largest that keeps two blocks per
// SM and divides the copies among the threads.
//   Dp   Br   Bc   stages  smem     FP32 registers per thread for S + O
//   32   128  128  3       56 KB    128 + 32
//   64   128  64   3       64 KB    64 + 64
//   96   128  64   2       72 KB    64 + 96
//   128  128  64   2       96 KB    64 + 128
//   160  128  32   3       100 KB   32 + 160
//   192  64   48   2       96 KB    24 + 96
//   224  64   32   2       84 KB    16 + 112
//   256  64   32   2       96 KB    16 + 128
template <int Dp>
struct Tile;
template <>
struct Tile<32> {
  static constexpr int kBr = 128, kBc = 128, kStages = 3;
};
template <>
struct Tile<64> {
  static constexpr int kBr = 128, kBc = 64, kStages = 3;
};
template <>
struct Tile<96> {
  static constexpr int kBr = 128, kBc = 64, kStages = 2;
};
template <>
struct Tile<128> {
  static constexpr int kBr = 128, kBc = 64, kStages = 2;
};
template <>
struct Tile<160> {
  static constexpr int kBr = 128, kBc = 32, kStages = 3;
};
template <>
struct Tile<192> {
  static constexpr int kBr = 64, kBc = 48, kStages = 2;
};
template <>
struct Tile<224> {
  static constexpr int kBr = 64, kBc = 32, kStages = 2;
};
template <>
struct Tile<256> {
  static constexpr int kBr = 64, kBc = 32, kStages = 2;
};

template <int Dp, typename T>
constexpr size_t smem_bytes() {
  return static_cast<size_t>(Tile<Dp>::kBr + 2 * Tile<Dp>::kStages * Tile<Dp>::kBc) * Dp * sizeof(T);
}

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;              // [B, H, Sq] natural-log row logsumexp (the backward's input), or nullptr
  const int* key_lengths;  // [B], clamped to [0, Sk]; nullptr: every key is valid
  int H, Sq, Sk;
  int H_kv;          // KV heads of k and v: query head h reads KV head h / (H / H_kv)
  float scale_log2;  // c = scale * log2(e) > 0 (the host sees to it): exp(scale x) = 2^(c x)
  int window;        // sliding window with causal masking (< Sq; kWindow instances only)
  course::AttentionMasking masking;
};

// Copy rows [row0, row0 + kRows) of a row-major [rows, D] matrix into a swizzled shared [kRows][Dp]
// tile with cp.async; rows at or beyond row_limit, and with kPadded the columns d >= D, are
// zero-filled and never read from global memory (D % 8 == 0: a 16-byte chunk is wholly in or out).
// When kChunks divides the block in a multiple of 8 rows, thread t copies chunk t % kChunks of rows
// t / kChunks + n kRowStep: the swizzle is the same for all its rows and every address is one base
// plus constants (no registers held across the main loop). Dp = 96, 160, 224 (12, 20, 28 chunks a
// row) and 256 (4 rows per step) take the general loop, whose chunks are 32-bit offsets from the
// tile's first row (64-bit row addresses per chunk held more registers, and spilled at Dp = 96).
template <typename T, int Dp, int kRows, bool kPadded>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int row0, int row_limit, int D) {
  constexpr int kChunks = Dp / 8;
  static_assert((kRows * kChunks) % kThreads == 0, "every thread copies the same number of chunks");
  const int t = static_cast<int>(threadIdx.x);
  if constexpr (kThreads % kChunks == 0 && (kThreads / kChunks) % 8 == 0) {
    constexpr int kRowStep = kThreads / kChunks;
    static_assert(kRows % kRowStep == 0, "a fixed swizzle per thread");
    const int r0 = t / kChunks;
    const int c = t % kChunks;
    const bool col_valid = !kPadded || c * 8 < D;
    const uint32_t dst = course::smem_u32(tile + r0 * Dp + tc::swizzle<kChunks>(r0, c) * 8);
    const T* from = src + (static_cast<int64_t>(row0) + r0) * D + c * 8;
    if (row0 + kRows <= row_limit) {  // a whole tile: no per-row checks
#pragma unroll
      for (int n = 0; n < kRows / kRowStep; ++n)
        course::cp_async_16(dst + n * kRowStep * Dp * sizeof(T), col_valid ? from + n * kRowStep * D : src,
                            col_valid);
    } else {
#pragma unroll
      for (int n = 0; n < kRows / kRowStep; ++n) {
        const bool valid = col_valid && row0 + r0 + n * kRowStep < row_limit;
        course::cp_async_16(dst + n * kRowStep * Dp * sizeof(T), valid ? from + n * kRowStep * D : src, valid);
      }
    }
  } else {
    const T* tile_src = src + static_cast<int64_t>(row0) * D;
#pragma unroll
    for (int n = 0; n < kRows * kChunks / kThreads; ++n) {
      const int idx = n * kThreads + t;
      const int r = idx / kChunks;
      const int c = idx % kChunks;
      const bool valid = row0 + r < row_limit && (!kPadded || c * 8 < D);
      const T* from = valid ? tile_src + r * D + c * 8 : src;
      course::cp_async_16(course::smem_u32(tile + r * Dp + tc::swizzle<kChunks>(r, c) * 8), from, valid);
    }
  }
}

template <typename T, int Dp, bool kPadded, bool kHasMask, bool kWindow>
__global__ void __launch_bounds__(kThreads, 2) tc_attention_kernel(const Params p, const int head_dim) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // mma.sync m16n8k16 and cp.async need sm_80; the host refuses older GPUs first
#else
  constexpr int kBr = Tile<Dp>::kBr;
  constexpr int kBc = Tile<Dp>::kBc;
  constexpr int kStages = Tile<Dp>::kStages;
  constexpr bool kFold = !kHasMask;  // the scale folded into the exponent (the softmax below)
  // Dp = 64 without a mask or a window: Q's A fragments loaded once into registers (32 per thread)
  // instead of by ldmatrix in every key block (README: "Q in registers").
  constexpr bool kQInRegisters = Dp == 64 && !kHasMask && !kWindow;
  constexpr int kChunks = Dp / 8;           // 16-byte chunks per tile row
  constexpr int kWarpRows = kBr / kWarps;   // query rows owned by one warp
  constexpr int kM = kWarpRows / 16;        // m16 tiles of a warp's rows
  constexpr int kN = kBc / 8;               // n8 tiles of S (keys)
  constexpr int kDn = Dp / 8;               // n8 tiles of O (head dim)
  static_assert(kBr % (16 * kWarps) == 0, "each warp owns whole m16 tiles of query rows");
  static_assert(kBc % 16 == 0 && Dp % 16 == 0, "both matmuls step over k in 16s (m16n8k16)");
  static_assert(Dp % 32 == 0, "the swizzle needs rows of a multiple of 64 bytes");
  static_assert(kStages >= 2, "the K/V ring needs a block being computed and one in flight");

  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);   // [Br][Dp], reused for the output tile at the end
  T* sK = sQ + kBr * Dp;                // [kStages][Bc][Dp]
  T* sV = sK + kStages * kBc * Dp;      // [kStages][Bc][Dp]

  const int warp = static_cast<int>(threadIdx.x) / course::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % course::kWarpSize;
  const int q_block = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // long causal rows start first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int q0 = q_block * kBr;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int64_t bh_kv = static_cast<int64_t>(b) * p.H_kv + h / (p.H / p.H_kv);  // GQA: this head's KV head
  const int D = kPadded ? head_dim : Dp;  // the tensors' row pitch; tile columns D..Dp-1 stay zeros
  const T* Q = static_cast<const T*>(p.q) + bh * p.Sq * D;
  const T* K = static_cast<const T*>(p.k) + bh_kv * p.Sk * D;
  const T* V = static_cast<const T*>(p.v) + bh_kv * p.Sk * D;
  T* O = static_cast<T*>(p.o) + bh * p.Sq * D;
  const bool causal = p.masking.causal;

  // Keys this block visits: the batch's valid keys, and with causal only up to the last row's
  // diagonal (blocks above it are skipped, never loaded); with a window, only from the block of
  // the first row's first visible key q0 - window + 1 (blocks below it are skipped too).
  const int kv_len = p.key_lengths != nullptr ? p.key_lengths[b] : p.Sk;
  const int kv_end = causal ? min(kv_len, q0 + kBr) : kv_len;
  const int n_blocks = course::ceil_div(kv_end, kBc);
  const int window = kWindow ? p.window : 0;
  const int j_begin = kWindow && q0 - window + 1 > 0 ? (q0 - window + 1) / kBc : 0;

  // Load Q_i, then the first kStages - 1 blocks of K and V (one commit group per block). Block j
  // goes to ring stage j % kStages.
  load_tile<T, Dp, kBr, kPadded>(sQ, Q, q0, p.Sq, D);
  course::cp_async_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const int j = j_begin + s;
    if (j < n_blocks) {
      load_tile<T, Dp, kBc, kPadded>(sK + (j % kStages) * kBc * Dp, K, j * kBc, kv_len, D);
      load_tile<T, Dp, kBc, kPadded>(sV + (j % kStages) * kBc * Dp, V, j * kBc, kv_len, D);
    }
    course::cp_async_commit();
  }

  // Per thread: O fragments of the warp's rows, and m, l for its two rows of each m16 tile
  // (rows lane/4 and lane/4 + 8). l is this lane's partial sum, reduced over 4 lanes at the end.
  float o[kM][kDn][4];
  float m[kM][2];
  float l[kM][2];
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int dn = 0; dn < kDn; ++dn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dn][e] = 0.0f;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[mt][r] = -CUDART_INF_F;
      l[mt][r] = 0.0f;
    }
  }
  const int warp_row0 = warp * kWarpRows;  // first row of this warp inside the tile
  const int warp_q0 = q0 + warp_row0;      // ... and in the sequence
  // ldmatrix lane addresses (see the matmuls below for which lane reads which row and chunk).
  const uint32_t lane_offset = tc::lane_tile_offset<Dp>(lane);
  const uint32_t lane_offset_b = tc::lane_tile_offset_b<Dp>(lane);  // K as the B operand of S
  const uint32_t q_lane = course::smem_u32(sQ + warp_row0 * Dp) + lane_offset;
  uint32_t q_frag[kQInRegisters ? kM : 1][kQInRegisters ? Dp / 16 : 1][4];  // with kQInRegisters

  // One step of the key loop, for block j: S = Q_i K_j^T, the online softmax, O += P V_j. A
  // masked step (kMasked) tests every score against the masks; the unmasked copy has no mask code
  // at all, and the loops below give it every block in which no row of this tile can be hidden.
  auto key_block = [&](const int j, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    // Wait for K_j, V_j (and Q at the first block); the barrier makes every thread's copies
    // visible and tells us that all warps are done with block j - 1, whose stage is refilled next.
    course::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int jn = j + kStages - 1;
      if (jn < n_blocks) {
        const int stage = jn % kStages;
        load_tile<T, Dp, kBc, kPadded>(sK + stage * kBc * Dp, K, jn * kBc, kv_len, D);
        load_tile<T, Dp, kBc, kPadded>(sV + stage * kBc * Dp, V, jn * kBc, kv_len, D);
      }
      course::cp_async_commit();  // an empty group past the end keeps the wait count uniform
    }
    if constexpr (kQInRegisters) {  // Q landed with the first block: its fragments, once
      if (j == j_begin) {
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
          for (int kk = 0; kk < Dp / 16; ++kk) tc::ldmatrix_x4(q_frag[mt][kk], tc::ldsm_addr<Dp>(q_lane, mt * 16, 2 * kk));
        }
      }
    }
    const int kv0 = j * kBc;
    const uint32_t k_lane = course::smem_u32(sK + (j % kStages) * kBc * Dp) + lane_offset_b;
    const uint32_t v_lane = course::smem_u32(sV + (j % kStages) * kBc * Dp) + lane_offset;

    // Causal: when every key of the block lies above this warp's last row, its scores are all
    // hidden and the warp has nothing to do for this block. Window: likewise when every key lies
    // at or below the warp's first row minus the window. (Only masked blocks can be such blocks.)
    if constexpr (kMasked) {
      if (causal && kv0 > warp_q0 + kWarpRows - 1) return;
      if (kWindow && kv0 + kBc - 1 <= warp_q0 - window) return;
    }

    // S = Q_i K_j^T on tensor cores, k = head dim in steps of 16. A (Q rows 0-15, chunks 2kk and
    // 2kk+1) is the ldmatrix.x4 as loaded. B = K^T needs no transpose: with the second lane pattern
    // (tc_mma.cuh) the 8x8 matrices of K, (keys 0-7 | 8-15) x (chunk 2kk | 2kk+1) taken chunk first,
    // are b0, b1 of n8 tile 2np, then b0, b1 of tile 2np + 1.
    float s[kM][kN][4];
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk) {
      uint32_t a[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        if constexpr (kQInRegisters) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[mt][r] = q_frag[mt][kk][r];
        } else {
          tc::ldmatrix_x4(a[mt], tc::ldsm_addr<Dp>(q_lane, mt * 16, 2 * kk));
        }
      }
#pragma unroll
      for (int np = 0; np < kN / 2; ++np) {
        uint32_t bk[4];
        tc::ldmatrix_x4(bk, tc::ldsm_addr<Dp>(k_lane, np * 16, 2 * kk));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          tc::mma_16816<T>(s[mt][2 * np], a[mt], bk[0], bk[1]);
          tc::mma_16816<T>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    // Mask per element, in masked blocks only: keys past the valid length, the causal diagonal,
    // the window's lower edge (-inf = hidden), or the user's mask. Without a user mask the scores
    // stay unscaled: c > 0 keeps their row max where it is, and the exponent below applies the
    // scale in the same FFMA that subtracts the max. A user mask is a bias in log2 units added
    // after the scale, so that instance scales first (kFold = false).
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = kFold ? s[mt][nt][e] : s[mt][nt][e] * p.scale_log2;
          if constexpr (kMasked) {
            const int i = warp_q0 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
            const int jj = kv0 + nt * 8 + (lane & 3) * 2 + (e & 1);
            if (jj >= kv_len || (causal && jj > i) || (kWindow && jj <= i - window)) {
              x = -CUDART_INF_F;
            } else if (kHasMask && i < p.Sq) {
              x += course::mask_bias(p.masking, b, h, i, jj) * kLog2e;
            }
          }
          s[mt][nt][e] = x;
        }
      }
    }

    // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax TODO (Lines 10-13), once the teaching kernel's tests pass, on this thread's fragments: it holds two rows of every m16 tile (rows lane/4 and lane/4 + 8), whose columns are spread over the 4 lanes with the same lane/4 (a row's max needs all four); the scores are in log2 units (tc::exp2_approx) and l stays the lane's partial sum (README: Why the softmax stays in FP32)
    // Online softmax in FP32, m in log2 units: m_new = max(m, c rowmax(S)), P = 2^(c S - m_new)
    // (one FFMA and one ex2 per score; with kFold = false S is already c S),
    // l = 2^(m - m_new) l + rowsum(P), O = 2^(m - m_new) O. A row with no visible key so far keeps
    // m = -inf; it subtracts 0 instead, so P = 0 and the rescale factor is 0, never NaN.
    // Lazy rescaling: m is raised only when some row of the warp has a score more than kLazyLog2
    // above its m (a warp-wide vote, so the warp never diverges). Otherwise every row keeps its m:
    // P = 2^(c S - m) <= 2^kLazyLog2, far inside FP16/BF16, and l and O skip their rescale for this
    // block. O / l is unchanged, since l and O always share the m they were summed against. (A
    // raising block computes the row maxima twice: no register holds them across the vote.)
    const float c = kFold ? p.scale_log2 : 1.0f;  // what turns S into log2 units here
    bool raise = false;
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) raise |= row_max_of<kN>(s[mt], r) * c > m[mt][r] + kLazyLog2;
    }
    raise = __any_sync(course::kFullMask, raise);
    if (raise) {
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m_new = fmaxf(m[mt][r], row_max_of<kN>(s[mt], r) * c);
          const float alpha = tc::exp2_approx(m[mt][r] - (m_new == -CUDART_INF_F ? 0.0f : m_new));
          m[mt][r] = m_new;
          l[mt][r] *= alpha;
#pragma unroll
          for (int dn = 0; dn < kDn; ++dn) {
            o[mt][dn][2 * r] *= alpha;
            o[mt][dn][2 * r + 1] *= alpha;
          }
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_use = m[mt][r] == -CUDART_INF_F ? 0.0f : m[mt][r];
        float row_sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[mt][nt][e] = tc::exp2_approx(fmaf(s[mt][nt][e], c, -m_use));
            row_sum += s[mt][nt][e];
          }
        }
        l[mt][r] += row_sum;
      }
    }
    // END SOLUTION

    // O += P V_j on tensor cores, k = keys in steps of 16. P is rounded to T in registers: the C
    // fragments of S tiles 2kk and 2kk+1 are exactly the A fragment of keys 16kk..16kk+15. B = V
    // by ldmatrix.trans: matrices (keys 0-7 | 8-15) x (chunk 2dp | 2dp+1), transposed, are b0, b1
    // of n8 tile 2dp, then b0, b1 of tile 2dp+1.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t pa[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        pa[mt][0] = tc::pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = tc::pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = tc::pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = tc::pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < Dp / 16; ++dp) {
        uint32_t bv[4];
        tc::ldmatrix_x4_trans(bv, tc::ldsm_addr<Dp>(v_lane, kk * 16, 2 * dp));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          tc::mma_16816<T>(o[mt][2 * dp], pa[mt], bv[0], bv[1]);
          tc::mma_16816<T>(o[mt][2 * dp + 1], pa[mt], bv[2], bv[3]);
        }
      }
    }
  };

  // The blocks that need no mask, [j_lo, j_hi), the same for every warp of the tile (so that no
  // warp waits at the ring's barrier on another copy of the step): keys all valid
  // (kv0 + Bc <= kv_len), with causal all at or left of the tile's first row (kv0 + Bc - 1 <= q0),
  // with a window all right of the last row's window edge (kv0 >= q0 + Br - window). The blocks
  // before them (the window's edge) and after them (the diagonal, key padding) are masked; with a
  // user mask every block is. The ring streams the blocks in order: j_begin, ..., n_blocks - 1.
  int j_lo = j_begin;
  int j_hi = j_begin;
  if constexpr (!kHasMask) {
    if (kWindow) j_lo = max(j_begin, course::ceil_div(max(q0 + kBr - window, 0), kBc));
    j_lo = min(j_lo, n_blocks);
    j_hi = causal ? min(kv_len / kBc, (q0 + 1) / kBc) : kv_len / kBc;
    j_hi = min(max(j_hi, j_lo), n_blocks);
  }
  if constexpr (kWindow) {
    for (int j = j_begin; j < j_lo; ++j) key_block(j, std::true_type{});
  }
  for (int j = j_lo; j < j_hi; ++j) key_block(j, std::false_type{});
  for (int j = j_hi; j < n_blocks; ++j) key_block(j, std::true_type{});

  // Epilogue: O / l (rows with no visible key have l = 0 and give zeros), rounded to T, staged in
  // this warp's own rows of sQ (only this warp ever read them) and stored as coalesced 16-byte rows.
  course::cp_async_wait<0>();
  __syncthreads();  // with n_blocks = 0, other threads' Q copies may still be landing in sQ
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's Line 15 TODO, once the teaching kernel's tests pass, for this thread's two rows of each m16 tile: the 4 lanes' partial sums of a row added, then O / l (zeros when l = 0) rounded to T into this warp's own rows of sQ, swizzled as the copy below reads them (tc::swizzle); when p.lse is set, one lane per row writes the logsumexp (m + log2 l) ln 2 (-inf when l = 0) (README: Design)
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float total = l[mt][r];
      total += __shfl_xor_sync(course::kFullMask, total, 1);
      total += __shfl_xor_sync(course::kFullMask, total, 2);
      const float inv = total > 0.0f ? __frcp_rn(total) : 0.0f;
      const int row = warp_row0 + mt * 16 + (lane >> 2) + r * 8;
      // The row's logsumexp, only when asked (the backward pass recomputes P from it): m is in
      // log2 units, so ln(sum exp) = (m + log2 l) ln 2.
      if (p.lse != nullptr && (lane & 3) == 0 && q0 + row < p.Sq)
        p.lse[bh * p.Sq + q0 + row] = total > 0.0f ? (m[mt][r] + log2f(total)) * kLn2 : -CUDART_INF_F;
#pragma unroll
      for (int dn = 0; dn < kDn; ++dn) {
        T* dst = sQ + row * Dp + tc::swizzle<kChunks>(row, dn) * 8 + (lane & 3) * 2;
        *reinterpret_cast<uint32_t*>(dst) = tc::pack2<T>(o[mt][dn][2 * r] * inv, o[mt][dn][2 * r + 1] * inv);
      }
    }
  }
  // END SOLUTION
  __syncwarp();
#pragma unroll
  for (int n = 0; n < kWarpRows * kChunks / course::kWarpSize; ++n) {
    const int idx = n * course::kWarpSize + lane;
    const int row = warp_row0 + idx / kChunks;
    const int c = idx % kChunks;
    if (q0 + row < p.Sq && (!kPadded || c * 8 < D)) {
      const uint4 val = *reinterpret_cast<const uint4*>(sQ + row * Dp + tc::swizzle<kChunks>(row, c) * 8);
      *reinterpret_cast<uint4*>(O + static_cast<int64_t>(q0 + row) * D + c * 8) = val;
    }
  }
#endif
}

template <typename T, int Dp, bool kPadded, bool kHasMask, bool kWindow>
void launch(const Params& p, int D, int B, cudaStream_t stream) {
  constexpr size_t smem = smem_bytes<Dp, T>();
  constexpr auto* kernel = tc_attention_kernel<T, Dp, kPadded, kHasMask, kWindow>;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TORCH_CHECK(major >= 8, "the tensor-core attention kernel needs compute capability 8.0 or newer "
              "(mma.sync m16n8k16, ldmatrix, cp.async); this GPU has ", major, ".x");
  static_assert(2 * smem <= 227 * 1024, "two blocks per SM (__launch_bounds__) must fit in 227 KB of shared memory");
  course::opt_in_shared_memory<kernel>(device, static_cast<int>(smem));
  const dim3 grid(course::ceil_div(p.Sq, Tile<Dp>::kBr), p.H, B);
  kernel<<<grid, kThreads, smem, stream>>>(p, D);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int Dp, bool kPadded>
void launch_for_mask(const Params& p, int D, int B, cudaStream_t stream) {
  const bool mask = p.masking.mask.kind != course::MaskKind::kNone;
  if (p.window > 0) {
    mask ? launch<T, Dp, kPadded, true, true>(p, D, B, stream) : launch<T, Dp, kPadded, false, true>(p, D, B, stream);
  } else {
    mask ? launch<T, Dp, kPadded, true, false>(p, D, B, stream)
         : launch<T, Dp, kPadded, false, false>(p, D, B, stream);
  }
}

template <int Dp, bool kPadded>
void launch_for_dtype(const Params& p, int D, int B, at::ScalarType dtype, cudaStream_t stream) {
  if (dtype == at::kBFloat16) {
    launch_for_mask<__nv_bfloat16, Dp, kPadded>(p, D, B, stream);
  } else {
    launch_for_mask<__half, Dp, kPadded>(p, D, B, stream);
  }
}

// D runs on the tiles of Dp, the next multiple of 32; the padded instance only when D < Dp.
template <int Dp>
void launch_for_padding(const Params& p, int D, int B, at::ScalarType dtype, cudaStream_t stream) {
  if (D == Dp) {
    launch_for_dtype<Dp, false>(p, D, B, dtype, stream);
  } else {
    launch_for_dtype<Dp, true>(p, D, B, dtype, stream);
  }
}

}  // namespace

void launch_tc_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                         float* lse, const int* key_lengths, const course::AttentionMasking& masking,
                         float scale, int window, cudaStream_t stream) {
  // The kernel takes the row max of the unscaled scores (course::fold_scale: c > 0).
  const course::FoldedScale folded = course::fold_scale(q, scale);
  Params p;
  p.q = folded.q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse;
  p.key_lengths = key_lengths;
  p.H = static_cast<int>(q.size(1));
  p.Sq = static_cast<int>(q.size(2));
  p.Sk = static_cast<int>(k.size(2));
  p.H_kv = static_cast<int>(k.size(1));
  p.window = window;
  p.scale_log2 = folded.c;
  p.masking = masking;
  const int B = static_cast<int>(q.size(0));
  const int D = static_cast<int>(q.size(3));
  TORCH_CHECK(supported_head_dim(D), "head dim D=", D, " (q.size(3)) is not supported: use a multiple of 8 from ",
              kMinHeadDim, " to ", kMaxHeadDim);
  switch (course::ceil_div(D, 32)) {
    case 1: launch_for_padding<32>(p, D, B, q.scalar_type(), stream); break;
    case 2: launch_for_padding<64>(p, D, B, q.scalar_type(), stream); break;
    case 3: launch_for_padding<96>(p, D, B, q.scalar_type(), stream); break;
    case 4: launch_for_padding<128>(p, D, B, q.scalar_type(), stream); break;
    case 5: launch_for_padding<160>(p, D, B, q.scalar_type(), stream); break;
    case 6: launch_for_padding<192>(p, D, B, q.scalar_type(), stream); break;
    case 7: launch_for_padding<224>(p, D, B, q.scalar_type(), stream); break;
    default: launch_for_padding<256>(p, D, B, q.scalar_type(), stream); break;
  }
}

}  // namespace phase5_tc
