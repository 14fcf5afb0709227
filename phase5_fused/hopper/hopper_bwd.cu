// Phase 5, Hopper: the attention backward (FlashAttention-2's Algorithm 2, as ../backward/bwd_tc.cu)
// on TMA and wgmma. Read bwd_tc.cu first: the same loop order, the same ownership, the same
// transposed scores; what changes is who moves the tiles and how wide one matrix instruction is.
//
// One CTA per (key block j of kBwdBc = 128 keys, batch * KV head), two warpgroups; warpgroup w owns
// the 64 keys 64w..64w+63 of the block and keeps their dK_w, dV_w (64 x D, FP32) in registers for
// the whole loop. With grouped-query heads (G = H / H_kv query heads per K/V head) the loop visits
// the query blocks of the group's G query heads one head after the other: dK_w and dV_w sum over
// all of them in the same registers, so sharing K/V costs no atomics and no second pass. Per query
// block i of query head h (kBwdBr = 64 rows; Q_i and dO_i land by TMA in a 2-stage ring):
//   S^T  = K_w Q_i^T       wgmma m64n64k16, A = K_w and B = Q_i K-major in shared memory
//   dP^T = V_w dO_i^T      the same with V_w, dO_i
//   P^T  = 2^(S^T c - L_i), dS^T = P^T (dP^T - D_i)        on the accumulators, FP32
//   dV_w += P^T dO_i       wgmma m64nDk16, A = P^T from registers (rounded to T), B = dO_i MN-major
//   dK_w += dS^T Q_i       the same with dS^T, Q_i
//   dQ_i += dS K_j         dS^T through shared memory (A, MN-major), B = K_j MN-major, added to an
//                          FP32 accumulator in global memory with vector atomics (below). Two ways
//                          to share it between the warpgroups (the variant):
//                            0, by keys:    warpgroup w adds dS_w K_w, all D columns over its own 64
//                                           keys: it waits for its own dS^T only
//                            1, by columns: warpgroup w adds columns D/2 w.. of dS K_j over all 128
//                                           keys: half the atomics, after a barrier of both
//                                           warpgroups (at D = 64 warpgroup 1's B operand starts
//                                           64 bytes into the rows of K_j's swizzled panel, as a
//                                           K-major k-step starts 32 bytes in: the swizzle is a
//                                           function of the address, so any 16-byte start works)
// Against bwd_tc.cu: no ldmatrix at all (wgmma reads both shared operands through descriptors), one
// instruction per 64 x N x 16 product instead of 4 x N/8, and no thread computes a copy address.
//
// The dQ accumulator is kept in the accumulators' own order (fragment order): the 64 x D tile of
// query block i is D / N parts (N: the columns one warpgroup adds, D or D / 2), part c holding
// columns cN.. as N / 8 rows of 128 float4, float4 j of thread t holding t's registers 4j..4j+3.
// Each thread adds its registers as N / 8 float4 atomics whose addresses are consecutive across
// the warp (one 512-byte transaction per instruction); hopper_dq_convert turns the accumulator into
// dQ = scale * sum, rounded to T, in [B, H, Sq, D] order.
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include "hopper_kernel.cuh"
#include "hopper_launch.cuh"

