// Phase 5, tensor cores, version 6 of 7: lazy rescaling (README "Versions"; tc_versions.h lists the
// versions). What the versions share (tiles, masking, the store) is in tc_versions.cuh.
//
// Version 5 rescales O and l for every key block: kM x 2 rows x D / 4 multiplies per lane, as many
// as P V's outputs. Most blocks do not raise the row max by much, and P = 2^(c S - m) only has to
// stay well inside FP16/BF16, not below 1. So a warp raises its rows' m only when some score of the
// warp's rows exceeds its m by more than kLazyLog2 (a warp-wide vote, so the warp never diverges);
// otherwise every row keeps its m, P <= 2^kLazyLog2, and O and l skip the rescale. O / l is
// unchanged: O and l are always summed against the same m. The rest is version 5's.
#include "attention_args.h"
#include "cp_async.cuh"
#include "tc_versions.cuh"
#include "tc_versions.h"

namespace phase5_tc {
namespace {

using namespace tc_versions;

template <int D>
constexpr int kStages = D == 64 ? 3 : 2;  // K/V blocks in the ring

// Lazy rescaling: a warp raises its rows' running max only when a score exceeds it by more than
// this (log2 units), so P = 2^(c S - m) stays <= 2^8 between rescales.
constexpr float kLazyLog2 = 8.0f;

// Online softmax in log2 units on the thread's fragments, S unscaled, m raised only when the warp
// votes for it; S becomes P in place.
template <int D>
__device__ __forceinline__ void online_softmax_lazy(Scores& s, RowState<D>& st, float c) {
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax TODO (Lines 10-13), once the teaching kernel's tests pass, as version 5 has it but lazy: the rows' maxima first (c times the unscaled max, reduced over the 4 lanes of a row), one __any_sync vote whether some row's exceeds its m by more than kLazyLog2, the rescale of m, l and O only then, and P = 2^(c S - m) against the kept m (README: Versions)
  // m_new = max(m, c rowmax(S)) and O, l *= 2^(m - m_new) only in a block where some row of the warp
  // has c rowmax(S) > m + kLazyLog2; then P = 2^(c S - m), l += rowsum(P). A row with no visible
  // key so far keeps m = -inf; it subtracts 0 instead, so P = 0, never NaN.
  float row_max[kM][2];
  bool raise = false;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x = -CUDART_INF_F;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) x = fmaxf(x, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
      // The four lanes lane/4 == g share row g: reduce across them.
      x = fmaxf(x, __shfl_xor_sync(course::kFullMask, x, 1));
      x = fmaxf(x, __shfl_xor_sync(course::kFullMask, x, 2));
      row_max[mt][r] = x * c;
      raise |= row_max[mt][r] > st.m[mt][r] + kLazyLog2;
    }
  }
  if (__any_sync(course::kFullMask, raise)) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(st.m[mt][r], row_max[mt][r]);
        const float rescale = tc::exp2_approx(st.m[mt][r] - (m_new == -CUDART_INF_F ? 0.0f : m_new));
        st.m[mt][r] = m_new;
        st.l[mt][r] *= rescale;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          st.o[mt][dn][2 * r] *= rescale;
          st.o[mt][dn][2 * r + 1] *= rescale;
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_use = st.m[mt][r] == -CUDART_INF_F ? 0.0f : st.m[mt][r];
      float p_sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
        s[mt][nt][2 * r] = tc::exp2_approx(fmaf(s[mt][nt][2 * r], c, -m_use));
        s[mt][nt][2 * r + 1] = tc::exp2_approx(fmaf(s[mt][nt][2 * r + 1], c, -m_use));
        p_sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
      }
      st.l[mt][r] += p_sum;
    }
  }
  // END SOLUTION
}

// The asynchronous copy: cp.async of each chunk straight into shared memory (invalid rows become
// zeros and nothing is read: the tensor's start stands in for their address).
template <int D, int kRows, class Layout, typename T>
__device__ __forceinline__ void copy_tile_async(T* tile, const T* src, int row0, int row_limit) {
  const uint32_t base = course::smem_u32(tile);
  for_each_chunk<D, kRows, Layout>(src, row0, row_limit, [&](int offset, const T* from, bool valid) {
    course::cp_async_16(base + offset * sizeof(T), valid ? from : src, valid);
  });
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) tc_v6_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // mma.sync m16n8k16, ldmatrix and cp.async need sm_80; the host refuses older GPUs first
#else
  using Layout = SwizzledTile<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // [Br][D], reused for the output tile at the end
  T* sK = sQ + kBr * D;                // [kStages][Bc][D]
  T* sV = sK + kStages<D> * kBc * D;   // [kStages][Bc][D]

  const Block<T, D> blk(p);
  const int warp = static_cast<int>(threadIdx.x) / course::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % course::kWarpSize;
  const int warp_row0 = warp * kWarpRows;
  const int warp_q0 = blk.q0 + warp_row0;
  // ldmatrix lane addresses of Q_i and of stage 0 of K and V (stage n is n Bc D elements further).
  const uint32_t q_lane = Layout::lane_base(course::smem_u32(sQ + warp_row0 * D), lane);
  const uint32_t k_lane0 = Layout::lane_base(course::smem_u32(sK), lane);
  const uint32_t v_lane0 = Layout::lane_base(course::smem_u32(sV), lane);

  // Load Q_i, then the first kStages - 1 blocks of K and V (one commit group per block); block j
  // goes to ring stage j % kStages. Initialize O, m, l.
  copy_tile_async<D, kBr, Layout>(sQ, blk.Q, blk.q0, p.Sq);
  course::cp_async_commit();
