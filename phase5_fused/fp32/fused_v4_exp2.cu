// Phase 5, FP32 fused attention, version 4 of 5: version 3 plus exp2 with the softmax scale folded
// in, and per-thread partial row sums.
//
// The versions of this lesson, each one idea further than the one before (README.md, "Versions";
// `diff` two neighbours to see the idea):
//   v1 fused_teaching.cu           one thread per query row, Algorithm 1 as written: the reference
//   v2 fused_v2_register_tiles.cu  register tiles of S and O, float4 Q K^T from padded rows: each
//                                  shared-memory load feeds TM or TN FMAs instead of one
//   v3 fused_v3_cp_async.cu        cp.async, K and V double-buffered: the loads overlap the math
//   v4 fused_v4_exp2.cu            exp2f with the scale folded into log2(e), per-thread partial row
//                                  sums: fewer instructions per score
//   v5 fused_fast.cu               a mask-free branch for the tiles that need no mask, strided keys
//                                  gathered, heaviest query blocks first
//
// What this version adds (ideas 4 and 5 of fused_fast.cu's header):
//   4. exp2f with the softmax scale folded into log2(e): x = s * scale * log2(e) is one FMUL (one
//      FFMA with the mask's bias), and exp(s*scale - m) = exp2(x - m') with m' the running max in
//      log2 units: one MUFU.EX2, where expf also multiplies by log2(e) first.
//   5. The row sum l stays a per-thread partial (each of the 16 threads of a row sums its own
//      columns): the 16 partials are added once, after the last tile, not once per tile.
// Everything else is version 3's: 16 x 16 threads, TM x TN scores per thread, cp.async with K and
// V double-buffered, every score masked through course::mask_bias (causal, stride, the user's
// mask), key tiles past the block's last causal row or past key_lengths[b] skipped.
//
// One tile configuration per D, fused_fast.cu's default except at D=64, where Br=128 spills
// (268 bytes of spill stores in version 4, ptxas -v, CUDA 13.0): Br=64 there, fused_fast.cu's
// variant 1.   D=32, 64, 80, 96: Br=64, Bc=64 (2 blocks/SM)     D=128: Br=64, Bc=64 (1 block/SM)
#include <cuda_runtime.h>
#include <math_constants.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include "attention_mask.cuh"
#include "common.cuh"
#include "cp_async.cuh"
#include "fused.h"