namespace hopper {
namespace {

constexpr int kBwdThreads = 2 * kWarpgroup;
constexpr int kBwdStages = 2;
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory (1024-byte aligned panels, as TMA writes them; hopper_kernel.cuh's Smem):
//   K_j, V_j    kBwdBc x D each, loaded once
//   Q_i, dO_i   kBwdStages x (kBwdBr x D) each
//   dS^T        2 buffers x 2 warpgroups x (64 keys x kBwdBr queries): one 128-byte panel each
//   L, Di       2 stages x 2 warpgroups x kBwdBr floats each (every warpgroup stages its own)
//   barriers    full_kv, full[kBwdStages], empty[kBwdStages]
template <int D>
struct BwdSmem {
  static constexpr int kKVPanel = kBwdBc * kPanelBytes;
  static constexpr int kQPanel = kBwdBr * kPanelBytes;
  static constexpr int kKVBytes = (D / 64) * kKVPanel;
  static constexpr int kQBytes = (D / 64) * kQPanel;
  static constexpr int kDSBytes = 64 * kPanelBytes;  // 64 keys x 64 queries of T
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKVBytes;
  static constexpr int kQ = kV + kKVBytes;
  static constexpr int kdO = kQ + kBwdStages * kQBytes;
  static constexpr int kdS = kdO + kBwdStages * kQBytes;
  static constexpr int kStats = kdS + 2 * 2 * kDSBytes;
  static constexpr int kBarriers = kStats + 2 * 2 * 2 * kBwdBr * 4;
  static constexpr int kBytes = kBarriers + (1 + 2 * kBwdStages) * 8 + 1024;  // + 1024: aligning the base
  static_assert(kBwdBr == 64, "a dS^T panel holds 64 queries (128 bytes of T)");
};

template <typename T, int D, int kVariant>
__global__ void __launch_bounds__(kBwdThreads, 1) hopper_bwd_kernel(const __grid_constant__ BwdParams p) {
  using L = BwdSmem<D>;
  constexpr bool kDqByColumns = kVariant == 1;
  constexpr int kDqN = kDqByColumns ? D / 2 : D;  // dQ columns one warpgroup adds
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  uint64_t* full_kv = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* full = full_kv + 1;
  uint64_t* empty = full + kBwdStages;

  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid / kWarpgroup, wg_tid = tid % kWarpgroup;
  const int warp = wg_tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // Block x: key block x % n_kblocks of KV head x / n_kblocks (the key blocks of one head side by
  // side, so the Q, dO and dQ rows they share stay in L2: FlashAttention-2's order).
  const int n_kblocks = (p.Sk + kBwdBc - 1) / kBwdBc;
  const int bh_kv = static_cast<int>(blockIdx.x) / n_kblocks;
  const int batch = bh_kv / p.H_kv, head_kv = bh_kv % p.H_kv;
  const int group = p.H / p.H_kv;  // G query heads share this K/V head
  const int k0 = (static_cast<int>(blockIdx.x) % n_kblocks) * kBwdBc;
  const int k0w = k0 + 64 * wg;  // the warpgroup's first key
  const int kv_len = p.key_lengths != nullptr ? p.key_lengths[batch] : p.Sk;
  // The query blocks that see this block's keys: from the diagonal on (causal); none for padding.
  // Step `step` is query block qb_first + step % n_qsteps of the group's query head step / n_qsteps.
  const int qb_first = p.causal ? k0 / kBwdBr : 0;
  const int n_qsteps = k0 < kv_len ? max((p.Sq + kBwdBr - 1) / kBwdBr - qb_first, 0) : 0;
  const int n_steps = group * n_qsteps;
  auto step_qblock = [&](int step) { return qb_first + step % n_qsteps; };
  auto step_head = [&](int step) { return head_kv * group + step / n_qsteps; };
  auto step_bh = [&](int step) { return batch * p.H + step_head(step); };

  // L_i log2(e) and D_i of the warpgroup's copy, stage s: thread t < 64 loads (load_stat, for a
  // step) and stages (stage_stat) L of row t of the step's query block, thread 64 + t its D_i. A row
  // past Sq or with no visible key at all (lse = -inf) stages L = +inf: its P = 2^(-inf) = 0 needs
  // no test in the loop. The loads fly for a whole step before their value is staged.
  float* stats = reinterpret_cast<float*>(smem + L::kStats) + wg * 2 * 2 * kBwdBr;
  auto load_stat = [&](int step) {
    const int row = step_qblock(step) * kBwdBr + wg_tid % kBwdBr;
    const int64_t at = static_cast<int64_t>(step_bh(step)) * p.Sq + row;
    if (row >= p.Sq) return wg_tid < kBwdBr ? -CUDART_INF_F : 0.0f;
    return wg_tid < kBwdBr ? p.lse[at] : p.delta[at];
  };
  auto stage_stat = [&](int s, float loaded) {  // L: [0, 64), Di: [64, 128)
    const float l_log2 = loaded != -CUDART_INF_F ? loaded * kLog2e : CUDART_INF_F;
    stats[s * 2 * kBwdBr + wg_tid] = wg_tid < kBwdBr ? l_log2 : loaded;
  };

  if (tid == 0) {
    mbarrier_init(full_kv, 2);
    for (int s = 0; s < kBwdStages; ++s) {
      mbarrier_init(&full[s], 2);
      mbarrier_init(&empty[s], kBwdThreads);
    }
    fence_barrier_init();
  }
  if (n_steps > 0) stage_stat(0, load_stat(0));
  float next_stat = n_steps > 1 ? load_stat(1) : 0.0f;  // staged in step 0
  __syncthreads();

  // Q_i and dO_i of step `step` into its stage (one thread).
  auto load_q_do = [&](int step) {
    const int s = step % kBwdStages, row0 = step_qblock(step) * kBwdBr, head = step_head(step);
    load_tile<D>(smem + L::kQ + s * L::kQBytes, L::kQPanel, &p.q_map, &full[s], row0, head, batch);
    load_tile<D>(smem + L::kdO + s * L::kQBytes, L::kQPanel, &p.do_map, &full[s], row0, head, batch);
  };
  if (tid == 0 && n_steps > 0) {
    load_tile<D>(smem + L::kK, L::kKVPanel, &p.k_map, full_kv, k0, head_kv, batch);
    load_tile<D>(smem + L::kV, L::kKVPanel, &p.v_map, full_kv, k0, head_kv, batch);
    load_q_do(0);
  }

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;

  if (n_steps > 0) {
    // K_j rows past kv_len (key padding inside Sk) hold whatever memory holds, even NaN, and dQ
    // contracts over them (0 * NaN = NaN): zero them once. V_j's only meet dP^T rows of keys whose
    // P and dS are set to 0, never multiplied.
    mbarrier_wait(full_kv, 0);
    if (kv_len < p.Sk && k0 + kBwdBc > kv_len)
      zero_padded_rows<D, kBwdBc>(smem + L::kK, kv_len - k0, tid, kBwdThreads, 1);
  }
  const uint32_t k_w = smem_addr(smem + L::kK) + 64 * wg * kPanelBytes;  // the warpgroup's 64 keys
  const uint32_t v_w = smem_addr(smem + L::kV) + 64 * wg * kPanelBytes;
  const float c = p.scale * kLog2e;

  for (int step = 0; step < n_steps; ++step) {
    const int s = step % kBwdStages;
    const int q0 = step_qblock(step) * kBwdBr;
    const uint32_t q_tile = smem_addr(smem + L::kQ + s * L::kQBytes);
    const uint32_t do_tile = smem_addr(smem + L::kdO + s * L::kQBytes);
    unsigned char* ds_pair = smem + L::kdS + (step % 2) * 2 * L::kDSBytes;  // both warpgroups' dS^T: 128 keys
    unsigned char* ds_tile = ds_pair + wg * L::kDSBytes;
    const float* sL = stats + s * 2 * kBwdBr;
    const float* sDi = sL + kBwdBr;

    // The copies of step + 1 into the other stage, once every thread is done with its last use.
    if (tid == 0 && step + 1 < n_steps) {
      if (step >= 1) mbarrier_wait(&empty[(step + 1) % kBwdStages], ((step - 1) / kBwdStages) & 1);
      load_q_do(step + 1);
    }
    // Step + 1's L_i, D_i (loaded a step ago) are staged below; step + 2's are loaded now.
    const float stat_to_stage = next_stat;
    if (step + 2 < n_steps) next_stat = load_stat(step + 2);
    mbarrier_wait(&full[s], (step / kBwdStages) & 1);

    // Step 1: S^T = K_w Q_i^T and dP^T = V_w dO_i^T, k = head dim in steps of 16 (panel kk / 4,
    // 32 bytes per k-step inside it), both operands K-major.
    float st[kBwdBr / 2], dpt[kBwdBr / 2];
    auto transposed_scores = [&](float (&acc)[kBwdBr / 2], uint32_t keys, uint32_t queries) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_ss<T, kBwdBr>(acc, desc_k_major(keys + (kk / 4) * L::kKVPanel + (kk % 4) * 32),
                            desc_k_major(queries + (kk / 4) * L::kQPanel + (kk % 4) * 32), kk > 0);
    };
    fence_operand(st);
    fence_operand(dpt);
    wgmma_fence();
    transposed_scores(st, k_w, q_tile);
    transposed_scores(dpt, v_w, do_tile);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(st);
    fence_operand(dpt);

    // Step 2: P^T = 2^(S^T c - L_i) and dS^T = P^T (dP^T - D_i), in place. Element 4j + e: key
    // 16 warp + g + 8 (e / 2) of the warpgroup, query 8j + 2t + e % 2 of the block. Blocks that
    // cross kv_len or the causal diagonal test each element; the others run without a test.
    const bool need_mask = k0w + 64 > kv_len || (p.causal && k0w + 63 > q0);
    auto probabilities_and_grads = [&](auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
      for (int j = 0; j < kBwdBr / 8; ++j) {
        const float2 li = *reinterpret_cast<const float2*>(sL + 8 * j + 2 * t);
        const float2 di = *reinterpret_cast<const float2*>(sDi + 8 * j + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pij = tc::exp2_approx(fmaf(st[4 * j + e], c, -((e & 1) ? li.y : li.x)));
          float dsij = pij * (dpt[4 * j + e] - ((e & 1) ? di.y : di.x));
          if constexpr (kMasked) {
            const int key = k0w + 16 * warp + g + 8 * (e / 2);
            const int row = q0 + 8 * j + 2 * t + (e & 1);
            const bool visible = key < kv_len && !(p.causal && key > row);
            pij = visible ? pij : 0.0f;
            dsij = visible ? dsij : 0.0f;  // a select: dP^T of a padding key may be NaN
          }
          st[4 * j + e] = pij;
          dpt[4 * j + e] = dsij;
        }
      }
    };
    if (need_mask) {
      probabilities_and_grads(std::true_type{});
    } else {
      probabilities_and_grads(std::false_type{});
    }

    // Step 3: P^T and dS^T rounded to T: the accumulators of n8 tiles 2kk, 2kk + 1 are wgmma's A
    // fragment for queries 16kk..16kk+15 (as P in the forward). dS^T also goes to shared memory
    // for dQ: row = key (16 warp + g + 8h), chunk j = 8 queries, swizzled as TMA would.
    uint32_t pa[kBwdBr / 16][4], dsa[kBwdBr / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBwdBr / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pa[kk][r] = tc::pack2<T>(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
        dsa[kk][r] = tc::pack2<T>(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
      }
    }
#pragma unroll
    for (int j = 0; j < kBwdBr / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * warp + g + 8 * h;
        *reinterpret_cast<uint32_t*>(ds_tile + swizzled_chunk(row, j, L::kDSBytes) + 4 * t) = dsa[j / 2][(j % 2) * 2 + h];
      }
    }

    // Step 4: dV_w += P^T dO_i and dK_w += dS^T Q_i, k = queries in steps of 16 (B MN-major: 16
    // queries = two 1024-byte groups of 8 rows; the D / 64 panels kBwdBr rows apart).
#pragma unroll
    for (int kk = 0; kk < kBwdBr / 16; ++kk) {
      fence_operand(pa[kk]);
      fence_operand(dsa[kk]);
    }
    fence_operand(dv);
    fence_operand(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBwdBr / 16; ++kk) wgmma_rs<T, D>(dv, pa[kk], desc_mn_major(do_tile + kk * 2048, L::kQPanel));
#pragma unroll
    for (int kk = 0; kk < kBwdBr / 16; ++kk) wgmma_rs<T, D>(dk, dsa[kk], desc_mn_major(q_tile + kk * 2048, L::kQPanel));
    wgmma_commit();
    // Meanwhile: the next block's L_i, D_i into the other stage, and every warp's dS^T stores
    // visible to wgmma (the async proxy) before the warpgroup (by keys) or both (by columns) read them.
    if (step + 1 < n_steps) stage_stat((step + 1) % kBwdStages, stat_to_stage);
    fence_proxy_async();
    if constexpr (kDqByColumns) {
      named_barrier_sync(1, kBwdThreads);
    } else {
      named_barrier_sync(2 + wg, kWarpgroup);
    }
    wgmma_wait<0>();
    fence_operand(dv);
    fence_operand(dk);
    mbarrier_arrive(&empty[s]);  // Q_i and dO_i are read for the last time

    // Step 5: the warpgroup's part of dQ_i = dS K_j: A = dS (queries x keys) read from the stored
    // dS^T (MN-major: queries contiguous; 16 keys = +2048 bytes, the two warpgroups' panels are
    // consecutive), B = K_j (keys x D, MN-major). By keys: its own 64 keys, all D columns; by
    // columns: all 128 keys, panel w of K_j.
    float dq[kDqN / 2];
    const uint32_t ds_a = smem_addr(kDqByColumns ? ds_pair : ds_tile);
    // by columns: the warpgroup's D/2 columns of K_j, panel w at D = 128, half a panel at D = 64
    const uint32_t k_b = kDqByColumns ? smem_addr(smem + L::kK) + (wg * kDqN / 64) * L::kKVPanel + (wg * kDqN % 64) * 2
                                      : k_w;
    fence_operand(dq);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < (kDqByColumns ? kBwdBc : 64) / 16; ++kk)
      wgmma_ss<T, kDqN, 1, 1>(dq, desc_mn_major(ds_a + kk * 2048, L::kDSBytes),
                              desc_mn_major(k_b + kk * 2048, L::kKVPanel), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(dq);
    // Into part (by columns: w) of the FP32 accumulator of the step's query block, in fragment order
    // (the header).
    float4* acc = reinterpret_cast<float4*>(p.dq_accum) +
                  (static_cast<int64_t>(step_bh(step)) * p.n_qblocks + step_qblock(step)) * (16 * D) +
                  (kDqByColumns ? wg * (kDqN / 8) * kWarpgroup : 0);
#pragma unroll
    for (int j = 0; j < kDqN / 8; ++j)
      atomicAdd(acc + j * kWarpgroup + wg_tid, make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]));
  }

