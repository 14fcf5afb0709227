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
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <atomic>

#include "hopper_kernel.cuh"

namespace hopper {
namespace {

constexpr int kStages = 2;
constexpr int kThreads = (1 + kConsumers) * kWarpgroup;  // producer warpgroup + consumer warpgroups
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;  // 128 x 24 + 256 x 240 <= 65536 registers of the SM
constexpr int kConsumerWarps = kConsumers * 4;

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) hopper_v3_kernel(const __grid_constant__ Params p) {
  using L = Smem<D, kStages>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  unsigned char* sQ = smem + L::kQ;
  uint64_t* full_q = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* full_k = full_q + 1;
  uint64_t* full_v = full_k + kStages;
  uint64_t* empty = full_v + kStages;

  const int warpgroup = static_cast<int>(threadIdx.x) / kWarpgroup;  // 0: producer, 1..: consumers
  const int m_block = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // long causal rows start first
  const int m0 = m_block * kBM;
  const int bh = blockIdx.z * p.H + blockIdx.y;
  const Visibility vis{p.key_lengths != nullptr ? p.key_lengths[blockIdx.z] : p.Sk, p.causal};
  const int kv_end = p.causal ? min(vis.kv_len, m0 + kBM) : vis.kv_len;
  const int n_blocks = (kv_end + kBN - 1) / kBN;

  // full: one arrival (the producer's expect_tx) + the TMA bytes; empty: one arrival per consumer warp.
  if (threadIdx.x == 0) {
    mbarrier_init(full_q, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full_k[s], 1);
      mbarrier_init(&full_v[s], 1);
      mbarrier_init(&empty[s], kConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // Producer: give registers away; one thread issues every copy.
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0 && n_blocks > 0) {
      tma_prefetch_map(&p.q_map);
      tma_prefetch_map(&p.k_map);
      tma_prefetch_map(&p.v_map);
      load_tile<D>(sQ, L::kQPanel, &p.q_map, full_q, m0, bh);
      for (int j = 0; j < n_blocks; ++j) {
        const int s = j % kStages;
        // Wait until both consumers released the stage's previous block (j - kStages); on the
        // first pass the parity of the phase before the first one returns at once.
        mbarrier_wait(&empty[s], ((j / kStages) & 1) ^ 1);
        load_tile<D>(smem + L::kK + s * L::kKVBytes, L::kKVPanel, &p.k_map, &full_k[s], j * kBN, bh);
        load_tile<D>(smem + L::kV + s * L::kKVBytes, L::kKVPanel, &p.v_map, &full_v[s], j * kBN, bh);
      }
    }
    return;
  }

  // Consumers: take the registers, then FlashAttention's inner loop on this warpgroup's 64 rows.
  setmaxnreg_inc<kConsumerRegs>();
  const int wg = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) - kWarpgroup;  // 0 .. 255 over the consumers
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l[2] = {0.0f, 0.0f};
  const int wg_row0 = m0 + wg * 64;
  const int row0 = wg_row0 + (tid % kWarpgroup) / 32 * 16 + (tid % 32) / 4;
  const uint32_t q_base = smem_addr(sQ) + wg * 64 * kPanelBytes;
  volatile float* scratch = reinterpret_cast<volatile float*>(smem + L::kScratch);  // 2 floats per consumer thread

  // Block 0: S_0 = Q K_0^T and its softmax (O is still zero: nothing to rescale).
  float sc[kBN / 2];
  uint32_t pa[kBN / 16][4];  // P of the previous block, rounded, the A operand of its P V
  float alpha[2];
  if (n_blocks > 0) {
    mbarrier_wait(full_q, 0);
    mbarrier_wait(&full_k[0], 0);
    qk_gemm<T, D>(sc, q_base, smem_addr(smem + L::kK));
    scale_and_mask(sc, p.scale_log2, row0, 0, vis, kBN > vis.kv_len || (vis.causal && kBN - 1 > wg_row0));
    softmax_step(sc, m, l, alpha);
    pack_p<T>(sc, pa);
  }

