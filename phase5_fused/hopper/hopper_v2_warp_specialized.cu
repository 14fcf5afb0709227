// Phase 5, Hopper v2: v1 with warp specialization (FlashAttention-3, Section 3.1).
//
// What changes against hopper_v1_wgmma_tma.cu:
//   - a third warpgroup, the producer, does nothing but issue TMA copies: one thread of it walks
//     the K/V blocks and refills a stage as soon as both consumers have released it;
//   - the stages are guarded by two mbarriers each: full (TMA bytes landed: consumers may read)
//     and empty (both consumer warpgroups' 8 warps arrived: the producer may overwrite). No
//     __syncthreads in the loop: the two consumer warpgroups drift apart freely, so while one does
//     its softmax (FMA/MUFU pipes) the other's wgmmas keep the tensor cores busy;
//   - setmaxnreg: the producer needs few registers and gives them away (24 per thread), the
//     consumers take them (240), so the S and O accumulators never spill.
//
//   producer (1 thread)      consumer warpgroup 0          consumer warpgroup 1
//   TMA Q, K0, V0, K1, V1    wait Q, K0: S = Q K0^T        wait Q, K0: S = Q K0^T
//   wait empty[0] ...        softmax | wait V0: O += P V0  softmax | wait V0: O += P V0
//                            arrive empty[0]               arrive empty[0]
//   TMA K2, V2 -> stage 0    wait K1: ...                  wait K1: ...
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
__global__ void __launch_bounds__(kThreads, 1) hopper_v2_kernel(const __grid_constant__ Params p) {
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

  for (int j = 0; j < n_blocks; ++j) {
    const int s = j % kStages;
    const uint32_t parity = (j / kStages) & 1;
    const int n0 = j * kBN;
    unsigned char* sK = smem + L::kK + s * L::kKVBytes;
    unsigned char* sV = smem + L::kV + s * L::kKVBytes;
    if (j == 0) mbarrier_wait(full_q, 0);

    float sc[kBN / 2];
    // S = Q_i K_j^T once K_j has landed; mask; online softmax.
    mbarrier_wait(&full_k[s], parity);
    qk_gemm<T, D>(sc, q_base, smem_addr(sK));
    const bool need_mask = n0 + kBN > vis.kv_len || (vis.causal && n0 + kBN - 1 > wg_row0);
    scale_and_mask(sc, p.scale_log2, row0, n0, vis, need_mask);
    online_softmax<D>(sc, m, l, o);
    // V_j (padded rows zeroed by both consumer warpgroups together, named barrier 1), O += P V_j.
    mbarrier_wait(&full_v[s], parity);
    if (vis.kv_len < p.Sk && n0 + kBN > vis.kv_len)
      zero_padded_rows<D>(sV, vis.kv_len - n0, tid, kConsumers * kWarpgroup, 1);
    pv_gemm<T, D>(o, sc, smem_addr(sV));

    // Release the stage: one arrival per warp, after all its lanes' wgmmas completed.
    __syncwarp();
    if (tid % 32 == 0) mbarrier_arrive(&empty[s]);
  }

  store_output<T, D>(o, m, l, sQ, wg, m0, p, bh, 2 + wg);
}

template <typename T, int D>
void launch(const Params& p, cudaStream_t stream) {
  constexpr int smem = Smem<D, kStages>::kBytes;
  auto* kernel = hopper_v2_kernel<T, D>;
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

void launch_v2(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  const bool bf16 = dtype == Dtype::kBFloat16;
  if (D == 64) {
    bf16 ? launch<__nv_bfloat16, 64>(p, stream) : launch<__half, 64>(p, stream);
  } else {
    TORCH_CHECK(D == 128, "head dim D=", D, " (q.size(3)) is not supported: use 64 or 128");
    bf16 ? launch<__nv_bfloat16, 128>(p, stream) : launch<__half, 128>(p, stream);
  }
}

}  // namespace hopper