#pragma unroll
  for (int j = 0; j < kStages<D> - 1; ++j) {
    if (j < blk.n_blocks) {
      copy_tile_async<D, kBc, Layout>(sK + j * kBc * D, blk.K, j * kBc, p.Sk);
      copy_tile_async<D, kBc, Layout>(sV + j * kBc * D, blk.V, j * kBc, p.Sk);
    }
    course::cp_async_commit();
  }
  RowState<D> st;

  for (int j = 0; j < blk.n_blocks; ++j) {
    const int kv0 = j * kBc;
    // Wait for K_j, V_j (and Q_i at the first block); the barrier makes every thread's copies
    // visible and tells that all warps are done with block j - 1, whose stage is refilled now.
    course::cp_async_wait<kStages<D> - 2>();
    __syncthreads();
    const int jn = j + kStages<D> - 1;
    if (jn < blk.n_blocks) {
      copy_tile_async<D, kBc, Layout>(sK + (jn % kStages<D>) * kBc * D, blk.K, jn * kBc, p.Sk);
      copy_tile_async<D, kBc, Layout>(sV + (jn % kStages<D>) * kBc * D, blk.V, jn * kBc, p.Sk);
    }
    course::cp_async_commit();  // an empty group past the end keeps the wait count uniform
    const uint32_t stage_bytes = (j % kStages<D>) * kBc * D * sizeof(T);
    const uint32_t k_lane = k_lane0 + stage_bytes;
    const uint32_t v_lane = v_lane0 + stage_bytes;
    // Causal: every key of the block above this warp's last row: nothing to do for this warp.
    if (p.causal && kv0 > warp_q0 + kWarpRows - 1) continue;

    // S = Q_i K_j^T, k = head dim in steps of 16. A (Q rows 0-15, chunks 2kk and 2kk + 1) is the
    // ldmatrix.x4 as loaded. B = K^T needs no transpose: the 8x8 matrices of K rows
    // (keys 0-7 | 8-15) x (chunk 2kk | 2kk + 1) are b0 of n8 tiles 2np, 2np + 1, then their b1.
    Scores s;
    zero(s);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt)
        tc::ldmatrix_x4(a[mt], Layout::ldsm_addr(q_lane, mt * 16, 2 * kk));
#pragma unroll
      for (int np = 0; np < kN / 2; ++np) {
        uint32_t bk[4];
        tc::ldmatrix_x4(bk, Layout::ldsm_addr(k_lane, np * 16, 2 * kk));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          tc::mma_16816<T>(s[mt][2 * np], a[mt], bk[0], bk[2]);
          tc::mma_16816<T>(s[mt][2 * np + 1], a[mt], bk[1], bk[3]);
        }
      }
    }

    // Mask S (unscaled: p.scale is c here), then the online softmax in log2 units, lazily rescaled.
    scale_and_mask</*kScale=*/false>(s, p, warp_q0, kv0, lane);
    online_softmax_lazy(s, st, p.scale);

    // O += P V_j, k = keys in steps of 16. A = P in registers; B = V by ldmatrix.trans: matrices
    // (keys 0-7 | 8-15) x (chunk 2dp | 2dp + 1), transposed, are b0, b1 of n8 tile 2dp, then b0,
    // b1 of tile 2dp + 1.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t pa[kM][4];
      p_fragments<T>(s, kk, pa);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        tc::ldmatrix_x4_trans(bv, Layout::ldsm_addr(v_lane, kk * 16, 2 * dp));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          tc::mma_16816<T>(st.o[mt][2 * dp], pa[mt], bv[0], bv[1]);
          tc::mma_16816<T>(st.o[mt][2 * dp + 1], pa[mt], bv[2], bv[3]);
        }
      }
    }
  }

  // O_i / l, through this warp's rows of sQ, to global memory. (Every copy has landed: the last
  // block's wait covered the last group that copies anything, as n_blocks >= 1.)
  store_output<T, D, Layout>(st, sQ, blk.O, blk.q0, p.Sq);
#endif
}

template <typename T, int D>
struct V6 {
  static constexpr auto* kKernel = tc_v6_kernel<T, D>;
  static constexpr size_t kSmem = smem_bytes<T, D>(kStages<D>);
};

}  // namespace

void launch_tc_v6_lazy(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, bool causal,
                       float scale, cudaStream_t stream) {
  // The kernel takes c = scale log2 e > 0 as its scale (course::fold_scale).
  const course::FoldedScale folded = course::fold_scale(q, scale);
  launch<V6>(folded.q, k, v, out, causal, folded.c, stream);
}

}  // namespace phase5_tc
