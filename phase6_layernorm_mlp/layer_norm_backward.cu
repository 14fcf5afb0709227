// LayerNorm backward (layer_norm.cu is the forward). With s the LayerNorm's input (x, or the sum
// x + residual of add_layer_norm), for each row of `hidden` elements:
//   xhat   = (s - mu) * rstd                              (mu, rstd: the forward's statistics)
//   g      = dy * gamma                                   (dL/dxhat)
//   ds     = rstd * (g - mean(g) - xhat * mean(g * xhat))  (+ dsum: the gradient that reached the
//                                                          sum output of add_layer_norm, added here)
// and over all rows:
//   dgamma = sum_rows(dy * xhat),   dbeta = sum_rows(dy).
// Storage FP32, FP16 or BF16; all arithmetic and every sum in FP32.
//
// mu and rstd are not saved by the forward: the backward reads s anyway, so it recomputes them
// from the row it already holds (the forward's shifted two-pass), at no extra memory traffic.
//
// Two reductions, two shapes:
//   - ds needs two sums along its row (mean(g), mean(g * xhat)): one team per row, a warp (rows of
//     up to 512 elements) or several warps, the row held in registers.
//   - dgamma / dbeta need sums down each column, over every row. Each team walks many rows
//     (row = team, team + teams, ...), always holding the same columns, so it adds its rows' dy * xhat
//     and dy into registers. A block holds as many teams as fit in 16 warps (a team of 8 warps or
//     more: one), about 16 warps per SM; at the end its teams add their sums in a fixed tree in
//     shared memory and the block writes one row of partial sums (pass 1): one or two partial
//     rows per SM. Pass 2 adds the partial rows of each column: where teams share blocks, in the
//     same launch after a grid-wide barrier (step 5), else in a kernel of its own. No atomics: the
//     order of every sum is fixed, so dgamma and dbeta are the same bits on every run.
//
// Versions (the launcher picks one; "chunk" = one 16-byte vector, or one element where the row or
// a pointer is not 16-byte aligned):
//   1. ln_backward_cached_kernel<.., kWarpPerRow = true>: a warp per row, up to 16 elements per
//      lane (hidden <= 512), warp shuffles only; 16 teams per block.
//   2. ln_backward_cached_kernel<.., kWarpPerRow = false>: a team of warps per row, 16 elements
//      per thread, up to 512 threads (hidden <= 8192), its sums through shared memory and a named
//      barrier of its own (bar.sync id, threads: the block's other teams do not wait); as many
//      teams per block as fit in 16 warps (teams of 8 warps or more: one). Four arrays of row live
//      in registers (s, dy, and the two column sums): 16 elements each is about 64 registers, so a
//      512-thread block stays within its 128 registers per thread without spilling (the forward
//      holds one array).
//   3. ln_backward_streaming_kernel: a block per row for longer rows; reads the row from memory in
//      each of its four passes (all but the first from L2) and keeps its column partial sums in
//      its own row of the partials buffer.
//   4. (replaced by 5) versions 1 and 2 with the team's next row of s and dy loaded into registers
//      while the current row is reduced: one row in flight per team, all the registers allowed.
//   5. ln_backward_cached_kernel<.., kRing = true>: versions 1 and 2 with the team's rows in flight
//      through shared memory: a ring of `slots` rows per team, filled by cp.async (16-byte copies,
//      global to shared without registers). A row's copies are issued `slots` rows ahead and the
//      thread that issued them is the one that reads them back (its own chunks of the row), so
//      cp.async.wait_group alone makes them visible, no barrier. The team then has slots - 1
//      rows in flight while it reduces the current one, where version 4 had one; the limit is the
//      shared memory per SM, not the registers. dsum rides in the ring too. The launcher runs
//      version 5 wherever rows are in 16-byte chunks, every dtype.
#include <algorithm>
#include <cstdint>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cooperative_groups.h>

#include "common.cuh"
#include "cp_async.cuh"
#include "launchers.h"
#include "shared_memory_opt_in.h"
#include "vec_io.cuh"

