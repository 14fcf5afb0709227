// Phase 5, Hopper v1: FlashAttention forward with TMA copies and wgmma, no specialization.
//
// Against the mma.sync kernel (../tensor_cores/tc_attention.cu), two things change:
//   - loads: one thread issues a TMA copy per 64-column panel of a tile; the copy engine writes
//     the tile, already swizzled, and counts its bytes on an mbarrier that the other threads wait
//     on (no cp.async per thread, no address arithmetic per thread, rows past the end zero-filled);
//   - math: each warpgroup (4 warps) issues wgmma m64n128k16 for S = Q K^T with Q and K read
//     straight from shared memory through descriptors (no ldmatrix), and m64nDk16 for O += P V
//     with P from registers.
// Every thread is a consumer: 2 warpgroups x 64 query rows. Thread 0 also issues the copies of
// block j + kStages once every thread is done with block j (one __syncthreads per block), so the
// copies of the next block fly while this one is computed, as in the mma.sync kernel's cp.async ring.
#include "hopper_kernel.cuh"
#include "hopper_launch.cuh"

namespace hopper {
namespace {

using Tile = BaseTile;
constexpr int kBN = Tile::kBN;
constexpr int kStages = 2;
constexpr int kThreads = Tile::kConsumers * kWarpgroup;

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) hopper_v1_kernel(const __grid_constant__ Params p) {
  using L = Smem<D, kStages, Tile>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  unsigned char* sQ = smem + L::kQ;
  uint64_t* full_q = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* full_k = full_q + 1;
  uint64_t* full_v = full_k + kStages;

  const int wg = static_cast<int>(threadIdx.x) / kWarpgroup;  // this thread's 64 rows
  // The query tile, its K/V, and the key blocks it visits: the valid keys, with causal only up to
  // the last row's diagonal.
  const Block b = block_of<Tile>(p);
  const int m0 = b.m0, n_blocks = b.n_blocks;
  const Visibility vis = b.vis;

  // Barriers: one arrival (thread 0's expect_tx) plus the TMA bytes complete each phase.
  if (threadIdx.x == 0) {
    mbarrier_init(full_q, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full_k[s], 1);
      mbarrier_init(&full_v[s], 1);
    }
    fence_barrier_init();
  }
  __syncthreads();

  // Load Q_i and the first kStages blocks of K, V (nothing at all when no key is visible).
  auto load_kv = [&](int j) {
    const int s = j % kStages;
    load_tile<D>(smem + L::kK + s * L::kKVBytes, L::kKVPanel, &p.k_map, &full_k[s], j * kBN, b.kv_head, b.batch);
    load_tile<D>(smem + L::kV + s * L::kKVBytes, L::kKVPanel, &p.v_map, &full_v[s], j * kBN, b.kv_head, b.batch);
  };
  if (threadIdx.x == 0 && n_blocks > 0) {
    tma_prefetch_map(&p.q_map);
    tma_prefetch_map(&p.k_map);
    tma_prefetch_map(&p.v_map);
    load_tile<D>(sQ, L::kQPanel, &p.q_map, full_q, m0, b.head, b.batch);
    for (int j = 0; j < min(kStages, n_blocks); ++j) load_kv(j);
  }

  // Per thread: O fragments of rows g and g + 8 of its warp's 16, and their m and l.
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l[2] = {0.0f, 0.0f};
  const int wg_row0 = m0 + wg * 64;                                              // first row of the warpgroup
  const int row0 = wg_row0 + (static_cast<int>(threadIdx.x) % kWarpgroup) / 32 * 16 + (threadIdx.x % 32) / 4;
  const uint32_t q_base = smem_addr(sQ) + wg * 64 * kPanelBytes;

  for (int j = 0; j < n_blocks; ++j) {
    const int s = j % kStages;
    const uint32_t parity = (j / kStages) & 1;  // the (j / kStages)-th use of stage s
    const int n0 = j * kBN;
    unsigned char* sK = smem + L::kK + s * L::kKVBytes;
    unsigned char* sV = smem + L::kV + s * L::kKVBytes;
    if (j == 0) mbarrier_wait(full_q, 0);

    float sc[kBN / 2];
    // S = Q_i K_j^T once K_j has landed.
    mbarrier_wait(&full_k[s], parity);
    qk_gemm<T, D, Tile>(sc, q_base, smem_addr(sK));
    // Mask (only blocks that cross kv_len or the diagonal) and the online softmax.
    const bool need_mask = n0 + kBN > vis.kv_len || (vis.causal && n0 + kBN - 1 > wg_row0);
    mask_scores(sc, row0, n0, vis, need_mask);
    online_softmax<D>(sc, p.scale_log2, m, l, o);
    // V_j: the block that holds the end of the batch's keys gets its padded rows zeroed first.
    mbarrier_wait(&full_v[s], parity);
    if (holds_padding<kBN>(vis, p.Sk, j))
      zero_padded_rows<D, kBN>(sV, vis.kv_len - n0, static_cast<int>(threadIdx.x), kThreads, 1);
    // O += P V_j.
    pv_gemm<T, D>(o, sc, smem_addr(sV));

    // Every warpgroup is done with stage s: refill it with block j + kStages.
    __syncthreads();
    if (threadIdx.x == 0 && j + kStages < n_blocks) load_kv(j + kStages);
  }

  // O / l and lse, through this warpgroup's rows of the Q tile.
  store_output<T, D, Tile>(o, m, l, sQ, wg, p, b, 2 + wg);
}

}  // namespace

void launch_v1(const Params& p, int D, Dtype dtype, cudaStream_t stream) {
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    launch_kernel<hopper_v1_kernel<T, kD>, Smem<kD, kStages, Tile>::kBytes, kThreads, Tile>(p, stream);
  });
}

}  // namespace hopper