  // Epilogue: dK = scale dK_w and dV_w, rounded to T, for the warpgroup's keys below Sk (padding
  // keys and keys no query sees get zeros); summed over the group's query heads.
  T* dK = static_cast<T*>(p.dk) + static_cast<int64_t>(bh_kv) * p.Sk * D;
  T* dV = static_cast<T*>(p.dv) + static_cast<int64_t>(bh_kv) * p.Sk * D;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = k0w + 16 * warp + g + 8 * h;
    if (key >= p.Sk) continue;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int64_t at = static_cast<int64_t>(key) * D + 8 * j + 2 * t;
      *reinterpret_cast<uint32_t*>(dK + at) = tc::pack2<T>(p.scale * dk[4 * j + 2 * h], p.scale * dk[4 * j + 2 * h + 1]);
      *reinterpret_cast<uint32_t*>(dV + at) = tc::pack2<T>(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
    }
  }
}

// dQ[bh, row, 2c..2c+1] = scale * accumulator, rounded to T: one thread per pair of columns. Row r
// of a query block, column cN + 8j + 2t + e sits in part c, thread 32 (r / 16) + 4 (r % 8) + t,
// register 4j + 2 ((r % 16) / 8) + e of the fragment order (N = part_cols).
template <typename T>
__global__ void hopper_dq_convert_kernel(const float* accum, T* dq, int64_t pairs, int Sq, int D, int part_cols,
                                         int n_qblocks, float scale) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const int col = static_cast<int>(idx % (D / 2)) * 2;
  const int64_t row_all = idx / (D / 2);
  const int row = static_cast<int>(row_all % Sq);
  const int64_t bh = row_all / Sq;
  const int r = row % kBwdBr, part = col / part_cols, j = (col % part_cols) / 8, t = (col % 8) / 2;
  const int thread = 32 * (r / 16) + 4 * (r % 8) + t;
  const int64_t tile = bh * n_qblocks + row / kBwdBr;
  const float2 v = *reinterpret_cast<const float2*>(accum + tile * kBwdBr * D + part * kBwdBr * part_cols +
                                                    (j * kWarpgroup + thread) * 4 + 2 * ((r % 16) / 8));
  *reinterpret_cast<uint32_t*>(dq + idx * 2) = tc::pack2<T>(scale * v.x, scale * v.y);
}