namespace phase6 {
namespace {

constexpr int kRowElems = 16;          // versions 1 and 2: elements of row per thread
constexpr int kBlockThreads = 512;     // versions 1 and 2: teams per block, as many as fit; a team at most this
constexpr int kSoloTeamThreads = 256;  // ... but a team of this many threads or more has a block of its own
constexpr int kStreamingThreads = 512; // version 3
constexpr int kWarpsPerSM = 16;        // warps in flight: about 16 per SM (a memory-bound kernel)
constexpr int kReduceCols = 32;        // pass 2: a block adds 32 columns ...
constexpr int kReduceRows = 16;        // ... 16 partial rows at a time per column ...
constexpr int kReduceInFlight = 8;     // ... each thread with 8 independent sums (8 loads in flight)
static_assert(kReduceCols == course::kWarpSize && kReduceCols * kReduceRows >= kBlockThreads,
              "step 5: a block of versions 1 and 2 is at most kReduceRows lanes of a warp each");
constexpr int kMaxRingSlots = 4;      // version 5: rows of the ring per team, at most (fewer where shared memory is short)
// Version 5 (rows in flight through shared memory) wherever rows are in 16-byte chunks (cp.async
// copies 16 bytes); versions 1 and 2 for the scalar path.
template <int VEC>
constexpr bool kRingRows = VEC > 1;

// Pass 2 of dgamma / dbeta for the columns [col0, col0 + kReduceCols) of the [partial_rows, hidden]
// partials, by `lanes` (<= kReduceRows) lanes of kReduceCols threads: thread (x, y) adds column
// col0 + x of the partial rows y, y + lanes, ... in groups of kReduceInFlight rows, each group's
// loads issued together into independent sums (few blocks share this work, so each SM needs many
// loads in flight to hide the L2's latency), adds those in order, then the lanes' sums are added in
// shared memory (sg, sb); a fixed order. Every thread of the block calls it; it ends on a barrier, so
// sg and sb may be used again. Plain loads: in a kernel of its own the compiler reads through the
// read-only path (its pointers are const __restrict__); in the fold the grid-wide barrier makes the
// other blocks' stores visible to them. (Written as __ldg or __ldcg, the loads came out of the
// compiler one or two in flight, each waiting for its sum.)
template <typename T>
__device__ __forceinline__ void add_partial_rows(const float* partial_dgamma, const float* partial_dbeta,
                                                 int64_t partial_rows, int64_t hidden, int64_t col0, int x, int y,
                                                 int lanes, float (*sg)[kReduceCols + 1], float (*sb)[kReduceCols + 1],
                                                 T* dgamma, T* dbeta) {
  const int64_t col = col0 + x;
  float g = 0.0f, b = 0.0f;
  if (col < hidden) {
    float gu[kReduceInFlight] = {}, bu[kReduceInFlight] = {};
    int64_t t = y;
    // Whole groups of kReduceInFlight rows: every load issued before the first sum waits on one.
    for (; t + (kReduceInFlight - 1) * lanes < partial_rows; t += kReduceInFlight * lanes) {
      float lg[kReduceInFlight], lb[kReduceInFlight];
#pragma unroll
      for (int u = 0; u < kReduceInFlight; ++u) {
        lg[u] = partial_dgamma[(t + u * lanes) * hidden + col];
        lb[u] = partial_dbeta[(t + u * lanes) * hidden + col];
      }
#pragma unroll
      for (int u = 0; u < kReduceInFlight; ++u) {
        gu[u] += lg[u];
        bu[u] += lb[u];
      }
    }
    for (; t < partial_rows; t += lanes) {  // the rows after the last whole group
      gu[0] += partial_dgamma[t * hidden + col];
      bu[0] += partial_dbeta[t * hidden + col];
    }
#pragma unroll
    for (int u = 0; u < kReduceInFlight; ++u) {
      g += gu[u];
      b += bu[u];
    }
  }
  sg[y][x] = g;
  sb[y][x] = b;
  __syncthreads();
  if (y == 0 && col < hidden) {
    for (int r = 1; r < lanes; ++r) {
      g += sg[r][x];
      b += sb[r][x];
    }
    dgamma[col] = from_float<T>(g);
    dbeta[col] = from_float<T>(b);
  }
  __syncthreads();
}

// The threads of one team wait for each other, not for the block's other teams: barrier `id`
// (1..15; 0 is __syncthreads') of `threads` threads.
__device__ __forceinline__ void team_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The sum of v over a team: a warp's shuffles, or the team's warps' sums through `slots` (the
// team's own floats of shared memory, one per warp; this warp's is slots[warp]) between two
// barriers of the team (the second lets the next sum reuse the slots).
template <bool kWarpPerRow>
__device__ __forceinline__ float team_sum(float v, float* slots, int warp, int team_in_block, int team_size) {
  v = course::warp_reduce_sum(v);
  if constexpr (kWarpPerRow) return v;
  const int lane = threadIdx.x % course::kWarpSize;
  if (lane == 0) slots[warp] = v;
  team_barrier(1 + team_in_block, team_size);
  v = course::warp_reduce_sum(lane < team_size / course::kWarpSize ? slots[lane] : 0.0f);
  team_barrier(1 + team_in_block, team_size);
  return v;
}

// Version 5's wait: until at most `pending` (0 .. kMaxRingSlots - 1) of this thread's cp.async groups
// are in flight (wait_group takes an immediate).
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  static_assert(kMaxRingSlots == 4, "one case per possible count");
  switch (pending) {
    case 0: course::cp_async_wait<0>(); break;
    case 1: course::cp_async_wait<1>(); break;
    case 2: course::cp_async_wait<2>(); break;
    default: course::cp_async_wait<3>(); break;
  }
}

// Versions 1, 2 and 5. team_threads: the threads of a team (version 2; version 1's is a warp);
// the block is blockDim.x / team_threads teams. partial_dgamma / partial_dbeta: [gridDim.x, hidden]
// FP32, or nullptr (no parameter gradients); dgamma / dbeta [hidden] for pass 2 in this launch
// (step 5, whose grid-wide barrier needs a cooperative launch), or nullptr (pass 2 left to
// ln_param_reduce_kernel). gamma, dsum may be nullptr. ring_slots: version 5's rows per team (>= 1;
// 0 in versions 1 and 2). Dynamic shared memory: Plan::smem_bytes, the largest of version 5's ring
// (ring_bytes), step 4's tree (tree_bytes) and step 5's column sums (fold_bytes), one after another
// in the same bytes.
template <typename T, int VEC, bool kWarpPerRow, bool kRing>
__global__ void __launch_bounds__(kBlockThreads)
ln_backward_cached_kernel(const T* __restrict__ dy, const T* __restrict__ s, const T* __restrict__ gamma,
                          const T* __restrict__ dsum, T* __restrict__ ds, float* __restrict__ partial_dgamma,
                          float* __restrict__ partial_dbeta, T* __restrict__ dgamma, T* __restrict__ dbeta,
                          int64_t rows, int64_t hidden, float eps, int team_threads, int ring_slots) {
  constexpr int NV = kRowElems / VEC;  // chunks per thread
  static_assert(kRowElems % VEC == 0, "a thread holds whole chunks");
  static_assert(!kRing || VEC * sizeof(T) == 16, "version 5 copies 16-byte chunks");
  __shared__ float scratch[kBlockThreads / course::kWarpSize];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  const int team_size = kWarpPerRow ? course::kWarpSize : team_threads;
  const int teams_per_block = blockDim.x / team_size;
  const int team_in_block = threadIdx.x / team_size;
  const int rank = threadIdx.x % team_size;
  float* slots = scratch + team_in_block * (team_size / course::kWarpSize);  // team_sum's
  const int warp = rank / course::kWarpSize;                                 // in the team
  const int64_t team = static_cast<int64_t>(blockIdx.x) * teams_per_block + team_in_block;
  const int64_t teams = static_cast<int64_t>(gridDim.x) * teams_per_block;
  const int64_t chunks = hidden / VEC;
  const float n = static_cast<float>(hidden);
  float acc_dgamma[NV][VEC] = {};  // this thread's columns: sum over its team's rows of dy * xhat
  float acc_dbeta[NV][VEC] = {};   // ... and of dy

  // Version 5: the ring, [ring_slots][arrays][NV][blockDim.x] 16-byte chunks (arrays: s, dy and
  // dsum if given); thread t's chunk i of a row sits at [..][i][t], so a warp reads 512 consecutive
  // bytes. fill(row, slot) issues this thread's copies of the row (none past the last row) and
  // commits them as one group, so that every row is one group, empty or not; K_next is the first
  // element of the team's next row (the shift of step 1), loaded a row ahead.
  const int arrays = dsum != nullptr ? 3 : 2;
  uint4* ring = reinterpret_cast<uint4*>(dynamic_smem);
  auto chunk_at = [&](int slot, int array, int i) -> uint4& {
    return ring[((slot * arrays + array) * NV + i) * blockDim.x + threadIdx.x];
  };
  auto fill = [&](int64_t row, int slot) {
    if (row < rows) {
      const int64_t base = row * hidden;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t c = rank + static_cast<int64_t>(i) * team_size;
        if (c < chunks) {
          course::cp_async_16(course::smem_u32(&chunk_at(slot, 0, i)), s + base + c * VEC, true);
          course::cp_async_16(course::smem_u32(&chunk_at(slot, 1, i)), dy + base + c * VEC, true);
          if (dsum != nullptr) course::cp_async_16(course::smem_u32(&chunk_at(slot, 2, i)), dsum + base + c * VEC, true);
        }
      }
    }
    course::cp_async_commit();
  };
  T K_next{};
  if constexpr (kRing) {
    for (int slot = 0; slot < ring_slots; ++slot) fill(team + slot * teams, slot);
    if (team < rows) K_next = s[team * hidden];
  }

