// Phase 5, backward: FlashAttention-2's backward pass (Algorithm 2) in FP16 / BF16 on mma.sync tensor
// cores (sm_80+), with the fragment wrappers of ../tensor_cores/tc_mma.cuh. Read bwd_fp32.cu first:
// the same algorithm, the same loop order, the same ownership; here every product is a warp's
// mma.sync m16n8k16 with FP32 accumulators.
//
// One thread block per (key block j of Bc keys, batch*head); warp w owns the 16 keys 16w..16w+15
// of the block (Bc = 64 with 4 warps, the default; 128 with 8, variant 1): it keeps their dK, dV
// (16 x D, FP32) in registers for the whole loop. Per query block i (Br rows, Q_i and dO_i streamed through a 2-stage cp.async ring):
//   S^T  = K_w Q_i^T      16 x Br per warp   (the transposed scores: keys are the warp's rows)
//   dP^T = V_w dO_i^T     16 x Br
//   P^T  = exp(S^T - L),  dS^T = P^T * (dP^T - D)   elementwise on the accumulators, FP32
//   dV_w += P^T dO_i      P^T's accumulators are the A operand as they stand (rounded to T)
//   dK_w += dS^T Q_i      likewise dS^T
//   dS^T -> shared memory (T); barrier
//   dQ_i += dS K_j        contracts over all Bc keys, every warp's rows: each warp takes a slice of
//                         dQ_i's rows (and columns) and adds it to the FP32 dQ with atomicAdd
// Working with S^T (keys as rows) is what lets P and dS feed the dV and dK products straight from
// registers, as P feeds P V in the forward kernel; only dQ needs dS through shared memory.
//
// ldmatrix operands: an A or B operand whose contraction index runs along a tile's rows in shared
// memory (dO, Q, K for dV, dK, dQ) is read with ldmatrix .trans, as V in the forward kernel; K_w,
// V_w as A and Q, dO as B^T for S^T and dP^T are read plainly, as Q and K in the forward kernel.
//
// Head dims: each tile width D of kTcTileD up to kTcRowTileMaxD has an instance for rows of D
// elements and a padded one (kPadded) for a head dim below it (rows of head_dim elements): the tiles'
// columns from head_dim on are zero-filled, so they add nothing to S^T and dP^T and come out zero in
// dK, dV and dQ, whose stores stop at head_dim. The forward kernel pads the same way.
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "../tensor_cores/tc_mma.cuh"
#include "bwd.h"
#include "bwd_key_block.cuh"
#include "bwd_tc_tiles.cuh"
#include "common.cuh"
#include "cp_async.cuh"

namespace phase5_bwd {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// One tile configuration: kWarps warps, each owning 16 keys (one m16 tile), so Bc = 16 kWarps keys
// per block; Br query rows per step. Br = 32 where D >= 96 with 4 warps and at D = 128: the warp's
// dK, dV (2 x D/2 FP32 registers per thread) and its S^T, dP^T tiles (2 x Br/2) must fit in 255.
//   variant 0: 4 warps, Bc = 64, two blocks per SM
//   variant 1: 8 warps, Bc = 128, one block per SM: half the dQ atomics, and each Q_i, dO_i tile
//              loaded once for twice the keys (FlashAttention-2's Bc); run.py compares the two.
template <int D_, int kWarps_>
struct BwdTile {
  static constexpr int D = D_, kWarps = kWarps_;
  static constexpr int kThreads = kWarps * course::kWarpSize;
  static constexpr int kBc = 16 * kWarps;
  static constexpr int kBr = D <= 64 || (kWarps == 8 && D == 96) ? 64 : 32;
  static constexpr int kMinBlocks = kWarps == 4 ? 2 : 1;
  // K_j, V_j; Q_i, dO_i in 2 stages; dS^T (elements of 2 bytes); L_i, D_i in 2 stages (FP32).
  static constexpr int kSmemBytes = (2 * kBc * D + 4 * kBr * D + kBc * kBr) * 2 + 4 * kBr * 4;
};

template <typename T, typename Cfg, bool kMaskOrWindow, bool kPadded>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) tc_backward_kernel(const BwdParams p,
                                                                                    const int head_dim) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // mma.sync m16n8k16, ldmatrix and cp.async need sm_80; the host refuses older GPUs first
