// Phase 5, Hopper v3: v2 with the softmax overlapped with the matmuls inside each warpgroup
// (FlashAttention-3, Section 3.2, "intra-warpgroup pipelining").
//
// In v2 a consumer warpgroup waits for each matmul right after issuing it, so while it computes a
// softmax its own tensor-core work is finished and only the other warpgroup can use the tensor
// cores. v3 reorders one iteration so that two matmuls are in flight during the softmax:
//
//   v2, block j:  issue S_j = Q K_j^T, wait | softmax(S_j) | issue O += P_j V_j, wait
//   v3, block j:  issue S_j = Q K_j^T; issue O += P_{j-1} V_{j-1} | wait for S_j only |
//                 softmax(S_j) while P_{j-1} V_{j-1} still runs | wait for it; O *= alpha_j;
//                 release the stage of block j - 1; round P_j into registers
//
// The O rescale by alpha_j = 2^(m_{j-1} - m_j) waits until P_{j-1} V_{j-1} has landed in O (O is
// being written by the tensor cores until then), and P_j V_j is issued one iteration later (the
// tail after the loop issues the last one). Registers per consumer thread: S (64) + P in FP16/BF16
// (32) + O (D / 2). The producer and the barriers are v2's; only the consumer loop differs.
//
// K_j and V_{j-1} are released apart: K_j as soon as S_j has landed, V_{j-1} after its P V. A
// stage released only at the end of block j (K_{j-1} with V_{j-1}, as v2 does) is refilled with
// block j + 1, which this loop needs at once: every block would wait for a TMA round trip.
#include "hopper_launch.cuh"
#include "hopper_pipeline.cuh"

namespace hopper {
namespace {

using Tile = BaseTile;
constexpr int kBN = Tile::kBN;
constexpr int kThreads = threads_of(Tile::kConsumers);

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) hopper_v3_kernel(const __grid_constant__ Params p) {
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
  volatile float* scratch = reinterpret_cast<volatile float*>(smem + L::kScratch);  // 2 floats per consumer thread
  auto stage_k = [&](int j) { return smem_addr(smem + L::kK + (j % kStages) * L::kKVBytes); };
  auto stage_v = [&](int j) { return smem + L::kV + (j % kStages) * L::kKVBytes; };
  auto need_mask = [&](int n0) { return n0 + kBN > b.vis.kv_len || (b.vis.causal && n0 + kBN - 1 > wg_row0); };

  // Block 0: S_0 = Q K_0^T and its softmax (O is still zero: nothing to rescale).
  float sc[kBN / 2];
  uint32_t pa[kBN / 16][4];  // P of the previous block, rounded, the A operand of its P V
  float alpha[2];
  if (b.n_blocks > 0) {
    mbarrier_wait(pipe.full_q, 0);
    mbarrier_wait(&pipe.full_k[0], 0);
    qk_gemm<T, D, Tile>(sc, q_base, stage_k(0));
    release(&pipe.empty_k[0]);
    mask_scores(sc, row0, 0, b.vis, need_mask(0));
    softmax_step(sc, p.scale_log2, m, l, alpha);
    pack_p<T>(sc, pa);
  }

  for (int j = 1; j < b.n_blocks; ++j) {
    const int s = j % kStages;            // stage of block j (K_j)
    const int sp = (j - 1) % kStages;     // stage of block j - 1 (V_{j-1})
    const int n0 = j * kBN;
    // Issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: two commit groups in flight.
    mbarrier_wait(&pipe.full_k[s], (j / kStages) & 1);
    mbarrier_wait(&pipe.full_v[sp], ((j - 1) / kStages) & 1);
    fence_operand(sc);
    fence_operand(o);
    wgmma_fence();
    qk_issue<T, D, Tile>(sc, q_base, stage_k(j));
    wgmma_commit();
    pv_issue<T, D>(o, pa, smem_addr(stage_v(j - 1)));
    wgmma_commit();
    // Wait for S_j only (at most one group, the P V, still pending): release K_j; mask and
    // softmax while the P V runs.
    wgmma_wait<1>();
    fence_operand(sc);
    release(&pipe.empty_k[s]);
    mask_scores(sc, row0, n0, b.vis, need_mask(n0));
    softmax_step(sc, p.scale_log2, m, l, alpha);
    // Pin the softmax before the next wait. The compiler's order is not enough: ptxas schedules the
    // exponentials next to their first use (the rounding of P, after the wait), which serializes
    // the softmax behind the P V again (seen in the SASS). It keeps shared-memory stores on their
    // side of wgmma.wait_group, and the row sums depend on every exponential of the block: storing
    // them (to a scratch slot nobody reads) keeps the whole softmax between the two waits.
    fence_operand(sc);
    scratch[2 * tid] = l[0];
    scratch[2 * tid + 1] = l[1];
    // P_{j-1} V_{j-1} done: release V_{j-1}, rescale O for block j, round P_j for the next P V.
    wgmma_wait<0>();
    fence_operand(o);
    release(&pipe.empty_v[sp]);
    rescale_o<D>(o, alpha);
    pack_p<T>(sc, pa);
  }

  // Tail: O += P V of the last block (its padded V rows zeroed first: the block that holds the end
  // of the batch's keys is always the last one visited), then release its V.
  if (b.n_blocks > 0) {
    const int j = b.n_blocks - 1;
    unsigned char* sV = stage_v(j);
    mbarrier_wait(&pipe.full_v[j % kStages], (j / kStages) & 1);
    if (holds_padding<kBN>(b.vis, p.Sk, j))
      zero_padded_rows<D, kBN>(sV, b.vis.kv_len - j * kBN, tid, Tile::kConsumers * kWarpgroup, kZeroBarrier);
    fence_operand(o);
    wgmma_fence();
    pv_issue<T, D>(o, pa, smem_addr(sV));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(o);
    release(&pipe.empty_v[j % kStages]);
  }

  store_output<T, D, Tile>(o, m, l, sQ, wg, p, b, kEpilogueBarrier + wg);
}

}  // namespace

void launch_v3(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    launch_kernel<hopper_v3_kernel<T, kD>, Smem<kD, kStages, Tile>::kBytes, kThreads, Tile>(p, stream);
  });
}

}  // namespace hopper