  int slot = 0;  // version 5: the ring slot of `row`
  for (int64_t row = team; row < rows; row += teams) {  // uniform over the team
    const int64_t base = row * hidden;
    // Step 1: the forward's statistics, recomputed: d = s - s[0] into registers, mean_d, then
    // the variance of d from the registers, rstd. dy is loaded here too (its loads fly with s's);
    // version 5 waits for the row's copies (issued ring_slots rows ago) and reads them from its slot.
    float K;
    if constexpr (kRing) {
      cp_async_wait_pending(ring_slots - 1);  // every group but the newest ring_slots - 1: this row's
      K = to_float(K_next);
      if (row + teams < rows) K_next = s[(row + teams) * hidden];
    } else {
      K = to_float(s[base]);
    }
    float d[NV][VEC], g[NV][VEC];
    float local = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
        if constexpr (kRing) {
          to_floats<T, VEC>(Chunk<T, VEC>{chunk_at(slot, 0, i)}, d[i]);
          to_floats<T, VEC>(Chunk<T, VEC>{chunk_at(slot, 1, i)}, g[i]);
        } else {
          load_vec<T, VEC>(s + base + c * VEC, d[i]);
          load_vec<T, VEC>(dy + base + c * VEC, g[i]);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          d[i][e] -= K;
          local += d[i][e];
        }
      }
    }
    const float mean_d = team_sum<kWarpPerRow>(local, slots, warp, team_in_block, team_size) / n;
    local = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float t = d[i][e] - mean_d;
          local += t * t;
        }
      }
    }
    const float rstd = rsqrtf(team_sum<kWarpPerRow>(local, slots, warp, team_in_block, team_size) / n + eps);

    // Step 2: xhat (in place of d), g = dy * gamma (in place of dy); the column sums take
    // dy * xhat and dy; the row sums take g and g * xhat.
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
        float gm[VEC];
        if (gamma != nullptr) load_vec<T, VEC>(gamma + c * VEC, gm);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float xhat = (d[i][e] - mean_d) * rstd;
          d[i][e] = xhat;
          acc_dgamma[i][e] += g[i][e] * xhat;
          acc_dbeta[i][e] += g[i][e];
          if (gamma != nullptr) g[i][e] *= gm[e];
          sum_g += g[i][e];
          sum_gx += g[i][e] * xhat;
        }
      }
    }
    const float mean_g = team_sum<kWarpPerRow>(sum_g, slots, warp, team_in_block, team_size) / n;
    const float mean_gx = team_sum<kWarpPerRow>(sum_gx, slots, warp, team_in_block, team_size) / n;

    // Step 3: ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ dsum), stored. Version 5 then
    // refills the slot with the row ring_slots rows ahead: every value of the slot has been read
    // and used (the stores above depend on them), so the copies cannot overwrite one still unread.
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
        float out[VEC], extra[VEC] = {};
        if (dsum != nullptr) {
          if constexpr (kRing) to_floats<T, VEC>(Chunk<T, VEC>{chunk_at(slot, 2, i)}, extra);
          else load_vec<T, VEC>(dsum + base + c * VEC, extra);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = rstd * (g[i][e] - mean_g - d[i][e] * mean_gx) + extra[e];
        store_vec<T, VEC>(ds + base + c * VEC, out);
      }
    }
    if constexpr (kRing) {
      fill(row + ring_slots * teams, slot);
      slot = slot + 1 == ring_slots ? 0 : slot + 1;
    }
  }
  if constexpr (kRing) course::cp_async_wait<0>();  // (only empty groups are left: rows past the last)

  // Step 4 (pass 1 of dgamma / dbeta): the block's row of column partial sums. The block's teams
  // hold the same columns, thread `rank` of every team the same ones; of n teams, the last n / 2
  // store theirs in shared memory and the first n / 2 add them, until team 0 holds the block's sums
  // (a fixed tree). A thread's value k sits at k * team_size + rank of its team's slot: a warp's
  // 32 stores or loads of one k are 32 consecutive floats, no bank conflict. (Sums of columns past
  // the row are zeros.) A block without rows writes zeros, so pass 2 may add every row of the buffer.
  if (partial_dgamma == nullptr) return;  // uniform over the grid
  float* tree = reinterpret_cast<float*>(dynamic_smem);  // [2][teams_per_block / 2][kRowElems][team_size]
  if (kRing) __syncthreads();  // the tree takes the ring's bytes: every team is done with its ring
  const int tree_half = teams_per_block / 2 * kRowElems * team_size;
  for (int n = teams_per_block; n > 1; n = (n + 1) / 2) {
    const int half = (n + 1) / 2;  // teams [half, n) store, teams [0, n - half) add
    const bool stores = team_in_block >= half && team_in_block < n, adds = team_in_block < n - half;
    float* slot_g = &tree[(stores ? team_in_block - half : team_in_block) * kRowElems * team_size + rank];
    float* slot_b = slot_g + tree_half;
    if (stores) {
#pragma unroll
      for (int k = 0; k < kRowElems; ++k) {
        slot_g[k * team_size] = acc_dgamma[k / VEC][k % VEC];
        slot_b[k * team_size] = acc_dbeta[k / VEC][k % VEC];
      }
    }
    __syncthreads();
    if (adds) {
#pragma unroll
      for (int k = 0; k < kRowElems; ++k) {
        acc_dgamma[k / VEC][k % VEC] += slot_g[k * team_size];
        acc_dbeta[k / VEC][k % VEC] += slot_b[k * team_size];
      }
    }
    __syncthreads();
  }
  if (team_in_block == 0) {
    // Team 0 stores the row; a thread's VEC columns are consecutive: 16-byte pieces (store_floats).
    float* pg = partial_dgamma + static_cast<int64_t>(blockIdx.x) * hidden;
    float* pb = partial_dbeta + static_cast<int64_t>(blockIdx.x) * hidden;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
        store_floats<VEC>(pg + c * VEC, acc_dgamma[i]);
        store_floats<VEC>(pb + c * VEC, acc_dbeta[i]);
      }
    }
  }

  // Step 5 (pass 2, in the same launch; without dgamma it is a kernel of its own): every block waits
  // at a grid-wide barrier until every partial row is stored (the launch is cooperative: all its
  // blocks are resident at once), then the blocks add the partial rows of kReduceCols columns at a
  // time, block b the columns b * kReduceCols, then (b + gridDim.x) * kReduceCols, ...
  if (dgamma == nullptr) return;  // uniform over the grid
  cooperative_groups::this_grid().sync();
  auto* sg = reinterpret_cast<float(*)[kReduceCols + 1]>(dynamic_smem);  // [kReduceRows][kReduceCols + 1]
  auto* sb = sg + kReduceRows;                                             // the same, after it
  for (int64_t col0 = static_cast<int64_t>(blockIdx.x) * kReduceCols; col0 < hidden;
       col0 += static_cast<int64_t>(gridDim.x) * kReduceCols) {
    add_partial_rows<T>(partial_dgamma, partial_dbeta, gridDim.x, hidden, col0, threadIdx.x % kReduceCols,
                        threadIdx.x / kReduceCols, blockDim.x / kReduceCols, sg, sb, dgamma, dbeta);
  }
}

