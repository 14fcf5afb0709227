// Phase 5, backward, variant 2 of the tensor-core kernel: FlashAttention-2's two-dimensional warp
// tiles. Read bwd_tc.cu first: the same algorithm (Algorithm 2), the same key blocks, the same dQ
// atomics; what changes is which warp computes which part of each product.
//
// In variants 0 and 1 warp w owns 16 keys and computes everything for them: S^T, dP^T, dK_w, dV_w
// straight from its registers. The price: every warp reads all of Q_i and dO_i as B operands for a
// single m16 tile of A, so a fragment loaded by ldmatrix feeds 2 mma.sync, and the kernel spends
// more shared-memory bandwidth than tensor-core time (README: "Why the tensor-core backward is
// behind its peers"). Here each product gets its own grid of the 8 warps, with tiles of at least
// 32 x 32 per warp, so that each loaded fragment feeds 4 or more mma.sync:
//   S = Q_i K_j^T, dP = dO_i V_j^T    Br x Bc      2 x 4 warps (query rows x keys), Br/2 x 32 each
//   P = exp(S - L_i), dS = P (dP - D_i)            on those accumulators; then P and dS go to shared
//                                                  memory (rounded to T), and a barrier
//   dV_j += P^T dO_i, dK_j += dS^T Q_i  Bc x D     4 x 2 warps (keys x head dim), 32 x D/2 each,
//                                                  kept in registers for the whole loop
//   dQ_i += dS K_j                      Br x D     kQRowGroups x kQColGroups warps; the tile goes
//                                                  through shared memory to row-wise atomicAdd
// P^T and dS^T are read from shared memory by ldmatrix .trans: no transposed copy is stored.
// A head dim below the tile width D runs on the padded instance (kPadded), as in bwd_tc.cu.
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

// FlashAttention-2's tiles for sm_80: Bc = 128 keys per block, 8 warps, Br = 128 query rows per
// step up to D = 64 and 64 above; above D = 128, Bc = 64 (as FlashAttention-2 at D = 256): a warp's
// dK_j, dV_j are then 16 keys x D/2, the same 2 x 64 FP32 registers as 32 x 64 at D = 128. dQ's warp
// grid is 32 x 32 per warp where D allows it, else 16 rows by columns that are whole pairs of n8
// tiles (D = 96: 48 columns; 160: 80; 224: 112).
template <int D_>
struct Tile2d {
  static constexpr int D = D_, kWarps = 8, kThreads = kWarps * course::kWarpSize;
  static constexpr int kBc = D <= 128 ? 128 : 64, kBr = D <= 64 ? 128 : 64;
  static constexpr int kSRows = kBr / 2, kSKeys = kBc / 4;      // S, dP: 2 x 4 warps
  static constexpr int kKvKeys = kBc / 4, kKvCols = D / 2;      // dK, dV: 4 x 2 warps
  static constexpr int kQRowGroups = (D / (kWarps / (kBr / 32))) % 16 == 0 ? kBr / 32 : kBr / 16;
  static constexpr int kQColGroups = kWarps / kQRowGroups;      // dQ: kQRowGroups x kQColGroups warps
  static constexpr int kQRows = kBr / kQRowGroups, kQCols = D / kQColGroups;
  // K_j, V_j; Q_i, dO_i in 2 stages; P and dS (elements of 2 bytes); L_i, D_i in 2 stages (FP32).
  static constexpr int kSmemBytes = (2 * kBc * D + 4 * kBr * D + 2 * kBr * kBc) * 2 + 4 * kBr * 4;
  // dQ_i (Br x D FP32) goes to L2 through the bytes of P and dS where it fits in them (D <= Bc).
  static constexpr bool kDqThroughSmem = D * 4 <= 2 * kBc * 2;
};

