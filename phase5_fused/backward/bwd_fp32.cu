// Phase 5, backward: FlashAttention-2's backward pass (Dao, "FlashAttention-2", Algorithm 2) in FP32,
// the teaching version: plain loads, scalar shared-memory reads, one idea per step.
//
// The forward saved O and the row logsumexp L_i = m_i + log(l_i); nothing of size Sq x Sk. Here:
//   grid:   one thread block per (key block j of Bc keys, batch*head). The block owns K_j, V_j in
//           shared memory and dK_j, dV_j in registers, and walks over every query block i that can
//           see its keys (from the diagonal on, with causal masking).
//   per i:  S_ij = Q_i K_j^T                  (recomputed: cheaper than storing Sq x Sk)
//           P_ij = exp(scale S_ij + bias - L_i)  (exactly the forward's softmax, from L_i alone)
//           dV_j += P_ij^T dO_i
//           dP_ij = dO_i V_j^T
//           dS_ij = P_ij * (dP_ij - D_i)      (D_i = rowsum(dO_i * O_i), bwd_preprocess.cu)
//           dK_j += scale dS_ij^T Q_i
//           dQ_i += scale dS_ij K_j          -> atomicAdd into an FP32 dQ in global memory
//   end:    dK_j, dV_j written once.
// Grouped-query heads (k, v with H_kv < H heads): the block reads K_j, V_j of its query head's K/V
// head h / (H / H_kv) and writes dK_j, dV_j of the query head; the op then sums each group's
// H / H_kv heads (FlashAttention-2's expanded dK, dV; README "Grouped-query heads").
// dQ_i gets a contribution from every key block: blocks of different j run at once and add into
// the same dQ_i rows, hence the atomics (README "Where the atomics are, and how to avoid them").
//
// Threads: 256 as a 16 x 16 grid (ty, tx). For the Br x Bc tiles (S, P, dP, dS) thread (ty, tx)
// owns rows ty + 16 a and columns tx + 16 n; for dK_j, dV_j (Bc x D) key rows ty + 16 a and head
// columns tx + 16 c; for its part of dQ_i (Br x D) query rows ty + 16 a and columns tx + 16 c.
// Shared rows are padded by one float (pitch D + 1, odd): the 16 threads that read 16 different
// K or V rows at the same column hit 16 different banks.
//
// Instances (Fp32Tile): D = 32, 64, 80, 96, 128 (the FP32 forward's versions' head dims) with
// Br = 32, Bc = 64. Every other multiple of 8 up to 256 runs padded on the tiles of the next multiple
// of 32, D_TILE: the tensors' columns past D are zero-filled on load and never stored, and the
// wider the tile, the fewer keys and query rows (dK_j, dV_j take 2 Bc D_TILE / 256 registers per
// thread, the shared memory (2 Bc + 2 Br) (D_TILE + 1) + 2 Br (Bc + 1) floats, within 99 KiB):
//   D_TILE = 32, 64, 96: Br = 32, Bc = 64    128: Br = 16, Bc = 64    160: Br = 32, Bc = 32
//   D_TILE = 192, 224:   Br = 16, Bc = 32    256: Br = 16, Bc = 16
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <math_constants.h>

#include "../fp32/fused.h"
#include "bwd.h"
#include "common.cuh"
#include "shared_memory_opt_in.h"