// Version 3: rows too long for registers; the same steps, each a pass over the row in memory.
// The block is its team; grid <= rows, so every block has a first row (row == blockIdx.x), which
// writes the block's partial row, and later rows add to it (the same thread owns the same
// columns in every row, so no two threads touch one partial).
template <typename T, int VEC>
__global__ void __launch_bounds__(kStreamingThreads)
ln_backward_streaming_kernel(const T* __restrict__ dy, const T* __restrict__ s, const T* __restrict__ gamma,
                             const T* __restrict__ dsum, T* __restrict__ ds, float* __restrict__ partial_dgamma,
                             float* __restrict__ partial_dbeta, int64_t rows, int64_t hidden, float eps) {
  __shared__ float scratch[course::kWarpSize];
  const int64_t chunks = hidden / VEC;
  const float n = static_cast<float>(hidden);
  float* pg = partial_dgamma == nullptr ? nullptr : partial_dgamma + blockIdx.x * hidden;
  float* pb = partial_dbeta == nullptr ? nullptr : partial_dbeta + blockIdx.x * hidden;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * hidden;
    const bool first = row == blockIdx.x;
    // Pass 1: mean of d = s - s[0].
    const float K = to_float(s[base]);
    float local = 0.0f;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[VEC];
      load_vec<T, VEC>(s + base + c * VEC, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) local += v[e] - K;
    }
    const float mean_d = course::block_reduce_sum(local, scratch) / n;
    // Pass 2: variance of d, rstd.
    local = 0.0f;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[VEC];
      load_vec<T, VEC>(s + base + c * VEC, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float t = (v[e] - K) - mean_d;
        local += t * t;
      }
    }
    const float rstd = rsqrtf(course::block_reduce_sum(local, scratch) / n + eps);
    // Pass 3: the row sums of g and g * xhat; the column partials of dy * xhat and dy.
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[VEC], dv[VEC], gm[VEC];
      load_vec<T, VEC>(s + base + c * VEC, v);
      load_vec<T, VEC>(dy + base + c * VEC, dv);
      if (gamma != nullptr) load_vec<T, VEC>(gamma + c * VEC, gm);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float xhat = ((v[e] - K) - mean_d) * rstd;
        const float g = gamma != nullptr ? dv[e] * gm[e] : dv[e];
        sum_g += g;
        sum_gx += g * xhat;
        if (pg != nullptr) {
          const int64_t col = c * VEC + e;
          pg[col] = (first ? 0.0f : pg[col]) + dv[e] * xhat;
          pb[col] = (first ? 0.0f : pb[col]) + dv[e];
        }
      }
    }
    const float mean_g = course::block_reduce_sum(sum_g, scratch) / n;
    const float mean_gx = course::block_reduce_sum(sum_gx, scratch) / n;
    // Pass 4: ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ dsum).
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[VEC], dv[VEC], gm[VEC], extra[VEC] = {}, out[VEC];
      load_vec<T, VEC>(s + base + c * VEC, v);
      load_vec<T, VEC>(dy + base + c * VEC, dv);
      if (gamma != nullptr) load_vec<T, VEC>(gamma + c * VEC, gm);
      if (dsum != nullptr) load_vec<T, VEC>(dsum + base + c * VEC, extra);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float xhat = ((v[e] - K) - mean_d) * rstd;
        const float g = gamma != nullptr ? dv[e] * gm[e] : dv[e];
        out[e] = rstd * (g - mean_g - xhat * mean_gx) + extra[e];
      }
      store_vec<T, VEC>(ds + base + c * VEC, out);
    }
  }
}