#else
  constexpr int D = Cfg::D, kWarps = Cfg::kWarps, kThreads = Cfg::kThreads, kBc = Cfg::kBc, kBr = Cfg::kBr;
  constexpr int kN = kBr / 8;    // n8 tiles of S^T (queries)
  constexpr int kDn = D / 8;     // n8 tiles of dK, dV (head dim)
  // dQ_i: warp w takes query rows 16 (w % kRowGroups).. and head columns (w / kRowGroups) * kDc..
  constexpr int kRowGroups = kBr / 16;
  constexpr int kColGroups = kWarps / kRowGroups;
  constexpr int kDc = D / kColGroups;
  static_assert(kWarps % kRowGroups == 0 && kDc % 16 == 0, "dQ splits evenly over the warps");
  static_assert(D % 32 == 0 && kBr % 32 == 0, "the swizzle needs rows of a multiple of 64 bytes");
  static_assert(2 * kBr <= kThreads, "one thread per L_i and per D_i of a query block");

  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // [Bc][D]
  T* sV = sK + kBc * D;                // [Bc][D]
  T* sQ = sV + kBc * D;                // [2][Br][D]
  T* sdO = sQ + 2 * kBr * D;           // [2][Br][D]
  T* sdS = sdO + 2 * kBr * D;          // [Bc][Br]   dS^T of the current step
  float* sL = reinterpret_cast<float*>(sdS + kBc * kBr);  // [2][Br]  L_i log2(e)
  float* sDelta = sL + 2 * kBr;                            // [2][Br]  D_i

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / course::kWarpSize;
  const int lane = tid % course::kWarpSize;
  const int g = lane >> 2, t = lane & 3;  // fragment row group and column pair (tc_mma.cuh)
  // The block's keys, its query blocks and its head's rows (bwd_key_block.cuh).
  const int row_len = kPadded ? head_dim : D;  // the tensors' rows; tile columns from row_len on are zeros
  const KeyBlock<T> w = key_block<T, kBc, kBr>(p, row_len);
  const int64_t bh = w.bh, b = w.b, h = w.h, k0 = w.k0, kv_len = w.kv_len, qb_first = w.qb_first;
  const int64_t n_steps = w.n_steps;
  const T *Q = w.Q, *K = w.K, *V = w.V, *dO = w.dO;
  const float *lse = w.lse, *delta = w.delta;
  float* dQ = w.dQ;
  const bool causal = p.masking.causal;

  // L_i (in log2 units) or D_i of one query row of block qb, for the thread that stages it.
  auto row_stat = [&](int64_t qb) {
    const int r = tid % kBr;
    const int64_t row = qb * kBr + r;
    if (tid < kBr) return row < p.Sq ? lse[row] * kLog2e : -CUDART_INF_F;
    return row < p.Sq ? delta[row] : 0.0f;
  };
  auto stage_stat = [&](int stage, float value) {
    if (tid < kBr) sL[stage * kBr + tid] = value;
    else if (tid < 2 * kBr) sDelta[stage * kBr + tid - kBr] = value;
  };

  // Prologue: K_j, V_j (padding keys zero-filled) and the first Q_i, dO_i in one group.
  if (n_steps > 0) {
    load_tile<T, D, kBc, kThreads, kPadded>(sK, K, k0, kv_len, head_dim);
    load_tile<T, D, kBc, kThreads, kPadded>(sV, V, k0, kv_len, head_dim);
    load_tile<T, D, kBr, kThreads, kPadded>(sQ, Q, qb_first * kBr, p.Sq, head_dim);
    load_tile<T, D, kBr, kThreads, kPadded>(sdO, dO, qb_first * kBr, p.Sq, head_dim);
    stage_stat(0, row_stat(qb_first));
  }
  course::cp_async_commit();

  // dK_w, dV_w: the warp's 16 keys x D, FP32 C fragments (rows g and g + 8, columns 2t, 2t + 1).
  float dk[kDn][4], dv[kDn][4];