template <typename T, typename Cfg, bool kMaskOrWindow, bool kPadded>
__global__ void __launch_bounds__(Cfg::kThreads, 1) tc_backward_2d_kernel(const BwdParams p, const int head_dim) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // mma.sync m16n8k16, ldmatrix and cp.async need sm_80; the host refuses older GPUs first
#else
  constexpr int D = Cfg::D, kThreads = Cfg::kThreads, kBc = Cfg::kBc, kBr = Cfg::kBr;
  constexpr int kSM = Cfg::kSRows / 16, kSN = Cfg::kSKeys / 8;     // m16 x n8 tiles of S, dP per warp
  constexpr int kKvM = Cfg::kKvKeys / 16, kKvN = Cfg::kKvCols / 8;  // ... of dK, dV
  constexpr int kQM = Cfg::kQRows / 16, kQN = Cfg::kQCols / 8;      // ... of dQ
  static_assert(kSN % 2 == 0 && kKvN % 2 == 0 && kQN % 2 == 0, "B operands come in pairs of n8 tiles");
  static_assert(Cfg::kQRowGroups * Cfg::kQRows == kBr && Cfg::kQColGroups * Cfg::kQCols == D,
                "dQ's warp grid covers the tile");
  static_assert(D % 32 == 0, "the swizzle needs rows of a multiple of 64 bytes");
  static_assert(2 * kBr <= kThreads, "one thread per L_i and per D_i of a query block");

  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // [Bc][D]
  T* sV = sK + kBc * D;                // [Bc][D]
  T* sQ = sV + kBc * D;                // [2][Br][D]
  T* sdO = sQ + 2 * kBr * D;           // [2][Br][D]
  T* sP = sdO + 2 * kBr * D;           // [Br][Bc]   P of the current step
  T* sdS = sP + kBr * kBc;             // [Br][Bc]   dS of the current step
  float* sL = reinterpret_cast<float*>(sdS + kBr * kBc);  // [2][Br]  L_i log2(e)
  float* sDelta = sL + 2 * kBr;                           // [2][Br]  D_i

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / course::kWarpSize;
  const int lane = tid % course::kWarpSize;
  const int g = lane >> 2, t = lane & 3;  // fragment row group and column pair (tc_mma.cuh)
  const int row_len = kPadded ? head_dim : D;  // the tensors' rows; tile columns from row_len on are zeros
  const KeyBlock<T> w = key_block<T, kBc, kBr>(p, row_len);
  // Positions inside one head fit 32 bits (bwd_prepare.cpp refuses longer sequences), and so
  // do the steps. 64-bit copies of them would cost registers the accumulators need.
  const int k0 = static_cast<int>(w.k0), kv_len = static_cast<int>(w.kv_len), Sq = static_cast<int>(p.Sq);
  const int qb_first = static_cast<int>(w.qb_first), n_steps = static_cast<int>(w.n_steps);
  const bool causal = p.masking.causal;

  // L_i (in log2 units) or D_i of one query row of block qb, for the thread that stages it.
  auto row_stat = [&](int qb) {
    const int row = qb * kBr + tid % kBr;
    if (tid < kBr) return row < Sq ? w.lse[row] * kLog2e : -CUDART_INF_F;
    return row < Sq ? w.delta[row] : 0.0f;
  };
  auto stage_stat = [&](int stage, float value) {
    if (tid < kBr) sL[stage * kBr + tid] = value;
    else if (tid < 2 * kBr) sDelta[stage * kBr + tid - kBr] = value;
  };

  // Prologue: K_j, V_j (padding keys zero-filled) and the first Q_i, dO_i in one group.
  if (n_steps > 0) {
    load_tile<T, D, kBc, kThreads, kPadded>(sK, w.K, k0, kv_len, head_dim);
    load_tile<T, D, kBc, kThreads, kPadded>(sV, w.V, k0, kv_len, head_dim);
    load_tile<T, D, kBr, kThreads, kPadded>(sQ, w.Q, qb_first * kBr, Sq, head_dim);
    load_tile<T, D, kBr, kThreads, kPadded>(sdO, w.dO, qb_first * kBr, Sq, head_dim);
    stage_stat(0, row_stat(qb_first));
  }
  course::cp_async_commit();

  // Each warp's place in the three grids (rows and columns inside the block's tiles).
  const int s_row0 = (warp / 4) * Cfg::kSRows, s_key0 = (warp % 4) * Cfg::kSKeys;
  const int kv_key0 = (warp % 4) * Cfg::kKvKeys, kv_col0 = (warp / 4) * Cfg::kKvCols;
  const int q_row0 = (warp % Cfg::kQRowGroups) * Cfg::kQRows, q_col0 = (warp / Cfg::kQRowGroups) * Cfg::kQCols;

  // dK_j, dV_j of the warp's 32 keys x D/2 columns: FP32 C fragments for the whole loop.
  float dk[kKvM][kKvN][4], dv[kKvM][kKvN][4];