namespace phase5 {
namespace {

constexpr int kThreads = 256;
constexpr int kTX = 16;  // threads along the key / output-column direction
constexpr int kTY = 16;  // threads along the query-row direction
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kSmemPerSM = 233472;     // H100: 228 KiB of shared memory per SM
constexpr int kSmemPerBlockMax = 232448;  // 227 KiB per block
constexpr int kSmemReservedPerBlock = 1024;

// Copy ROWS rows of D floats into shared memory (row pitch LD floats). Tile row r is global row
// first + r of `head` ([rows, D] row-major); rows at or past `limit` are zero-filled.
template <int D, int ROWS, int LD>
__device__ __forceinline__ void load_rows_async(float* dst, const float* head, int64_t first,
                                                int64_t limit) {
  constexpr int kChunks = D / 4;  // 16-byte chunks per row
  constexpr int kTotal = ROWS * kChunks;
  static_assert(kTotal % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int n = 0; n < kTotal / kThreads; ++n) {
    const int c = n * kThreads + threadIdx.x;
    const int r = c / kChunks;
    const int col = (c % kChunks) * 4;
    const int64_t row = first + r;
    const bool valid = row < limit;
    course::cp_async_16(course::smem_u32(dst + r * LD + col), head + (valid ? row * D + col : 0), valid);
  }
}

// ------------------------------------------------------------------------------------------------
// Small vector helpers: VW consecutive floats of a row of V or O (VW = 4, 2 or 1).

template <int VW>
__device__ __forceinline__ void load_vec(float (&dst)[VW], const float* src) {
  if constexpr (VW == 4) {
    const float4 t = *reinterpret_cast<const float4*>(src);
    dst[0] = t.x; dst[1] = t.y; dst[2] = t.z; dst[3] = t.w;
  } else if constexpr (VW == 2) {
    const float2 t = *reinterpret_cast<const float2*>(src);
    dst[0] = t.x; dst[1] = t.y;
  } else {
    dst[0] = *src;
  }
}

template <int VW>
__device__ __forceinline__ void store_vec(float* dst, const float* src) {
  if constexpr (VW == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(src[0], src[1], src[2], src[3]);
  } else if constexpr (VW == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(src[0], src[1]);
  } else {
    dst[0] = src[0];
  }
}

__device__ __forceinline__ float component(const float4& v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

// ------------------------------------------------------------------------------------------------
// The tile configuration of one template instance.

template <int D_, int BR_, int BC_, int MIN_BLOCKS_>
struct TileConfig {
  static constexpr int D = D_, Br = BR_, Bc = BC_;
  // Blocks per SM the register budget is sized for (__launch_bounds__): 2 gives 128 registers.
  static constexpr int kMinBlocks = MIN_BLOCKS_;
  static constexpr int TM = Br / kTY;  // query rows per thread
  static constexpr int TN = Bc / kTX;  // key columns of S per thread
  // O columns per thread: OC chunks of VW consecutive floats, chunk c at column (c*16 + tx)*VW.
  static constexpr int VW = (D % (4 * kTX) == 0) ? 4 : (D % (2 * kTX) == 0) ? 2 : 1;
  static constexpr int OC = D / (kTX * VW);
  static constexpr int LDQ = D + 4;   // pitch of Q, K, V rows: +4 floats shifts each row 4 banks
  static constexpr int LDP = Bc + 4;  // pitch of P rows
  static constexpr int kSmemFloats = Br * LDQ + 2 * Bc * LDQ + Br * LDP;  // Q, K, V, P
  static constexpr int kSmemBytes = kSmemFloats * 4;
  static constexpr int kBlocksBySmem = kSmemPerSM / (kSmemBytes + kSmemReservedPerBlock);

  static_assert(D % 16 == 0, "D must be a multiple of 16 (16 threads share the O columns)");
  static_assert(Br % kTY == 0 && Bc % kTX == 0, "Br and Bc must be multiples of the 16x16 grid");
  static_assert(Bc % 4 == 0, "P V reads P in float4 steps along Bc");
  static_assert(OC * kTX * VW == D, "the O columns must split evenly over the 16 threads of a row");
  static_assert(kSmemBytes <= kSmemPerBlockMax, "tiles must fit in 227 KiB of shared memory");
  static_assert(kBlocksBySmem >= kMinBlocks, "kMinBlocks blocks must fit in an SM's shared memory");
};

// ------------------------------------------------------------------------------------------------
// The kernel. Grid: one block per (query block, batch*head), query blocks in order.

template <typename Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) fused_v4_kernel(FusedParams p) {
  constexpr int D = Cfg::D, Br = Cfg::Br, Bc = Cfg::Bc, TM = Cfg::TM, TN = Cfg::TN;
  constexpr int VW = Cfg::VW, OC = Cfg::OC, LDQ = Cfg::LDQ, LDP = Cfg::LDP;

  extern __shared__ float4 smem_f4[];
  float* Qs = reinterpret_cast<float*>(smem_f4);  // [Br][LDQ]  Q_i
  float* Ks = Qs + Br * LDQ;                      // [Bc][LDQ]  K_j
  float* Vs = Ks + Bc * LDQ;                      // [Bc][LDQ]  V_j
  float* Ps = Vs + Bc * LDQ;                      // [Br][LDP]  P_ij = exp(S_ij - m_i)

  const int tx = threadIdx.x % kTX;
  const int ty = threadIdx.x / kTX;

  // Which query block and head.
  const int64_t BH = p.B * p.H;
  const int64_t bh = blockIdx.x % BH;
  const int64_t qblock = static_cast<int64_t>(blockIdx.x) / BH;
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qblock * Br;

  const float* q_head = p.q + bh * p.Sq * D;
  const float* k_head = p.k + bh * p.Sk * D;
  const float* v_head = p.v + bh * p.Sk * D;

  // The keys this block can see: j < kv_limit (padding) and, under causal masking, j <= its last
  // row, so the loop over tiles stops at kv_end. Stride and the user's mask are masked per score.
  const int64_t kv_limit =
      p.key_lengths ? static_cast<int64_t>(p.key_lengths[b]) : p.Sk;  // clamped on the host
  const int64_t i_last = (i0 + Br < p.Sq ? i0 + Br : p.Sq) - 1;
  const int64_t kv_end = p.masking.causal && i_last + 1 < kv_limit ? i_last + 1 : kv_limit;
  const int64_t n_tiles = course::ceil_div<int64_t>(kv_end, Bc);
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

  if (n_tiles > 0) {
    // Prologue: Q_i and K_0 in one group.
    load_rows_async<D, Br, LDQ>(Qs, q_head, i0, p.Sq);
    load_rows_async<D, Bc, LDQ>(Ks, k_head, 0, kv_end);
    course::cp_async_commit();
  }

  for (int64_t tile = 0; tile < n_tiles; ++tile) {
    const int64_t t0 = tile * Bc;  // first key of this tile

    // Step 1: K_j (and Q_i) landed; every thread has finished P_{j-1} V_{j-1}, so V and P are free.
    course::cp_async_wait<0>();
    __syncthreads();
    // Step 2: start V_j; it lands while S_j and its softmax are computed.
    load_rows_async<D, Bc, LDQ>(Vs, v_head, t0, kv_end);
    course::cp_async_commit();

    // Step 3: S_ij = Q_i K_j^T, TM x TN per thread, float4 steps along D.
    float s[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int n = 0; n < TN; ++n) s[i][n] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; d += 4) {
      float4 kf[TN];
#pragma unroll
      for (int n = 0; n < TN; ++n)
        kf[n] = *reinterpret_cast<const float4*>(Ks + (tx + kTX * n) * LDQ + d);
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const float4 qf = *reinterpret_cast<const float4*>(Qs + (ty + kTY * i) * LDQ + d);
#pragma unroll
        for (int n = 0; n < TN; ++n) {
          s[i][n] = fmaf(qf.x, kf[n].x, s[i][n]);
          s[i][n] = fmaf(qf.y, kf[n].y, s[i][n]);
          s[i][n] = fmaf(qf.z, kf[n].z, s[i][n]);
          s[i][n] = fmaf(qf.w, kf[n].w, s[i][n]);
        }
      }
    }