namespace phase5_bwd {
namespace {

constexpr int kTX = 16, kTY = 16, kThreads = kTX * kTY;

// D_TILE head columns in shared memory and registers: the tensors' head dim, or (PADDED) a tile for
// any head dim <= D_TILE, read at run time.
template <int D_TILE, int BR, int BC, bool PADDED>
struct Fp32Tile {
  static constexpr int D = D_TILE;
  static constexpr int Br = BR;      // query rows per step
  static constexpr int Bc = BC;      // keys per thread block
  static constexpr bool kPadded = PADDED;
  static constexpr int LD = D + 1;   // pitch of Q, K, V, dO rows (floats)
  static constexpr int LDS = Bc + 1; // pitch of P, dS rows
  static constexpr int TQ = Br / kTY, TK = Bc / kTY, TN = Bc / kTX, TD = D / kTX;
  static constexpr int kSmemFloats = 2 * Bc * LD + 2 * Br * LD + 2 * Br * LDS + 2 * Br;
  static constexpr int kSmemBytes = kSmemFloats * 4;
  static_assert(D % kTX == 0, "the head columns split evenly over the 16 threads of a row");
  static_assert(Br % kTY == 0 && Bc % kTY == 0 && Bc % kTX == 0, "tiles are multiples of the 16 x 16 grid");
  static_assert(kSmemBytes <= 227 * 1024, "the tiles must fit in 227 KiB of shared memory");
  static_assert(!kPadded || kSmemBytes <= course::kSmemPerBlockEverywhere,
                "padded tiles must fit the shared memory a block may have on every GPU (99 KiB)");
};

// Rows [first, first + ROWS) of a [rows, head_dim] matrix into shared memory (D columns, pitch LD);
// rows at or past `limit` and columns at or past head_dim (padded tiles) are zero-filled, never read.
template <int D, int ROWS, int LD>
__device__ __forceinline__ void load_rows(float* dst, const float* src, int64_t first, int64_t limit,
                                          int head_dim) {
  for (int idx = threadIdx.x; idx < ROWS * D; idx += kThreads) {
    const int r = idx / D, c = idx % D;
    dst[r * LD + c] = first + r < limit && c < head_dim ? src[(first + r) * head_dim + c] : 0.0f;
  }
}

template <typename Cfg>
__global__ void __launch_bounds__(kThreads) fp32_backward_kernel(const BwdParams p,
                                                                 const int padded_head_dim) {
  constexpr int D = Cfg::D, Br = Cfg::Br, Bc = Cfg::Bc, LD = Cfg::LD, LDS = Cfg::LDS;
  constexpr int TQ = Cfg::TQ, TK = Cfg::TK, TN = Cfg::TN, TD = Cfg::TD;
  // The tensors' head dim: D, or in a padded instance the run-time one (<= D); the tile columns past
  // it are zeros (they add nothing to S or dP, and their dQ, dK, dV columns are not stored).
  const int head_dim = Cfg::kPadded ? padded_head_dim : D;

  extern __shared__ float smem[];
  float* Ks = smem;               // [Bc][LD]  K_j
  float* Vs = Ks + Bc * LD;       // [Bc][LD]  V_j
  float* Qs = Vs + Bc * LD;       // [Br][LD]  Q_i
  float* dOs = Qs + Br * LD;      // [Br][LD]  dO_i
  float* Ps = dOs + Br * LD;      // [Br][LDS] P_ij
  float* dSs = Ps + Br * LDS;     // [Br][LDS] dS_ij
  float* Ls = dSs + Br * LDS;     // [Br]      L_i
  float* Ds = Ls + Br;            // [Br]      D_i

  const int tx = threadIdx.x % kTX, ty = threadIdx.x / kTX;
  // Key blocks in the slow grid dimension: the first ones (the most query blocks under causal
  // masking) start first.
  const int64_t BH = p.B * p.H;
  const int64_t bh = blockIdx.x % BH;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x / BH) * Bc;
  const int64_t b = bh / p.H, h = bh % p.H;
  const float* q = static_cast<const float*>(p.q) + bh * p.Sq * head_dim;
  const int64_t kv_rows = kv_pair(bh, p) * p.Sk * head_dim;
  const float* k = static_cast<const float*>(p.k) + kv_rows;
  const float* v = static_cast<const float*>(p.v) + kv_rows;
  const float* dout = static_cast<const float*>(p.dout) + bh * p.Sq * head_dim;
  const float* lse = p.lse + bh * p.Sq;
  const float* delta = p.delta + bh * p.Sq;
  float* dq = p.dq + bh * p.Sq * head_dim;

  // Padding keys (j >= kv_len) are zero-filled, never loaded: whatever they hold (NaN too) cannot
  // reach a gradient, and their dK, dV rows come out zero.
  const int64_t kv_len = p.key_lengths != nullptr ? p.key_lengths[b] : p.Sk;
  const bool any_mask = p.masking.mask.kind != course::MaskKind::kNone || p.masking.causal ||
                        p.masking.stride > 1;

  // Step 1: K_j, V_j to shared memory, once; dK_j, dV_j accumulators to zero.
  load_rows<D, Bc, LD>(Ks, k, j0, kv_len, head_dim);
  load_rows<D, Bc, LD>(Vs, v, j0, kv_len, head_dim);
  float dk[TK][TD], dv[TK][TD];
#pragma unroll
  for (int a = 0; a < TK; ++a)
#pragma unroll
    for (int c = 0; c < TD; ++c) dk[a][c] = dv[a][c] = 0.0f;

  // Step 2: the query blocks that can see key j0 or later. With causal masking, row i sees j <= i,
  // so the rows before j0 see none of this block's keys: start at the block holding row j0. With a
  // sliding window, stop after the last row whose window reaches the block's last key.
  const int64_t i_first = p.masking.causal ? (j0 / Br) * Br : 0;
  const int64_t i_end = j0 < kv_len ? query_rows_end(p, j0, Bc) : 0;  // padding keys: nothing to do