#pragma unroll
  for (int mt = 0; mt < kKvM; ++mt)
#pragma unroll
    for (int nt = 0; nt < kKvN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mt][nt][e] = dv[mt][nt][e] = 0.0f;
  // ldmatrix lane addresses (bwd_tc_tiles.cuh), one per pattern and tile width, taken
  // from the start of shared memory; a tile's byte offset (a multiple of 128, like that start) is
  // added after the swizzle's XOR. Per-tile lane addresses would be 4 registers per tile and
  // pattern (one per XOR constant), more than the 255 registers hold beside the accumulators.
  const uint32_t smem0 = course::smem_u32(smem);
  const uint32_t d_by_rows = smem0 + tc::lane_tile_offset<D>(lane), d_by_chunks = smem0 + tc::lane_tile_offset_b<D>(lane);
  const uint32_t bc_by_rows = smem0 + tc::lane_tile_offset<kBc>(lane), bc_by_chunks = smem0 + tc::lane_tile_offset_b<kBc>(lane);
  constexpr uint32_t kKBytes = 0, kVBytes = kBc * D * sizeof(T), kQBytes = 2 * kBc * D * sizeof(T);
  constexpr uint32_t kOBytes = kQBytes + 2 * kBr * D * sizeof(T), kPBytes = kOBytes + 2 * kBr * D * sizeof(T);
  constexpr uint32_t kDsBytes = kPBytes + kBr * kBc * sizeof(T);

  for (int step = 0; step < n_steps; ++step) {
    const int stage = step & 1;
    const int q0 = (qb_first + step) * kBr;
    const uint32_t q_bytes = kQBytes + stage * kBr * D * sizeof(T), o_bytes = kOBytes + stage * kBr * D * sizeof(T);
    const float* sLi = sL + stage * kBr;
    const float* sDi = sDelta + stage * kBr;

    // Wait for Q_i, dO_i (and K_j, V_j); the barrier also says every warp is done with step - 1:
    // its stage, sP and sdS are free. Then start the next query block into the other stage.
    course::cp_async_wait<0>();
    __syncthreads();
    const bool prefetch = step + 1 < n_steps;
    float next_stat = 0.0f;
    if (prefetch) {
      load_tile<T, D, kBr, kThreads, kPadded>(sQ + (stage ^ 1) * kBr * D, w.Q, q0 + kBr, Sq, head_dim);
      load_tile<T, D, kBr, kThreads, kPadded>(sdO + (stage ^ 1) * kBr * D, w.dO, q0 + kBr, Sq, head_dim);
      next_stat = row_stat(qb_first + step + 1);  // staged at the end of the step: its latency hides
    }
    course::cp_async_commit();

    // Step 1: S = Q_i K_j^T and dP = dO_i V_j^T for the warp's Br/2 rows x 32 keys, k = head dim in
    // steps of 16 (one product after the other: fewer A fragments live at once). A = Q_i or dO_i
    // plainly by rows; B = K_j^T or V_j^T plainly by chunks (b0, b1 of two n8 tiles of keys).
    float s[kSM][kSN][4], dp[kSM][kSN][4];
    auto scores = [&](float (&acc)[kSM][kSN][4], uint32_t a_bytes, uint32_t b_bytes) {
#pragma unroll
      for (int mt = 0; mt < kSM; ++mt)
#pragma unroll
        for (int nt = 0; nt < kSN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[kSM][4];
#pragma unroll
        for (int mt = 0; mt < kSM; ++mt) tc::ldmatrix_x4(a[mt], tc::ldsm_addr<D>(d_by_rows, s_row0 + 16 * mt, 2 * kk) + a_bytes);
#pragma unroll
        for (int np = 0; np < kSN / 2; ++np) {
          uint32_t bf[4];
          tc::ldmatrix_x4(bf, tc::ldsm_addr<D>(d_by_chunks, s_key0 + 16 * np, 2 * kk) + b_bytes);
#pragma unroll
          for (int mt = 0; mt < kSM; ++mt) {
            tc::mma_16816<T>(acc[mt][2 * np], a[mt], bf[0], bf[1]);
            tc::mma_16816<T>(acc[mt][2 * np + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
    };
    scores(s, q_bytes, kKBytes);
    scores(dp, o_bytes, kVBytes);

    // Step 2: P = 2^(S scale log2(e) + bias log2(e) - L_i log2(e)) and dS = P (dP - D_i), in place
    // (s becomes P, dp becomes dS). Element e of tile (mt, nt): query s_row0 + 16 mt + g + 8 (e / 2),
    // key s_key0 + 8 nt + 2t + e % 2. With and without the per-element mask, as in bwd_tc.cu.
    const bool need_mask = (kMaskOrWindow && p.masking.mask.kind != course::MaskKind::kNone) ||
                           p.masking.stride > 1 || q0 + kBr > Sq || k0 + kBc > kv_len ||
                           (causal && k0 + kBc - 1 > q0) || (kMaskOrWindow && crosses_window(p, q0, kBr, k0));
    const float scale_log2 = p.scale * kLog2e;
    auto probabilities_and_grads = [&](auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
      for (int mt = 0; mt < kSM; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row_in_block = s_row0 + 16 * mt + g + 8 * r;
          const float li = sLi[row_in_block], di = sDi[row_in_block];
#pragma unroll
          for (int nt = 0; nt < kSN; ++nt) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              float x = s[mt][nt][e] * scale_log2 - li;
              bool visible = li != -CUDART_INF_F;  // a row with no visible key: no gradient at all
              if constexpr (kMasked) {
                const int key = k0 + s_key0 + 8 * nt + 2 * t + (e & 1);
                const int row = q0 + row_in_block;
                visible = visible && row < Sq && key < kv_len && (!kMaskOrWindow || in_window(p, row, key));
                if (visible) {
                  const float bias = course::mask_bias(p.masking, w.b, w.h, row, key);
                  visible = bias != -CUDART_INF_F;
                  x = fmaf(bias, kLog2e, x);
                }
              }
              const float pij = visible ? tc::exp2_approx(x) : 0.0f;
              s[mt][nt][e] = pij;
              dp[mt][nt][e] = pij * (dp[mt][nt][e] - di);
            }
          }
        }
      }
    };
    if (need_mask) {
      probabilities_and_grads(std::true_type{});
    } else {
      probabilities_and_grads(std::false_type{});
    }

    // Step 3: P and dS to shared memory, rounded to T, [Br][Bc] swizzled: the other grids need
    // them. Then the barrier that shows them to every warp.
#pragma unroll
    for (int mt = 0; mt < kSM; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kSN; ++nt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = s_row0 + 16 * mt + g + 8 * r;
          const int at = row * kBc + tc::swizzle<kBc / 8>(row, s_key0 / 8 + nt) * 8 + 2 * t;
          *reinterpret_cast<uint32_t*>(sP + at) = tc::pack2<T>(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]);
          *reinterpret_cast<uint32_t*>(sdS + at) = tc::pack2<T>(dp[mt][nt][2 * r], dp[mt][nt][2 * r + 1]);
        }
      }
    }
    __syncthreads();

    // Step 4: dV_j += P^T dO_i and dK_j += dS^T Q_i for the warp's 32 keys x D/2 columns, k = queries
    // in steps of 16. A = P^T or dS^T: the [query][key] tiles read .trans by chunks (a tile stored
    // transposed); B = dO_i or Q_i by rows, .trans (queries run along the rows).