#pragma unroll
  for (int dn = 0; dn < kDn; ++dn)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dn][e] = dv[dn][e] = 0.0f;
  const int64_t warp_k0 = k0 + 16 * warp;
  // ldmatrix lane addresses of the tiles (see tc::ldsm_addr).
  const uint32_t d_offset = tc::lane_tile_offset<D>(lane);
  const uint32_t d_offset_by_chunks = tc::lane_tile_offset_b<D>(lane);
  const uint32_t k_lane = course::smem_u32(sK) + d_offset;
  const uint32_t v_lane = course::smem_u32(sV) + d_offset;
  const uint32_t ds_lane = course::smem_u32(sdS) + tc::lane_tile_offset_b<kBr>(lane);

  for (int64_t step = 0; step < n_steps; ++step) {
    const int stage = static_cast<int>(step & 1);
    const int64_t q0 = (qb_first + step) * kBr;
    const uint32_t q_tile = course::smem_u32(sQ + stage * kBr * D);
    const uint32_t o_tile = course::smem_u32(sdO + stage * kBr * D);
    const uint32_t q_lane = q_tile + d_offset, o_lane = o_tile + d_offset;
    const float* sLi = sL + stage * kBr;
    const float* sDi = sDelta + stage * kBr;

    // Wait for Q_i, dO_i (and K_j, V_j); the barrier also says every warp is done with step - 1:
    // its stage and sdS are free. Then start the next query block into the other stage.
    course::cp_async_wait<0>();
    __syncthreads();
    const bool prefetch = step + 1 < n_steps;
    float next_stat = 0.0f;
    if (prefetch) {
      load_tile<T, D, kBr, kThreads, kPadded>(sQ + (stage ^ 1) * kBr * D, Q, q0 + kBr, p.Sq, head_dim);
      load_tile<T, D, kBr, kThreads, kPadded>(sdO + (stage ^ 1) * kBr * D, dO, q0 + kBr, p.Sq, head_dim);
      next_stat = row_stat(qb_first + step + 1);  // staged at the end of the step: its latency hides
    }
    course::cp_async_commit();

    // Step 1: S^T = K_w Q_i^T and dP^T = V_w dO_i^T on tensor cores, k = head dim in steps of 16.
    float s[kN][4], dp[kN][4];
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ak[4], av[4];
      tc::ldmatrix_x4(ak, tc::ldsm_addr<D>(k_lane, 16 * warp, 2 * kk));
      tc::ldmatrix_x4(av, tc::ldsm_addr<D>(v_lane, 16 * warp, 2 * kk));
#pragma unroll
      for (int np = 0; np < kN / 2; ++np) {
        uint32_t bq[4], bo[4];
        tc::ldmatrix_x4(bq, tc::ldsm_addr<D>(q_tile + d_offset_by_chunks, 16 * np, 2 * kk));
        tc::ldmatrix_x4(bo, tc::ldsm_addr<D>(o_tile + d_offset_by_chunks, 16 * np, 2 * kk));
        tc::mma_16816<T>(s[2 * np], ak, bq[0], bq[1]);
        tc::mma_16816<T>(s[2 * np + 1], ak, bq[2], bq[3]);
        tc::mma_16816<T>(dp[2 * np], av, bo[0], bo[1]);
        tc::mma_16816<T>(dp[2 * np + 1], av, bo[2], bo[3]);
      }
    }

    // Step 2: P^T = 2^(S^T scale log2(e) + bias log2(e) - L_i log2(e)) and dS^T = P^T (dP^T - D_i),
    // in place (s becomes P^T, dp becomes dS^T). Element e of n8 tile nt: key g + 8 (e / 2) of the
    // warp, query 8 nt + 2t + e % 2 of the block. The loop exists twice (kMasked): with the
    // per-element mask for the blocks that need it, and without any test for all the others.
    const bool need_mask = (kMaskOrWindow && p.masking.mask.kind != course::MaskKind::kNone) ||
                           p.masking.stride > 1 || q0 + kBr > p.Sq || k0 + kBc > kv_len ||
                           (causal && k0 + kBc - 1 > q0) || (kMaskOrWindow && crosses_window(p, q0, kBr, k0));
    const float scale_log2 = p.scale * kLog2e;
    auto probabilities_and_grads = [&](auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
        // L_i, D_i of the thread's two query columns 8 nt + 2t, + 1 (one 8-byte load each).
        const float2 l2 = *reinterpret_cast<const float2*>(sLi + 8 * nt + 2 * t);
        const float2 di = *reinterpret_cast<const float2*>(sDi + 8 * nt + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float li = (e & 1) ? l2.y : l2.x;
          float x = s[nt][e] * scale_log2 - li;
          bool visible = li != -CUDART_INF_F;  // a row with no visible key: no gradient at all
          if constexpr (kMasked) {
            const int64_t key = warp_k0 + g + 8 * (e >> 1);
            const int64_t row = q0 + 8 * nt + 2 * t + (e & 1);
            visible = visible && row < p.Sq && key < kv_len && (!kMaskOrWindow || in_window(p, row, key));
            if (visible) {
              const float bias = course::mask_bias(p.masking, b, h, row, key);
              visible = bias != -CUDART_INF_F;
              x = fmaf(bias, kLog2e, x);
            }
          }
          const float pij = visible ? tc::exp2_approx(x) : 0.0f;
          s[nt][e] = pij;
          dp[nt][e] = pij * (dp[nt][e] - ((e & 1) ? di.y : di.x));
        }
      }
    };
    if (need_mask) {
      probabilities_and_grads(std::true_type{});
    } else {
      probabilities_and_grads(std::false_type{});
    }

    // Step 3: dV_w += P^T dO_i and dK_w += dS^T Q_i, k = queries in steps of 16. The C fragments of
    // tiles 2kk, 2kk + 1 are the A fragment of queries 16kk..16kk+15 (rounded to T); B = dO_i or
    // Q_i by ldmatrix.trans: (queries 0-7 | 8-15) x (chunk 2dn2 | 2dn2 + 1) are b0, b1 of n8 tile
    // 2dn2, then b0, b1 of tile 2dn2 + 1.