  for (int64_t i0 = i_first; i0 < i_end; i0 += Br) {
    // Step 3: Q_i, dO_i, L_i, D_i to shared memory (after every thread is done with the last ones).
    __syncthreads();
    load_rows<D, Br, LD>(Qs, q, i0, p.Sq, head_dim);
    load_rows<D, Br, LD>(dOs, dout, i0, p.Sq, head_dim);
    if (threadIdx.x < Br) {
      const int64_t row = i0 + threadIdx.x;
      Ls[threadIdx.x] = row < p.Sq ? lse[row] : -CUDART_INF_F;
      Ds[threadIdx.x] = row < p.Sq ? delta[row] : 0.0f;
    }
    __syncthreads();

    // Step 4: S_ij = Q_i K_j^T and dP_ij = dO_i V_j^T, TQ x TN per thread.
    float s[TQ][TN], dp[TQ][TN];
#pragma unroll
    for (int a = 0; a < TQ; ++a)
#pragma unroll
      for (int n = 0; n < TN; ++n) s[a][n] = dp[a][n] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
#pragma unroll
      for (int a = 0; a < TQ; ++a) {
        const float qv = Qs[(ty + kTY * a) * LD + d];
        const float dov = dOs[(ty + kTY * a) * LD + d];
#pragma unroll
        for (int n = 0; n < TN; ++n) {
          s[a][n] = fmaf(qv, Ks[(tx + kTX * n) * LD + d], s[a][n]);
          dp[a][n] = fmaf(dov, Vs[(tx + kTX * n) * LD + d], dp[a][n]);
        }
      }
    }

    // Step 5: P_ij = exp(scale S_ij + bias - L_i), the forward's probabilities recomputed from the
    // saved logsumexp; dS_ij = P_ij (dP_ij - D_i). Hidden scores (padding, causal, stride, the
    // window, the user's mask) and rows past Sq give P = dS = 0; so does a fully masked row (L_i = -inf).
    // BEGIN SOLUTION: Step 5 for this thread's TQ x TN scores (rows ty + 16 a, keys tx + 16 n of the block): P_ij = exp(scale S_ij + bias - L_i) from s, the saved L_i in Ls and the mask's bias (course::mask_bias when any_mask), into Ps; dS_ij = P_ij (dP_ij - D_i) from dp and Ds, into dSs. A row past Sq, a padding key (key >= kv_len), a key outside the window (in_window), a bias of -inf and a row with L_i = -inf give P = dS = 0, never NaN (README: The derivation)
#pragma unroll
    for (int a = 0; a < TQ; ++a) {
      const int r = ty + kTY * a;
      const int64_t row = i0 + r;
#pragma unroll
      for (int n = 0; n < TN; ++n) {
        const int c = tx + kTX * n;
        const int64_t key = j0 + c;
        float pij = 0.0f;
        if (row < p.Sq && key < kv_len && in_window(p, row, key) && Ls[r] != -CUDART_INF_F) {
          const float bias = any_mask ? course::mask_bias(p.masking, b, h, row, key) : 0.0f;
          if (bias != -CUDART_INF_F) pij = expf(fmaf(s[a][n], p.scale, bias) - Ls[r]);
        }
        Ps[r * LDS + c] = pij;
        dSs[r * LDS + c] = pij * (dp[a][n] - Ds[r]);
      }
    }
    // END SOLUTION
    __syncthreads();

    // Step 6: dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i (the scale is applied at the end).
    // BEGIN SOLUTION: Step 6 for this thread's TK x TD of dV_j and dK_j (key rows ty + 16 a, head columns tx + 16 c): over the block's Br query rows r, dv += P_ij[r][key] dO_i[r][col] and dk += dS_ij[r][key] Q_i[r][col], from Ps, dSs, dOs and Qs in shared memory; no scale here, step 8 applies it (README: Algorithm 2: loop order and what each thread block owns)
#pragma unroll 2
    for (int r = 0; r < Br; ++r) {
#pragma unroll
      for (int a = 0; a < TK; ++a) {
        const float pv = Ps[r * LDS + ty + kTY * a];
        const float dsv = dSs[r * LDS + ty + kTY * a];
#pragma unroll
        for (int c = 0; c < TD; ++c) {
          dv[a][c] = fmaf(pv, dOs[r * LD + tx + kTX * c], dv[a][c]);
          dk[a][c] = fmaf(dsv, Qs[r * LD + tx + kTX * c], dk[a][c]);
        }
      }
    }
    // END SOLUTION