#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      uint32_t ap[kKvM][4], ads[kKvM][4];
#pragma unroll
      for (int mt = 0; mt < kKvM; ++mt) {
        tc::ldmatrix_x4_trans(ap[mt], tc::ldsm_addr<kBc>(bc_by_chunks, 16 * kk, (kv_key0 + 16 * mt) / 8) + kPBytes);
        tc::ldmatrix_x4_trans(ads[mt], tc::ldsm_addr<kBc>(bc_by_chunks, 16 * kk, (kv_key0 + 16 * mt) / 8) + kDsBytes);
      }
#pragma unroll
      for (int np = 0; np < kKvN / 2; ++np) {
        uint32_t bo[4], bq[4];
        tc::ldmatrix_x4_trans(bo, tc::ldsm_addr<D>(d_by_rows, 16 * kk, kv_col0 / 8 + 2 * np) + o_bytes);
        tc::ldmatrix_x4_trans(bq, tc::ldsm_addr<D>(d_by_rows, 16 * kk, kv_col0 / 8 + 2 * np) + q_bytes);
#pragma unroll
        for (int mt = 0; mt < kKvM; ++mt) {
          tc::mma_16816<T>(dv[mt][2 * np], ap[mt], bo[0], bo[1]);
          tc::mma_16816<T>(dv[mt][2 * np + 1], ap[mt], bo[2], bo[3]);
          tc::mma_16816<T>(dk[mt][2 * np], ads[mt], bq[0], bq[1]);
          tc::mma_16816<T>(dk[mt][2 * np + 1], ads[mt], bq[2], bq[3]);
        }
      }
    }

    // Step 5: dQ_i += scale dS K_j for the warp's kQRows x kQCols, k = keys in steps of 16, added to
    // the FP32 dQ that every key block shares (atomicAdd). A = dS plainly by rows; B = K_j by rows,
    // .trans (keys run along the rows).
    {
      float acc[kQM][kQN][4];
#pragma unroll
      for (int mt = 0; mt < kQM; ++mt)
#pragma unroll
        for (int nt = 0; nt < kQN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        uint32_t a[kQM][4];
#pragma unroll
        for (int mt = 0; mt < kQM; ++mt) tc::ldmatrix_x4(a[mt], tc::ldsm_addr<kBc>(bc_by_rows, q_row0 + 16 * mt, 2 * kk) + kDsBytes);
#pragma unroll
        for (int np = 0; np < kQN / 2; ++np) {
          uint32_t bk[4];
          tc::ldmatrix_x4_trans(bk, tc::ldsm_addr<D>(d_by_rows, 16 * kk, q_col0 / 8 + 2 * np) + kKBytes);
#pragma unroll
          for (int mt = 0; mt < kQM; ++mt) {
            tc::mma_16816<T>(acc[mt][2 * np], a[mt], bk[0], bk[1]);
            tc::mma_16816<T>(acc[mt][2 * np + 1], a[mt], bk[2], bk[3]);
          }
        }
      }
      // The tile goes to L2 through shared memory: written in the fragments' order into the bytes
      // of P and dS (every warp is done reading them: steps 4 and 5 are behind the barrier), then
      // read back so that the 32 lanes of a warp add 32 consecutive floats of one row: one 128-byte
      // line per atomic instruction, where the fragments' order touches 8 rows (8 sectors).
      // Chunks of 8 floats are XOR-swizzled by row % 4: the fragment writes (8 rows x 8 floats)
      // take the minimum of two wavefronts and the row reads one. Above D = 128 the tile does not
      // fit in those bytes: each thread adds its fragments' pairs itself.
      if constexpr (Cfg::kDqThroughSmem) {
        auto dq_at = [](int row, int col) { return row * D + (((col >> 3) ^ (row & 3)) << 3) + (col & 7); };
        float* sdQ = reinterpret_cast<float*>(sP);
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < kQM; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = q_row0 + 16 * mt + g + 8 * r;
#pragma unroll
            for (int nt = 0; nt < kQN; ++nt) {
              const float2 pair = make_float2(p.scale * acc[mt][nt][2 * r], p.scale * acc[mt][nt][2 * r + 1]);
              *reinterpret_cast<float2*>(sdQ + dq_at(row, q_col0 + 8 * nt + 2 * t)) = pair;
            }
          }
        }
        __syncthreads();