// Pass 2 of dgamma / dbeta as a kernel of its own (after version 3, and after versions 1 and 2 where
// the plan does not fold it in): one block per kReduceCols columns.
template <typename T>
__global__ void __launch_bounds__(kReduceCols * kReduceRows)
ln_param_reduce_kernel(const float* __restrict__ partial_dgamma, const float* __restrict__ partial_dbeta,
                       int64_t partial_rows, int64_t hidden, T* __restrict__ dgamma, T* __restrict__ dbeta) {
  __shared__ float sg[kReduceRows][kReduceCols + 1];
  __shared__ float sb[kReduceRows][kReduceCols + 1];
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kReduceCols;
  add_partial_rows<T>(partial_dgamma, partial_dbeta, partial_rows, hidden, col0, threadIdx.x, threadIdx.y, kReduceRows,
                      sg, sb, dgamma, dbeta);
}

// ------------------------------------------------------------------------------------------------
// Host side: one plan decides the version, the chunk width and the grid (one partial row per block), so that the
// op can size the partials buffer before the launch.

enum class Version { kWarp, kBlock, kStreaming };

// Versions 1, 2 and 5: the shared memory of step 4's tree. A round stores the kRowElems column sums
// of each thread of at most half the block's teams, for dgamma and dbeta (at most 32 KB).
size_t tree_bytes(int teams_per_block, int team_threads) {
  return 2 * sizeof(float) * (teams_per_block / 2) * kRowElems * team_threads;
}

