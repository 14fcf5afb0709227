// Phase 5, tensor cores, version 2 of 7: fragments loaded by ldmatrix (README "Versions";
// tc_versions.h lists the seven). What the versions share (tiles, masking, the softmax step, the
// store) is in tc_versions.cuh.
//
// One ldmatrix.x4 loads four 8x8 matrices of b16, each lane giving one row address, into the
// registers of exactly the mma fragments: an A fragment of Q (16 x 16), two B fragments of K, and
// with .trans, which transposes each matrix on the way, two B fragments of V, whose columns
// version 1 gathered element by element. A quarter of the shared-load instructions of version 1
// for Q and K, an eighth for V. The tiles are still plain: each 8x8 matrix reads 8 rows at a
// stride of 128 or 256 bytes, the same 4 banks, so every ldmatrix still replays 8 times.
#include "tc_versions.cuh"
#include "tc_versions.h"

namespace phase5_tc {
namespace {

using namespace tc_versions;

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) tc_v2_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // mma.sync m16n8k16 and ldmatrix need sm_80; the host refuses older GPUs first
#else
  using Layout = PlainTile<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // [Br][D], reused for the output tile at the end
  T* sK = sQ + kBr * D;                // [Bc][D]
  T* sV = sK + kBc * D;                // [Bc][D]

  const Block<T, D> blk(p);
  const int warp = static_cast<int>(threadIdx.x) / course::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % course::kWarpSize;
  const int warp_row0 = warp * kWarpRows;
  const int warp_q0 = blk.q0 + warp_row0;
  // ldmatrix lane addresses of the three tiles (see the matmuls below for which lane reads what).
  const uint32_t q_lane = Layout::lane_base(course::smem_u32(sQ + warp_row0 * D), lane);
  const uint32_t k_lane = Layout::lane_base(course::smem_u32(sK), lane);
  const uint32_t v_lane = Layout::lane_base(course::smem_u32(sV), lane);

  // Load Q_i (the first barrier of the loop makes it visible); initialize O, m, l.
  copy_tile<D, kBr, Layout>(sQ, blk.Q, blk.q0, p.Sq);
  RowState<D> st;

  for (int j = 0; j < blk.n_blocks; ++j) {
    const int kv0 = j * kBc;
    // Load K_j, V_j once every warp is done with K_{j-1}, V_{j-1}; wait until all copies landed.
    __syncthreads();
    copy_tile<D, kBc, Layout>(sK, blk.K, kv0, p.Sk);
    copy_tile<D, kBc, Layout>(sV, blk.V, kv0, p.Sk);
    __syncthreads();
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

    // Scale and mask S, then the online softmax: S becomes P, O and l are rescaled.
    scale_and_mask(s, p, warp_q0, kv0, lane);
    online_softmax(s, st);

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

  // O_i / l, through this warp's rows of sQ, to global memory.
  store_output<T, D, Layout>(st, sQ, blk.O, blk.q0, p.Sq);
#endif
}

template <typename T, int D>
struct V2 {
  static constexpr auto* kKernel = tc_v2_kernel<T, D>;
  static constexpr size_t kSmem = smem_bytes<T, D>(1);
};

}  // namespace

void launch_tc_v2_ldmatrix(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                           bool causal, float scale, cudaStream_t stream) {
  launch<V2>(q, k, v, out, causal, scale, stream);
}

}  // namespace phase5_tc