#pragma unroll
        for (int row = warp; row < kBr; row += Cfg::kWarps) {
          if (q0 + row < Sq) {
            float* dq_row = w.dQ + static_cast<int64_t>(q0 + row) * row_len;
#pragma unroll
            for (int col = lane; col < D; col += course::kWarpSize) {
              if (!kPadded || col < head_dim) atomicAdd(dq_row + col, sdQ[dq_at(row, col)]);
            }
          }
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < kQM; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = q_row0 + 16 * mt + g + 8 * r;
            if (q0 + row >= Sq) continue;
            float* dq_row = w.dQ + static_cast<int64_t>(q0 + row) * row_len;
#pragma unroll
            for (int nt = 0; nt < kQN; ++nt) {
              const int col = q_col0 + 8 * nt + 2 * t;
              if (kPadded && col >= head_dim) continue;
              atomicAdd(dq_row + col, p.scale * acc[mt][nt][2 * r]);
              atomicAdd(dq_row + col + 1, p.scale * acc[mt][nt][2 * r + 1]);
            }
          }
        }
      }
    }

    // The next block's L_i, D_i, loaded at the top of the step, into the other stage.
    if (prefetch) stage_stat(stage ^ 1, next_stat);
  }
  course::cp_async_wait<0>();  // nothing may be left in flight when the block exits

  // Epilogue: dK_j = scale * dK_j and dV_j, rounded to T, for the warp's keys that exist (padding
  // keys and keys no query sees get zeros) and the columns of the head dim.
  T* dK = static_cast<T*>(p.dk) + w.bh * p.Sk * row_len;
  T* dV = static_cast<T*>(p.dv) + w.bh * p.Sk * row_len;