// Step 5's column sums of a block: sg and sb, kReduceRows lanes of kReduceCols + 1 floats each.
constexpr size_t kFoldBytes = 2 * sizeof(float) * kReduceRows * (kReduceCols + 1);

// Version 5: one slot of the ring for a block of `threads`: kRowElems elements of s, dy (and dsum)
// per thread.
size_t ring_slot_bytes(int threads, size_t elem_bytes, bool with_dsum) {
  return static_cast<size_t>(threads) * kRowElems * elem_bytes * (with_dsum ? 3 : 2);
}

// The slots of the ring that fit when `resident` blocks of `threads` share an SM (all must be
// resident: the cooperative launch): the SM's shared memory, less what the system reserves per block
// and the kernel's static arrays, split between them, and no more than a block may have.
int ring_slots_that_fit(int threads, int64_t resident, size_t elem_bytes, bool with_dsum) {
  int device = 0, per_sm = 0, reserved = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
  const int64_t static_bytes = sizeof(float) * (kBlockThreads / course::kWarpSize);  // scratch
  const int64_t per_block = std::min<int64_t>(per_sm / resident - reserved - static_bytes,
                                              course::shared_memory_per_block(device) - static_bytes);
  const int64_t slots = per_block / static_cast<int64_t>(ring_slot_bytes(threads, elem_bytes, with_dsum));
  TORCH_CHECK(slots >= 1, "layer_norm_backward: a row of ", threads, " threads does not fit in this GPU's ", per_sm,
              " bytes of shared memory per SM");
  return static_cast<int>(std::min<int64_t>(slots, kMaxRingSlots));
}