    // Step 7: dQ_i += scale dS_ij K_j, added to global memory with atomics: other key blocks add
    // their parts to the same rows at the same time.
    // BEGIN SOLUTION: Step 7 for this thread's TQ x TD of dQ_i (query rows ty + 16 a, head columns tx + 16 c): the sum over the block's Bc keys of dS_ij[row][key] K_j[key][col] from dSs and Ks, times scale, added with atomicAdd into dq (row-major, rows of head_dim floats), since every key block adds to the same rows; rows past Sq and, in a padded instance, columns at or past head_dim are not touched (README: Where the atomics are, and how to avoid them)
    float dqa[TQ][TD];
#pragma unroll
    for (int a = 0; a < TQ; ++a)
#pragma unroll
      for (int c = 0; c < TD; ++c) dqa[a][c] = 0.0f;
#pragma unroll 4
    for (int n = 0; n < Bc; ++n) {
#pragma unroll
      for (int a = 0; a < TQ; ++a) {
        const float dsv = dSs[(ty + kTY * a) * LDS + n];
#pragma unroll
        for (int c = 0; c < TD; ++c) dqa[a][c] = fmaf(dsv, Ks[n * LD + tx + kTX * c], dqa[a][c]);
      }
    }
#pragma unroll
    for (int a = 0; a < TQ; ++a) {
      const int64_t row = i0 + ty + kTY * a;
      if (row >= p.Sq) continue;
#pragma unroll
      for (int c = 0; c < TD; ++c)
        if (!Cfg::kPadded || tx + kTX * c < head_dim)
          atomicAdd(dq + row * head_dim + tx + kTX * c, p.scale * dqa[a][c]);
    }
    // END SOLUTION
  }

  // Step 8: dK_j = scale * (sum over i of dS_ij^T Q_i), dV_j: written once, every row of the block
  // that exists (padding rows and rows no query sees get zeros).
#pragma unroll
  for (int a = 0; a < TK; ++a) {
    const int64_t key = j0 + ty + kTY * a;
    if (key >= p.Sk) continue;
    float* dk_row = static_cast<float*>(p.dk) + (bh * p.Sk + key) * head_dim;
    float* dv_row = static_cast<float*>(p.dv) + (bh * p.Sk + key) * head_dim;
#pragma unroll
    for (int c = 0; c < TD; ++c) {
      if (Cfg::kPadded && tx + kTX * c >= head_dim) continue;  // a padding column
      dk_row[tx + kTX * c] = p.scale * dk[a][c];
      dv_row[tx + kTX * c] = dv[a][c];
    }
  }
}

template <typename Cfg>
void launch(const BwdParams& p, int D, cudaStream_t stream) {
  constexpr auto* kernel = fp32_backward_kernel<Cfg>;
  course::opt_in_shared_memory<kernel>(c10::cuda::current_device(), Cfg::kSmemBytes);
  const int64_t blocks = course::ceil_div<int64_t>(p.Sk, Cfg::Bc) * p.B * p.H;
  TORCH_CHECK(blocks <= 0x7fffffff, "k: too many key blocks (B*H*ceil(Sk/", Cfg::Bc, ")) for one grid");
  kernel<<<static_cast<unsigned>(blocks), kThreads, Cfg::kSmemBytes, stream>>>(p, D);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A head dim without an instance of its own: the padded tiles of the next multiple of 32.
void launch_padded(const BwdParams& p, int D, cudaStream_t stream) {
  TORCH_CHECK(phase5::fast_supports_head_dim(D), "q: head dim D=", D, " is not supported by the FP32 backward");
  switch (course::ceil_div(D, 32)) {
    // <D_TILE, Br, Bc, padded>
    case 1: return launch<Fp32Tile<32, 32, 64, true>>(p, D, stream);
    case 2: return launch<Fp32Tile<64, 32, 64, true>>(p, D, stream);
    case 3: return launch<Fp32Tile<96, 32, 64, true>>(p, D, stream);
    case 4: return launch<Fp32Tile<128, 16, 64, true>>(p, D, stream);
    case 5: return launch<Fp32Tile<160, 32, 32, true>>(p, D, stream);
    case 6: return launch<Fp32Tile<192, 16, 32, true>>(p, D, stream);
    case 7: return launch<Fp32Tile<224, 16, 32, true>>(p, D, stream);
    default: return launch<Fp32Tile<256, 16, 16, true>>(p, D, stream);
  }
}

}  // namespace

void launch_fp32_backward(const BwdParams& p, int D, cudaStream_t stream) {
  switch (D) {
    // <D, Br, Bc, padded>
    case 32: return launch<Fp32Tile<32, 32, 64, false>>(p, D, stream);
    case 64: return launch<Fp32Tile<64, 32, 64, false>>(p, D, stream);
    case 80: return launch<Fp32Tile<80, 32, 64, false>>(p, D, stream);
    case 96: return launch<Fp32Tile<96, 32, 64, false>>(p, D, stream);
    case 128:  // on a GPU that gives a block less shared memory (sm_86/89: 99 KiB), the padded tiles
      if (Fp32Tile<128, 32, 64, false>::kSmemBytes > course::shared_memory_per_block(c10::cuda::current_device()))
        return launch_padded(p, D, stream);
      return launch<Fp32Tile<128, 32, 64, false>>(p, D, stream);
    default: return launch_padded(p, D, stream);
  }
}

}  // namespace phase5_bwd