    // Step 4: scale into log2 units and mask every score: -inf for rows past Sq, keys past
    // kv_limit, and whatever course::mask_bias hides (causal, stride, the user's mask).
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int64_t row = i0 + ty + kTY * i;
#pragma unroll
      for (int n = 0; n < TN; ++n) {
        const int64_t key = t0 + tx + kTX * n;
        float x = -CUDART_INF_F;
        if (row < p.Sq && key < kv_limit) {
          const float bias = course::mask_bias(p.masking, b, h, row, key);
          if (bias != -CUDART_INF_F) x = fmaf(s[i][n], scale_log2, bias * kLog2e);
        }
        s[i][n] = x;
      }
    }

    // BEGIN SOLUTION: Port of fused_teaching.cu's online-softmax TODO (Lines 10-13) as Step 5 here, once the teaching kernel's tests pass: for this thread's TM rows, with the scores in log2 units (exp2f), a row's max shared by the kTX threads of the row (shuffles), and l kept as a per-thread partial sum (idea 5 above) (README: Versions)
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
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int n = 0; n < TN; ++n) Ps[(ty + kTY * i) * LDP + tx + kTX * n] = s[i][n];
    __syncthreads();  // P visible; every thread is done with K_j

    // Step 7: start K_{j+1}; it lands while P V runs. (An empty group keeps the count uniform.)
    if (tile + 1 < n_tiles) load_rows_async<D, Bc, LDQ>(Ks, k_head, t0 + Bc, kv_end);
    course::cp_async_commit();
    course::cp_async_wait<1>();  // everything but K_{j+1}: V_j has landed
    __syncthreads();

    // Step 8: O_i += P_ij V_j: per 4 keys, TM float4 of P and OC vectors of V per key.
#pragma unroll 4
    for (int jc = 0; jc < Bc; jc += 4) {
      float4 pf[TM];
#pragma unroll
      for (int i = 0; i < TM; ++i)
        pf[i] = *reinterpret_cast<const float4*>(Ps + (ty + kTY * i) * LDP + jc);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        float vf[OC][VW];
#pragma unroll
        for (int c = 0; c < OC; ++c) load_vec<VW>(vf[c], Vs + (jc + jj) * LDQ + (c * kTX + tx) * VW);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
          const float pij = component(pf[i], jj);
#pragma unroll
          for (int c = 0; c < OC; ++c)
#pragma unroll
            for (int e = 0; e < VW; ++e) o[i][c * VW + e] = fmaf(pij, vf[c][e], o[i][c * VW + e]);
        }
      }
    }
  }
  course::cp_async_wait<0>();  // nothing may be left in flight when the block exits

  // BEGIN SOLUTION: Port of fused_teaching.cu's Line 15 TODO as Step 9 here, once the teaching kernel's tests pass: for this thread's TM rows, the kTX partial sums of a row added first, then O / l stored VW floats at a time, and the logsumexp (one thread per row) brought back from log2 units (README: Versions)
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
    float* o_row = p.o + (bh * p.Sq + row) * D;
#pragma unroll
    for (int c = 0; c < OC; ++c) store_vec<VW>(o_row + (c * kTX + tx) * VW, out + c * VW);
    if (p.lse != nullptr && tx == 0)
      p.lse[bh * p.Sq + row] = l_total > 0.0f ? (m[i] + log2f(l_total)) * kLn2 : -CUDART_INF_F;
  }
  // END SOLUTION
}

template <int D, int BR, int BC, int MIN_BLOCKS>
void launch_config(const FusedParams& p, cudaStream_t stream) {
  using Cfg = TileConfig<D, BR, BC, MIN_BLOCKS>;
  auto kernel = fused_v4_kernel<Cfg>;
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const int64_t blocks = course::ceil_div<int64_t>(p.Sq, BR) * p.B * p.H;
  TORCH_CHECK(blocks <= 0x7fffffff, "q: too many query blocks (B*H*ceil(Sq/", BR, ")) for one grid");
  kernel<<<static_cast<unsigned>(blocks), kThreads, Cfg::kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_v4(const FusedParams& p, int D, cudaStream_t stream) {
  switch (D) {
    // <D, Br, Bc, blocks per SM the registers are sized for>
    case 32: return launch_config<32, 64, 64, 2>(p, stream);
    case 64: return launch_config<64, 64, 64, 2>(p, stream);
    case 80: return launch_config<80, 64, 64, 2>(p, stream);
    case 96: return launch_config<96, 64, 64, 2>(p, stream);
    case 128: return launch_config<128, 64, 64, 1>(p, stream);
    default: TORCH_CHECK(false, "q: head dim D=", D, " is not supported (32, 64, 80, 96, 128)");
  }
}

}  // namespace phase5