struct Plan {
  Version version;
  bool vec;          // 16-byte chunks
  int team_threads;  // versions 1 and 2: the threads of a row's team
  int threads;       // per block
  int64_t blocks;
  int64_t partial_rows;  // rows of partial sums: one per block
  bool fold;             // pass 2 in pass 1's launch (cooperative; versions 1 and 2 with teams sharing blocks)
  int ring_slots;        // version 5 (versions 1 and 2 in 16-byte chunks): rows of the ring per team; else 0
};

// Blocks of `threads` threads per SM for about kWarpsPerSM warps in flight, rounded down; at least one.
int64_t blocks_per_sm(int threads) {
  return std::max<int64_t>(1, kWarpsPerSM / (threads / course::kWarpSize));
}

template <typename T>
Plan make_plan(const void* dy, const void* s, const void* gamma, const void* dsum, const void* ds, int64_t rows,
               int64_t hidden) {
  const bool vec = hidden % kVec16<T> == 0 && aligned16(dy) && aligned16(s) && aligned16(ds) &&
                   (gamma == nullptr || aligned16(gamma)) && (dsum == nullptr || aligned16(dsum));
  const int64_t sms = sm_count();
  const int64_t warp = course::kWarpSize;
  Plan p{};
  p.vec = vec;
  if (hidden <= kRowElems * kBlockThreads) {
    // Versions 1 and 2: a team of 16 elements per thread, in whole warps; as many teams per block as
    // fit in kBlockThreads (teams of 8 warps or more: one; measured faster at hidden 4096, where the
    // partial rows are a small part of the call), fewer when too few rows give every SM a block.
    p.version = hidden <= kRowElems * warp ? Version::kWarp : Version::kBlock;
    const int64_t team_warps = course::ceil_div<int64_t>(course::ceil_div<int64_t>(hidden, kRowElems), warp);
    p.team_threads = static_cast<int>(team_warps * warp);
    const int64_t max_teams = p.team_threads >= kSoloTeamThreads ? 1 : kBlockThreads / p.team_threads;
    const int64_t teams_per_block = std::clamp<int64_t>(course::ceil_div<int64_t>(rows, sms), 1, max_teams);
    p.threads = static_cast<int>(teams_per_block * p.team_threads);
    // At most kWarpsPerSM / (the block's warps) blocks per SM, rounded down: with at most 128
    // registers per thread (the launch bounds) that many are always resident at once, which a
    // cooperative launch requires (rounded up, 15-warp blocks were 141 for 132 SMs, and the 9 that
    // did not fit ran in a second wave, even without the fold).
    p.blocks = std::min(course::ceil_div<int64_t>(rows, teams_per_block),
                        sms * blocks_per_sm(p.threads));
    p.partial_rows = p.blocks;
    // The fold measured faster where teams share blocks (hidden <= 2048), slower with one team of 8
    // warps or more per block (hidden 4096: twice the blocks, half the lanes each for the sums).
    p.fold = p.team_threads < kSoloTeamThreads;
    if (kRingRows<kVec16<T>> && vec) {
      p.ring_slots = ring_slots_that_fit(p.threads, blocks_per_sm(p.threads), sizeof(T), dsum != nullptr);
    }
  } else {
    p.version = Version::kStreaming;
    p.threads = kStreamingThreads;
    p.blocks = std::min(rows, sms * blocks_per_sm(p.threads));
    p.partial_rows = p.blocks;
  }
  return p;
}

// Versions 1, 2 and 5: a cooperative launch where pass 2 is folded in (step 5 waits on every block),
// else a plain one. Dynamic shared memory: the largest of the ring, the tree and step 5's sums.
template <typename T, int VEC, bool kWarpPerRow>
void launch_cached(const Plan& p, const T* dy, const T* s, const T* gamma, const T* dsum, T* ds, float* pg, float* pb,
                   T* dgamma, T* dbeta, int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  constexpr auto kernel = ln_backward_cached_kernel<T, VEC, kWarpPerRow, kRingRows<VEC>>;
  const unsigned blocks = static_cast<unsigned>(p.blocks);
  int team_threads = p.team_threads, ring_slots = p.ring_slots;
  const bool fold = pg != nullptr && p.fold;
  const size_t smem = std::max({p.ring_slots * ring_slot_bytes(p.threads, sizeof(T), dsum != nullptr),
                                pg == nullptr ? 0 : tree_bytes(p.threads / p.team_threads, p.team_threads),
                                fold ? kFoldBytes : 0});
  if (kRingRows<VEC>) {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    course::opt_in_shared_memory<kernel>(device, course::shared_memory_per_block(device));
  }
  if (!fold) {
    kernel<<<blocks, p.threads, smem, stream>>>(dy, s, gamma, dsum, ds, pg, pb, nullptr, nullptr, rows, hidden, eps,
                                                team_threads, ring_slots);
    return;
  }
  void* args[] = {&dy, &s, &gamma, &dsum, &ds, &pg, &pb, &dgamma, &dbeta, &rows, &hidden, &eps, &team_threads,
                  &ring_slots};
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(blocks), dim3(p.threads), args,
                                             smem, stream));
}