  for (int j = 1; j < n_blocks; ++j) {
    const int s = j % kStages;            // stage of block j (K_j)
    const int sp = (j - 1) % kStages;     // stage of block j - 1 (V_{j-1})
    const int n0 = j * kBN;
    // Issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: two commit groups in flight.
    mbarrier_wait(&full_k[s], (j / kStages) & 1);
    mbarrier_wait(&full_v[sp], ((j - 1) / kStages) & 1);
    fence_operand(sc);
    fence_operand(o);
    wgmma_fence();
    qk_issue<T, D>(sc, q_base, smem_addr(smem + L::kK + s * L::kKVBytes));
    wgmma_commit();
    pv_issue<T, D>(o, pa, smem_addr(smem + L::kV + sp * L::kKVBytes));
    wgmma_commit();
    // Wait for S_j only (at most one group, the P V, still pending); mask and softmax meanwhile.
    wgmma_wait<1>();
    fence_operand(sc);
    const bool need_mask = n0 + kBN > vis.kv_len || (vis.causal && n0 + kBN - 1 > wg_row0);
    scale_and_mask(sc, p.scale_log2, row0, n0, vis, need_mask);
    softmax_step(sc, m, l, alpha);
    // Pin the softmax before the next wait. The compiler's order is not enough: ptxas schedules the
    // exponentials next to their first use (the rounding of P, after the wait), which serializes
    // the softmax behind the P V again (seen in the SASS). It keeps shared-memory stores on their
    // side of wgmma.wait_group, and the row sums depend on every exponential of the block: storing
    // them (to a scratch slot nobody reads) keeps the whole softmax between the two waits.
    fence_operand(sc);
    scratch[2 * tid] = l[0];
    scratch[2 * tid + 1] = l[1];
    // P_{j-1} V_{j-1} done: release its stage, rescale O for block j, round P_j for the next P V.
    wgmma_wait<0>();
    fence_operand(o);
    __syncwarp();
    if (tid % 32 == 0) mbarrier_arrive(&empty[sp]);
    rescale_o<D>(o, alpha);
    pack_p<T>(sc, pa);
  }

  // Tail: O += P V of the last block (its padded V rows zeroed first: the block that holds the end
  // of the batch's keys is always the last one visited), then release its stage.
  if (n_blocks > 0) {
    const int j = n_blocks - 1;
    const int s = j % kStages;
    unsigned char* sV = smem + L::kV + s * L::kKVBytes;
    mbarrier_wait(&full_v[s], (j / kStages) & 1);
    if (vis.kv_len < p.Sk && j * kBN + kBN > vis.kv_len)
      zero_padded_rows<D>(sV, vis.kv_len - j * kBN, tid, kConsumers * kWarpgroup, 1);
    fence_operand(o);
    wgmma_fence();
    pv_issue<T, D>(o, pa, smem_addr(sV));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(o);
    __syncwarp();
    if (tid % 32 == 0) mbarrier_arrive(&empty[s]);
  }

  store_output<T, D>(o, m, l, sQ, wg, m0, p, bh, 2 + wg);
}

template <typename T, int D>
void launch(const Params& p, cudaStream_t stream) {
  constexpr int smem = Smem<D, kStages>::kBytes;
  auto* kernel = hopper_v3_kernel<T, D>;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::atomic<uint64_t> opted_in{0};  // bit d: the shared-memory opt-in is done on device d
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit == 0 || (opted_in.load() & bit) == 0) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    opted_in.fetch_or(bit);
  }
  const dim3 grid((p.Sq + kBM - 1) / kBM, p.H, p.B);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_v3(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  const bool bf16 = dtype == Dtype::kBFloat16;
  if (D == 64) {
    bf16 ? launch<__nv_bfloat16, 64>(p, stream) : launch<__half, 64>(p, stream);
  } else {
    TORCH_CHECK(D == 128, "head dim D=", D, " (q.size(3)) is not supported: use 64 or 128");
    bf16 ? launch<__nv_bfloat16, 128>(p, stream) : launch<__half, 128>(p, stream);
  }
}

}  // namespace hopper
