// Phase 5, tensor cores, version 5 of 7: the softmax in log2 units, one FFMA and one ex2.approx
// per score (README "Versions"; tc_versions.h lists the seven). What the versions share (tiles,
// masking, the store) is in tc_versions.cuh.
//
// Version 4 spends per score an FMUL (S *= scale), an FADD (S - m) and expf, which is itself an
// FMUL by log2 e and an ex2. With c = scale log2 e folded into one FFMA, P = 2^(c S - m) costs one
// FFMA and one ex2.approx (MUFU.EX2), m kept in log2 units. The row max is taken of the unscaled
// scores: max(c S) = c max(S) needs c > 0, so the host turns a scale <= 0 into one > 0
// (course::fold_scale: -q for a negative scale, a zero q for a zero one). The ring, the copies and
// the matmuls are version 4's.
#include "attention_args.h"
#include "cp_async.cuh"
#include "tc_versions.cuh"
#include "tc_versions.h"

namespace phase5_tc {
namespace {

using namespace tc_versions;

template <int D>
constexpr int kStages = D == 64 ? 3 : 2;  // K/V blocks in the ring

// Online softmax in log2 units on the thread's fragments, S unscaled; S becomes P in place.
template <int D>
__device__ __forceinline__ void online_softmax_exp2(Scores& s, RowState<D>& st, float c) {
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax TODO (Lines 10-13), once the teaching kernel's tests pass, as version 4 has it (tc_versions.cuh) but in log2 units: c = scale log2 e > 0 multiplies the unscaled row max, and every exponent is one fmaf and one tc::exp2_approx (README: Versions)
  // m_new = max(m, c rowmax(S)), P = 2^(c S - m_new), l = 2^(m - m_new) l + rowsum(P),
  // O = 2^(m - m_new) O. A row with no visible key so far keeps m = -inf; it subtracts 0 instead,
  // so P = 0 and the rescale factor is 0, never NaN.
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float row_max = -CUDART_INF_F;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) row_max = fmaxf(row_max, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
      // The four lanes lane/4 == g share row g: reduce across them.
      row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, 1));
      row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, 2));
      const float m_new = fmaxf(st.m[mt][r], row_max * c);
      const float m_ref = m_new == -CUDART_INF_F ? 0.0f : m_new;
      const float rescale = tc::exp2_approx(st.m[mt][r] - m_ref);
      st.m[mt][r] = m_new;
      float p_sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
        s[mt][nt][2 * r] = tc::exp2_approx(fmaf(s[mt][nt][2 * r], c, -m_ref));
        s[mt][nt][2 * r + 1] = tc::exp2_approx(fmaf(s[mt][nt][2 * r + 1], c, -m_ref));
        p_sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
      }
      st.l[mt][r] = st.l[mt][r] * rescale + p_sum;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        st.o[mt][dn][2 * r] *= rescale;
        st.o[mt][dn][2 * r + 1] *= rescale;
      }
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
__global__ void __launch_bounds__(kThreads, 2) tc_v5_kernel(const Params p) {
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

    // Mask S (unscaled: p.scale is c here), then the online softmax in log2 units.
    scale_and_mask</*kScale=*/false>(s, p, warp_q0, kv0, lane);
    online_softmax_exp2(s, st, p.scale);

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
struct V5 {
  static constexpr auto* kKernel = tc_v5_kernel<T, D>;
  static constexpr size_t kSmem = smem_bytes<T, D>(kStages<D>);
};

}  // namespace

void launch_tc_v5_exp2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, bool causal,
                       float scale, cudaStream_t stream) {
  // The kernel takes c = scale log2 e > 0 as its scale (course::fold_scale).
  const course::FoldedScale folded = course::fold_scale(q, scale);
  launch<V5>(folded.q, k, v, out, causal, folded.c, stream);
}

}  // namespace phase5_tc