template <typename T, int VEC>
void launch_version(const Plan& p, const T* dy, const T* s, const T* gamma, const T* dsum, T* ds, float* pg,
                    float* pb, T* dgamma, T* dbeta, int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  switch (p.version) {
    case Version::kWarp:
      launch_cached<T, VEC, true>(p, dy, s, gamma, dsum, ds, pg, pb, dgamma, dbeta, rows, hidden, eps, stream);
      break;
    case Version::kBlock:
      launch_cached<T, VEC, false>(p, dy, s, gamma, dsum, ds, pg, pb, dgamma, dbeta, rows, hidden, eps, stream);
      break;
    case Version::kStreaming:
      ln_backward_streaming_kernel<T, VEC><<<static_cast<unsigned>(p.blocks), p.threads, 0, stream>>>(
          dy, s, gamma, dsum, ds, pg, pb, rows, hidden, eps);
      break;
  }
  if (pg != nullptr && !p.fold) {  // pass 2 as a kernel of its own
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const unsigned reduce_blocks = static_cast<unsigned>(course::ceil_div<int64_t>(hidden, kReduceCols));
    ln_param_reduce_kernel<T><<<reduce_blocks, dim3(kReduceCols, kReduceRows), 0, stream>>>(pg, pb, p.partial_rows,
                                                                                            hidden, dgamma, dbeta);
  }
}

template <typename T>
void launch_typed(const void* dy, const void* s, const void* gamma, const void* dsum, void* ds, float* pg, float* pb,
                  int64_t partial_rows, void* dgamma, void* dbeta, int64_t rows, int64_t hidden, float eps,
                  cudaStream_t stream) {
  const Plan p = make_plan<T>(dy, s, gamma, dsum, ds, rows, hidden);
  TORCH_CHECK(p.partial_rows == partial_rows, "layer_norm_backward: partials sized for ", partial_rows,
              " rows, the plan has ", p.partial_rows);
  const T* dyt = static_cast<const T*>(dy);
  const T* st = static_cast<const T*>(s);
  const T* gt = static_cast<const T*>(gamma);
  const T* rt = static_cast<const T*>(dsum);
  T* out = static_cast<T*>(ds);
  T* dg = static_cast<T*>(dgamma);
  T* db = static_cast<T*>(dbeta);
  if (p.vec) launch_version<T, kVec16<T>>(p, dyt, st, gt, rt, out, pg, pb, dg, db, rows, hidden, eps, stream);
  else launch_version<T, 1>(p, dyt, st, gt, rt, out, pg, pb, dg, db, rows, hidden, eps, stream);
}

}  // namespace

int64_t layer_norm_backward_partial_rows(DType dtype, const void* dy, const void* s, const void* gamma,
                                         const void* dsum, const void* ds, int64_t rows, int64_t hidden) {
  switch (dtype) {
    case DType::kFloat16: return make_plan<__half>(dy, s, gamma, dsum, ds, rows, hidden).partial_rows;
    case DType::kBFloat16: return make_plan<__nv_bfloat16>(dy, s, gamma, dsum, ds, rows, hidden).partial_rows;
    default: return make_plan<float>(dy, s, gamma, dsum, ds, rows, hidden).partial_rows;
  }
}

void launch_layer_norm_backward(DType dtype, const void* dy, const void* s, const void* gamma, const void* dsum,
                                void* ds, float* partial_dgamma, float* partial_dbeta, int64_t partial_rows,
                                void* dgamma, void* dbeta, int64_t rows, int64_t hidden, float eps,
                                cudaStream_t stream) {
  float* pg = partial_dgamma;
  float* pb = partial_dbeta;
  switch (dtype) {
    case DType::kFloat32:
      launch_typed<float>(dy, s, gamma, dsum, ds, pg, pb, partial_rows, dgamma, dbeta, rows, hidden, eps, stream);
      break;
    case DType::kFloat16:
      launch_typed<__half>(dy, s, gamma, dsum, ds, pg, pb, partial_rows, dgamma, dbeta, rows, hidden, eps, stream);
      break;
    case DType::kBFloat16:
      launch_typed<__nv_bfloat16>(dy, s, gamma, dsum, ds, pg, pb, partial_rows, dgamma, dbeta, rows, hidden, eps,
                                  stream);
      break;
  }
}

}  // namespace phase6