#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      uint32_t pa[4], da[4];
      pa[0] = tc::pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = tc::pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = tc::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = tc::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      da[0] = tc::pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
      da[1] = tc::pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
      da[2] = tc::pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[3] = tc::pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int dn2 = 0; dn2 < D / 16; ++dn2) {
        uint32_t bo[4], bq[4];
        tc::ldmatrix_x4_trans(bo, tc::ldsm_addr<D>(o_lane, 16 * kk, 2 * dn2));
        tc::ldmatrix_x4_trans(bq, tc::ldsm_addr<D>(q_lane, 16 * kk, 2 * dn2));
        tc::mma_16816<T>(dv[2 * dn2], pa, bo[0], bo[1]);
        tc::mma_16816<T>(dv[2 * dn2 + 1], pa, bo[2], bo[3]);
        tc::mma_16816<T>(dk[2 * dn2], da, bq[0], bq[1]);
        tc::mma_16816<T>(dk[2 * dn2 + 1], da, bq[2], bq[3]);
      }
    }

    // Step 4: dS^T to shared memory, the warp's 16 key rows, rounded to T: dQ needs all Bc keys.
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * warp + g + 8 * r;
        T* dst = sdS + row * kBr + tc::swizzle<kBr / 8>(row, nt) * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(dst) = tc::pack2<T>(dp[nt][2 * r], dp[nt][2 * r + 1]);
      }
    }
    __syncthreads();

    // Step 5: dQ_i += scale dS K_j for this warp's 16 query rows and kDc head columns, k = keys in
    // steps of 16. A = dS is stored transposed (dS^T, keys as rows): ldmatrix.trans by chunks of the
    // blocks (keys 0-7 | 8-15) x (queries 0-7 | 8-15) gives a0..a3. B = K_j by ldmatrix.trans.
    {
      const int rg = warp % kRowGroups, cg = warp / kRowGroups;
      uint32_t a[kBc / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) tc::ldmatrix_x4_trans(a[kk], tc::ldsm_addr<kBr>(ds_lane, 16 * kk, 2 * rg));
      const int64_t row0 = q0 + 16 * rg + g;  // rows row0 and row0 + 8
      float* dq_row0 = dQ + row0 * row_len + 2 * t;  // the thread's first element of row0 (column 2t)
#pragma unroll
      for (int dn2 = 0; dn2 < kDc / 16; ++dn2) {
        const int chunk = cg * (kDc / 8) + 2 * dn2;
        float acc[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < kBc / 16; ++kk) {
          uint32_t bk[4];
          tc::ldmatrix_x4_trans(bk, tc::ldsm_addr<D>(k_lane, 16 * kk, chunk));
          tc::mma_16816<T>(acc[0], a[kk], bk[0], bk[1]);
          tc::mma_16816<T>(acc[1], a[kk], bk[2], bk[3]);
        }
        // The FP32 accumulator of dQ, shared with every other key block: atomicAdd (not into the
        // columns of the padding).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (row0 + 8 * r < p.Sq) {
#pragma unroll
            for (int x = 0; x < 2; ++x) {
              if (kPadded && (chunk + x) * 8 >= head_dim) continue;
              float* dst = dq_row0 + 8 * r * row_len + (chunk + x) * 8;
              atomicAdd(dst, p.scale * acc[x][2 * r]);
              atomicAdd(dst + 1, p.scale * acc[x][2 * r + 1]);
            }
          }
        }
      }
    }

    // The next block's L_i, D_i, loaded at the top of the step, into the other stage.
    if (prefetch) stage_stat(stage ^ 1, next_stat);
  }
  course::cp_async_wait<0>();  // nothing may be left in flight when the block exits

  // Epilogue: dK_w = scale * dK_w and dV_w, rounded to T, for the warp's keys that exist (padding
  // keys and keys no query sees get zeros) and the columns of the head dim.
  T* dK = static_cast<T*>(p.dk) + bh * p.Sk * row_len;
  T* dV = static_cast<T*>(p.dv) + bh * p.Sk * row_len;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = warp_k0 + g + 8 * r;
    if (key >= p.Sk) continue;
