// Phase 5, Hopper v2: v1 with warp specialization (FlashAttention-3, Section 3.1).
//
// What changes against hopper_v1_wgmma_tma.cu:
//   - a third warpgroup, the producer, does nothing but issue TMA copies: one thread of it walks
//     the K/V blocks and refills a stage as soon as both consumers have released it;
//   - the stages are guarded by mbarriers: full (TMA bytes landed: consumers may read) and empty
//     (both consumer warpgroups' 8 warps arrived: the producer may overwrite), for K and V apart
//     (hopper_pipeline.cuh; v2 releases both at the end of a block, v3 K earlier). No
//     __syncthreads in the loop: the two consumer warpgroups drift apart freely, so while one does
//     its softmax (FMA/MUFU pipes) the other's wgmmas keep the tensor cores busy;
//   - setmaxnreg: the producer needs few registers and gives them away (24 per thread), the
//     consumers take them (240), so the S and O accumulators never spill.
//
//   producer (1 thread)      consumer warpgroup 0          consumer warpgroup 1
//   TMA Q, K0, V0, K1, V1    wait Q, K0: S = Q K0^T        wait Q, K0: S = Q K0^T
//   wait empty_k/v[0] ...    softmax | wait V0: O += P V0  softmax | wait V0: O += P V0
//                            arrive empty_k/v[0]           arrive empty_k/v[0]
//   TMA K2, V2 -> stage 0    wait K1: ...                  wait K1: ...
#include "hopper_launch.cuh"
#include "hopper_pipeline.cuh"

namespace hopper {
namespace {

using Tile = BaseTile;
constexpr int kBN = Tile::kBN;
constexpr int kThreads = threads_of(Tile::kConsumers);

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) hopper_v2_kernel(const __grid_constant__ Params p) {
  using L = Smem<D, kStages, Tile>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  unsigned char* sQ = smem + L::kQ;
  const Block b = block_of<Tile>(p);
  const Pipeline pipe = init_pipeline<D, Tile>(smem);

  const int warpgroup = static_cast<int>(threadIdx.x) / kWarpgroup;  // 0: producer, 1..: consumers
  if (warpgroup == 0) {
    produce<D, false, Tile>(p, smem, pipe, b);
    return;
  }

  // Consumers: take the registers, then FlashAttention's inner loop on this warpgroup's 64 rows.
  setmaxnreg_inc<consumer_regs(Tile::kConsumers)>();
  const int wg = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) - kWarpgroup;  // 0 .. 255 over the consumers
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l[2] = {0.0f, 0.0f};
  const int wg_row0 = b.m0 + wg * 64;
  const int row0 = wg_row0 + (tid % kWarpgroup) / 32 * 16 + (tid % 32) / 4;
  const uint32_t q_base = smem_addr(sQ) + wg * 64 * kPanelBytes;

  for (int j = 0; j < b.n_blocks; ++j) {
    const int s = j % kStages;
    const uint32_t parity = (j / kStages) & 1;
    const int n0 = j * kBN;
    unsigned char* sK = smem + L::kK + s * L::kKVBytes;
    unsigned char* sV = smem + L::kV + s * L::kKVBytes;
    if (j == 0) mbarrier_wait(pipe.full_q, 0);

    float sc[kBN / 2];
    // S = Q_i K_j^T once K_j has landed; mask; online softmax.
    mbarrier_wait(&pipe.full_k[s], parity);
    qk_gemm<T, D, Tile>(sc, q_base, smem_addr(sK));
    const bool need_mask = n0 + kBN > b.vis.kv_len || (b.vis.causal && n0 + kBN - 1 > wg_row0);
    mask_scores(sc, row0, n0, b.vis, need_mask);
    online_softmax<D>(sc, p.scale_log2, m, l, o);
    // V_j (padded rows zeroed by both consumer warpgroups together), O += P V_j.
    mbarrier_wait(&pipe.full_v[s], parity);
    if (holds_padding<kBN>(b.vis, p.Sk, j))
      zero_padded_rows<D, kBN>(sV, b.vis.kv_len - n0, tid, Tile::kConsumers * kWarpgroup, kZeroBarrier);
    pv_gemm<T, D>(o, sc, smem_addr(sV));

    // Release the stage: its K and V both.
    release(&pipe.empty_k[s]);
    release(&pipe.empty_v[s]);
  }

  store_output<T, D, Tile>(o, m, l, sQ, wg, p, b, kEpilogueBarrier + wg);
}

}  // namespace

void launch_v2(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    launch_kernel<hopper_v2_kernel<T, kD>, Smem<kD, kStages, Tile>::kBytes, kThreads, Tile>(p, stream);
  });
}

}  // namespace hopper