#pragma unroll
  for (int mt = 0; mt < kKvM; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = k0 + kv_key0 + 16 * mt + g + 8 * r;
      if (key >= p.Sk) continue;
#pragma unroll
      for (int nt = 0; nt < kKvN; ++nt) {
        const int col = kv_col0 + 8 * nt + 2 * t;
        if (kPadded && col >= head_dim) continue;
        *reinterpret_cast<uint32_t*>(dK + key * row_len + col) =
            tc::pack2<T>(p.scale * dk[mt][nt][2 * r], p.scale * dk[mt][nt][2 * r + 1]);
        *reinterpret_cast<uint32_t*>(dV + key * row_len + col) = tc::pack2<T>(dv[mt][nt][2 * r], dv[mt][nt][2 * r + 1]);
      }
    }
  }
#endif
}

template <typename T, int D, bool kPadded>
void launch_for_mask(const BwdParams& p, int head_dim, cudaStream_t stream) {
  if (uses_mask_or_window(p)) {
    launch_key_blocks<Tile2d<D>, tc_backward_2d_kernel<T, Tile2d<D>, true, kPadded>>(p, head_dim, stream);
  } else {
    launch_key_blocks<Tile2d<D>, tc_backward_2d_kernel<T, Tile2d<D>, false, kPadded>>(p, head_dim, stream);
  }
}

// Head dim D on the tiles of width Dp (tc_tile_d): the padded instance only when D < Dp.
template <typename T, int Dp>
void launch_for_padding(const BwdParams& p, int D, cudaStream_t stream) {
  if (D == Dp) {
    launch_for_mask<T, Dp, false>(p, D, stream);
  } else {
    launch_for_mask<T, Dp, true>(p, D, stream);
  }
}

template <typename T>
void launch_for_d(const BwdParams& p, int D, cudaStream_t stream) {
  TORCH_CHECK(tc_supports_head_dim(D), "q: head dim D=", D, " is not supported by the tensor-core backward");
  switch (tc_tile_d(D)) {
    case 32: return launch_for_padding<T, 32>(p, D, stream);
    case 64: return launch_for_padding<T, 64>(p, D, stream);
    case 96: return launch_for_padding<T, 96>(p, D, stream);
    case 128: return launch_for_padding<T, 128>(p, D, stream);
    case 160: return launch_for_padding<T, 160>(p, D, stream);
    case 192: return launch_for_padding<T, 192>(p, D, stream);
    case 224: return launch_for_padding<T, 224>(p, D, stream);
    default: return launch_for_padding<T, 256>(p, D, stream);
  }
}

}  // namespace

int tc_backward_2d_smem_bytes(int D) {
  TORCH_CHECK(tc_supports_head_dim(D), "q: head dim D=", D, " is not supported by the tensor-core backward");
  switch (tc_tile_d(D)) {
    case 32: return Tile2d<32>::kSmemBytes;
    case 64: return Tile2d<64>::kSmemBytes;
    case 96: return Tile2d<96>::kSmemBytes;
    case 128: return Tile2d<128>::kSmemBytes;
    case 160: return Tile2d<160>::kSmemBytes;
    case 192: return Tile2d<192>::kSmemBytes;
    case 224: return Tile2d<224>::kSmemBytes;
    default: return Tile2d<256>::kSmemBytes;
  }
}

void launch_tc_backward_2d(const BwdParams& p, int D, DType dtype, cudaStream_t stream) {
  if (dtype == DType::kBFloat16) {
    launch_for_d<__nv_bfloat16>(p, D, stream);
  } else {
    launch_for_d<__half>(p, D, stream);
  }
}

}  // namespace phase5_bwd