#pragma unroll
    for (int dn = 0; dn < kDn; ++dn) {
      if (kPadded && dn * 8 >= head_dim) continue;
      const int col = dn * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(dK + key * row_len + col) =
          tc::pack2<T>(p.scale * dk[dn][2 * r], p.scale * dk[dn][2 * r + 1]);
      *reinterpret_cast<uint32_t*>(dV + key * row_len + col) = tc::pack2<T>(dv[dn][2 * r], dv[dn][2 * r + 1]);
    }
  }
#endif
}

template <typename T, typename Cfg, bool kPadded>
void launch_for_mask(const BwdParams& p, int head_dim, cudaStream_t stream) {
  if (uses_mask_or_window(p)) {
    launch_key_blocks<Cfg, tc_backward_kernel<T, Cfg, true, kPadded>>(p, head_dim, stream);
  } else {
    launch_key_blocks<Cfg, tc_backward_kernel<T, Cfg, false, kPadded>>(p, head_dim, stream);
  }
}

// Head dim D on the tiles of width Dp (tc_tile_d): the padded instance only when D < Dp.
template <typename T, int Dp, int kWarps>
void launch_for_padding(const BwdParams& p, int D, cudaStream_t stream) {
  if (D == Dp) {
    launch_for_mask<T, BwdTile<Dp, kWarps>, false>(p, D, stream);
  } else {
    launch_for_mask<T, BwdTile<Dp, kWarps>, true>(p, D, stream);
  }
}

template <typename T, int Dp>
void launch_for_variant(const BwdParams& p, int D, int variant, cudaStream_t stream) {
  variant == 0 ? launch_for_padding<T, Dp, 4>(p, D, stream) : launch_for_padding<T, Dp, 8>(p, D, stream);
}

template <typename T>
void launch_for_d(const BwdParams& p, int D, int variant, cudaStream_t stream) {
  TORCH_CHECK(tc_supports_head_dim(D), "q: head dim D=", D, " is not supported by the tensor-core backward");
  TORCH_CHECK(D <= kTcRowTileMaxD, "q: head dim D=", D, " is above variant ", variant, "'s ", kTcRowTileMaxD,
              " (a warp's dK, dV rows in registers): use variant 2 (or -1, the default)");
  switch (tc_tile_d(D)) {
    case 32: return launch_for_variant<T, 32>(p, D, variant, stream);
    case 64: return launch_for_variant<T, 64>(p, D, variant, stream);
    case 96: return launch_for_variant<T, 96>(p, D, variant, stream);
    default: return launch_for_variant<T, 128>(p, D, variant, stream);
  }
}

}  // namespace

void launch_tc_backward(const BwdParams& p, int D, DType dtype, int variant, cudaStream_t stream) {
  TORCH_CHECK(dtype == DType::kHalf || dtype == DType::kBFloat16, "q must be float16 or bfloat16");
  TORCH_CHECK(variant >= 0 && variant <= 2, "variant must be 0, 1 or 2, got ", variant);
  if (variant == 2) return launch_tc_backward_2d(p, D, dtype, stream);  // bwd_tc_2d.cu
  if (dtype == DType::kBFloat16) {
    launch_for_d<__nv_bfloat16>(p, D, variant, stream);
  } else {
    launch_for_d<__half>(p, D, variant, stream);
  }
}

}  // namespace phase5_bwd