template <typename T, int D, int kVariant>
void launch_instance(const BwdParams& p, int64_t blocks, int device, cudaStream_t stream) {
  constexpr int kSmem = BwdSmem<D>::kBytes;
  course::opt_in_shared_memory<hopper_bwd_kernel<T, D, kVariant>>(device, kSmem);
  hopper_bwd_kernel<T, D, kVariant><<<static_cast<unsigned>(blocks), kBwdThreads, kSmem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the variant (the header) splits dQ by columns.
bool dq_by_columns(int variant) {
  TORCH_CHECK(variant == 0 || variant == 1, "variant must be 0 (dQ by keys) or 1 (dQ by columns), got ", variant);
  return variant == 1;
}

}  // namespace

void launch_backward(const BwdParams& p, int D, int variant, Dtype dtype, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const int64_t blocks = static_cast<int64_t>((p.Sk + kBwdBc - 1) / kBwdBc) * p.B * p.H_kv;
  TORCH_CHECK(blocks <= 0x7fffffff, "k: too many key blocks (B*H_kv*ceil(Sk/", kBwdBc, ")) for one grid");
  dq_by_columns(variant);  // checks it
  dispatch(D, dtype, [&](auto type, auto head_dim) {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    variant == 0 ? launch_instance<T, kD, 0>(p, blocks, device, stream)
                 : launch_instance<T, kD, 1>(p, blocks, device, stream);
  });
}

void launch_dq_convert(const float* accum, void* dq, int64_t BH, int Sq, int D, int variant, int n_qblocks,
                       float scale, Dtype dtype, cudaStream_t stream) {
  const int64_t pairs = BH * Sq * (D / 2);
  const int part_cols = dq_by_columns(variant) ? D / 2 : D;
  constexpr int kThreads = 256;
  const int64_t blocks = (pairs + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= 0x7fffffff, "q: too many rows (B*H*Sq) for one grid");
  if (dtype == Dtype::kBFloat16) {
    hopper_dq_convert_kernel<__nv_bfloat16><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        accum, static_cast<__nv_bfloat16*>(dq), pairs, Sq, D, part_cols, n_qblocks, scale);
  } else {
    hopper_dq_convert_kernel<__half><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        accum, static_cast<__half*>(dq), pairs, Sq, D, part_cols, n_qblocks, scale);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace hopper
