// Phase 5, tensor cores, version 1 of 7: both matmuls on mma.sync m16n8k16 (README "Versions";
// tc_versions.h lists the seven). What the versions share (tiles, masking, the softmax step, the
// store) is in tc_versions.cuh.
//
// The matmuls run on tensor cores, but every fragment register is gathered by ordinary shared
// loads: an A register of Q or a B register of K is two adjacent elements of one row (one 32-bit
// load); a B register of V is two elements of one column (two 16-bit loads). Each loads 8 rows at
// a stride of 128 or 256 bytes: 8-way bank conflicts. K and V are loaded by the whole block
// between two barriers, so the warps wait for every copy before they compute.
#include "tc_versions.cuh"
#include "tc_versions.h"

namespace phase5_tc {
namespace {

using namespace tc_versions;

template <class Layout, typename T>
__device__ __forceinline__ uint32_t row_pair(const T* tile, int row, int col) {
  return *reinterpret_cast<const uint32_t*>(tile + Layout::offset(row, col));
}

// Two b16 elements of one column, (row, col) in the low half and (row + 1, col) in the high half.
template <class Layout, typename T>
__device__ __forceinline__ uint32_t column_pair(const T* tile, int row, int col) {
  const auto* bits = reinterpret_cast<const uint16_t*>(tile);
  return static_cast<uint32_t>(bits[Layout::offset(row, col)]) |
         (static_cast<uint32_t>(bits[Layout::offset(row + 1, col)]) << 16);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) tc_v1_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // mma.sync m16n8k16 needs sm_80; the host refuses older GPUs first
#else
  using Layout = PlainTile<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // [Br][D], reused for the output tile at the end
  T* sK = sQ + kBr * D;                // [Bc][D]
  T* sV = sK + kBc * D;                // [Bc][D]

  const Block<T, D> blk(p);
  const int warp = static_cast<int>(threadIdx.x) / course::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % course::kWarpSize;
  const int g = lane >> 2;  // fragment row (A, C) or column (B) of this lane
  const int t = lane & 3;   // fragment column pair of this lane
  const int warp_row0 = warp * kWarpRows;
  const int warp_q0 = blk.q0 + warp_row0;

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

    // S = Q_i K_j^T, k = head dim in steps of 16. A = Q rows (g, g + 8) x cols (2t, 2t + 8);
    // B = K^T, so its column n is key row n of K: b0, b1 = K[key g][2t, 2t + 8].
    Scores s;
    zero(s);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        const int row = warp_row0 + mt * 16 + g;
        a[mt][0] = row_pair<Layout>(sQ, row, kk * 16 + 2 * t);
        a[mt][1] = row_pair<Layout>(sQ, row + 8, kk * 16 + 2 * t);
        a[mt][2] = row_pair<Layout>(sQ, row, kk * 16 + 2 * t + 8);
        a[mt][3] = row_pair<Layout>(sQ, row + 8, kk * 16 + 2 * t + 8);
      }
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
        const uint32_t b0 = row_pair<Layout>(sK, nt * 8 + g, kk * 16 + 2 * t);
        const uint32_t b1 = row_pair<Layout>(sK, nt * 8 + g, kk * 16 + 2 * t + 8);
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) tc::mma_16816<T>(s[mt][nt], a[mt], b0, b1);
      }
    }

    // Scale and mask S, then the online softmax: S becomes P, O and l are rescaled.
    scale_and_mask(s, p, warp_q0, kv0, lane);
    online_softmax(s, st);

    // O += P V_j, k = keys in steps of 16. A = P in registers; B = V (keys x head dim): b0, b1 =
    // V[keys (2t, 2t + 1) and (2t + 8, 2t + 9)][column g] of n8 tile dn.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t pa[kM][4];
      p_fragments<T>(s, kk, pa);
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        const uint32_t b0 = column_pair<Layout>(sV, kk * 16 + 2 * t, dn * 8 + g);
        const uint32_t b1 = column_pair<Layout>(sV, kk * 16 + 2 * t + 8, dn * 8 + g);
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) tc::mma_16816<T>(st.o[mt][dn], pa[mt], b0, b1);
      }
    }
  }

  // O_i / l, through this warp's rows of sQ, to global memory.
  store_output<T, D, Layout>(st, sQ, blk.O, blk.q0, p.Sq);
#endif
}

template <typename T, int D>
struct V1 {
  static constexpr auto* kKernel = tc_v1_kernel<T, D>;
  static constexpr size_t kSmem = smem_bytes<T, D>(1);
};

}  // namespace

void launch_tc_v1_mma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, bool causal,
                      float scale, cudaStream_t stream) {
  launch<V1>(q, k, v, out, causal, scale, stream);
}

}  // namespace phase5_tc
