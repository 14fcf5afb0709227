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
//   4. ln_backward_cached_kernel<.., kPrefetch = true>: versions 1 and 2 with the team's next row
//      of s and dy (and its first element, the shift) loaded while the current row is reduced, as
//      raw chunks (vec_io.cuh Chunk: 16 more registers for FP16 / BF16). Versions 1 and 2 hold a
//      row's loads in flight only between their issue and step 1's first sum; with 2-byte
//      elements a thread's 16 elements are half the bytes of FP32's, so at the same warps per SM
//      half the bytes are in flight. The launcher runs version 4 for FP16 and BF16 rows in 16-byte chunks.
#include <algorithm>
#include <cstdint>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cooperative_groups.h>

#include "common.cuh"
#include "launchers.h"
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
constexpr int kMinReduceCols = 8;      // step 5: down to 8 columns (a sector) per block, for more lanes
static_assert(kBlockThreads % kReduceCols == 0 && kReduceCols * kReduceRows <= kBlockThreads,
              "the lane sums of a block (step 5's, or pass 2's kernel) fit in kBlockThreads + a pad per lane");
// Version 4 (the next row in flight) for 2-byte elements in 16-byte chunks; versions 1 and 2 for
// FP32 and for the scalar path (one element per chunk: a register each, and the block version
// would spill).
template <typename T, int VEC>
constexpr bool kPrefetchRows = sizeof(T) == 2 && VEC > 1;

// The lane sums of add_partial_rows: lane y's sum of column x at y * (cols + 1) + x (padded, so
// that the column reads of the last step fall in different banks).
constexpr int kLaneSums = kBlockThreads + kBlockThreads / kMinReduceCols;

// Pass 2 of dgamma / dbeta for the columns [col0, col0 + cols) of the [partial_rows, hidden]
// partials, by `lanes` lanes of `cols` threads: thread (x, y) adds column col0 + x of the partial
// rows y, y + lanes, ... in groups of kReduceInFlight rows, each group's loads issued together into
// independent sums (a load past the last row reads nothing and adds zero), so that a thread waits on
// the L2 once per group, adds those in order, then the lanes' sums are added in shared memory (sg,
// sb: kLaneSums floats each); a fixed order. Every thread of the block calls it; it ends on a
// barrier, so sg and sb may be used again. Plain loads: in a kernel of its own the compiler reads
// through the read-only path (its pointers are const __restrict__); in the fold the grid-wide
// barrier makes the other blocks' stores visible to them. (Written as __ldg or __ldcg, the loads came
// out of the compiler one or two in flight, each waiting for its sum.)
template <typename T>
__device__ __forceinline__ void add_partial_rows(const float* partial_dgamma, const float* partial_dbeta,
                                                 int64_t partial_rows, int64_t hidden, int64_t col0, int x, int y,
                                                 int lanes, int cols, float* sg, float* sb, T* dgamma, T* dbeta) {
  const int64_t col = col0 + x;
  float g = 0.0f, b = 0.0f;
  if (col < hidden) {
    float gu[kReduceInFlight] = {}, bu[kReduceInFlight] = {};
    for (int64_t t = y; t < partial_rows; t += static_cast<int64_t>(kReduceInFlight) * lanes) {
      float lg[kReduceInFlight], lb[kReduceInFlight];
#pragma unroll
      for (int u = 0; u < kReduceInFlight; ++u) {
        const int64_t r = t + static_cast<int64_t>(u) * lanes;
        lg[u] = r < partial_rows ? partial_dgamma[r * hidden + col] : 0.0f;
        lb[u] = r < partial_rows ? partial_dbeta[r * hidden + col] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kReduceInFlight; ++u) {
        gu[u] += lg[u];
        bu[u] += lb[u];
      }
    }
#pragma unroll
    for (int u = 0; u < kReduceInFlight; ++u) {
      g += gu[u];
      b += bu[u];
    }
  }
  sg[y * (cols + 1) + x] = g;
  sb[y * (cols + 1) + x] = b;
  __syncthreads();
  if (y == 0 && col < hidden) {
    for (int r = 1; r < lanes; ++r) {
      g += sg[r * (cols + 1) + x];
      b += sb[r * (cols + 1) + x];
    }
    dgamma[col] = from_float<T>(g);
    dbeta[col] = from_float<T>(b);
  }
  __syncthreads();
}

// Step 5's columns per block: the widest of kReduceCols, its half, ... down to kMinReduceCols whose
// lanes (the block's threads over the columns) load every partial row in one group each; the
// narrowest where none does. (At 132 partial rows and 512 threads: 16 columns, 32 lanes; 32 columns
// would leave 4 rows to a second wait on the L2.)
__device__ __forceinline__ int fold_columns(int threads, int64_t partial_rows) {
  int cols = kReduceCols;
  while (cols > kMinReduceCols && static_cast<int64_t>(threads / cols) * kReduceInFlight < partial_rows) cols /= 2;
  return cols;
}

// The threads of one team wait for each other, not for the block's other teams: barrier `id`
// (1..15; 0 is __syncthreads') of `threads` threads.
__device__ __forceinline__ void team_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The sums of K values over a team, each v[k] replaced by its sum: a warp's shuffles, or the team's
// warps' sums through `slots` (the team's own floats of shared memory, kTeamSums per warp; warp w's
// v[k] at slots[k * warps + w]) between two barriers of the team (the second lets the next sums
// reuse the slots). K values pay the two barriers once. The warps' sums are added by every thread:
// for a few warps one broadcast load and one add each, in warp order; for more, a warp's shuffles.
constexpr int kTeamSums = 2;      // at most, at once
constexpr int kReadAllWarps = 4;  // teams of up to this many warps add the warps' sums one by one
template <bool kWarpPerRow, int K>
__device__ __forceinline__ void team_sums(float (&v)[K], float* slots, int warp, int team_in_block, int team_size) {
  static_assert(K <= kTeamSums, "slots hold kTeamSums floats per warp");
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = course::warp_reduce_sum(v[k]);
  if constexpr (!kWarpPerRow) {
    const int lane = threadIdx.x % course::kWarpSize;
    const int warps = team_size / course::kWarpSize;
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) slots[k * warps + warp] = v[k];
    }
    team_barrier(1 + team_in_block, team_size);
    if (warps <= kReadAllWarps) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        v[k] = slots[k * warps];
#pragma unroll
        for (int w = 1; w < kReadAllWarps; ++w) {
          if (w < warps) v[k] += slots[k * warps + w];
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = course::warp_reduce_sum(lane < warps ? slots[k * warps + lane] : 0.0f);
    }
    team_barrier(1 + team_in_block, team_size);
  }
}

// One value's sum over a team (team_sums of one).
template <bool kWarpPerRow>
__device__ __forceinline__ float team_sum(float v, float* slots, int warp, int team_in_block, int team_size) {
  float one[1] = {v};
  team_sums<kWarpPerRow>(one, slots, warp, team_in_block, team_size);
  return one[0];
}

// Versions 1, 2 and 4. team_threads: the threads of a team (version 2; version 1's is a warp);
// the block is blockDim.x / team_threads teams. partial_dgamma / partial_dbeta: [gridDim.x, hidden]
// FP32, or nullptr (no parameter gradients); dgamma / dbeta [hidden] for pass 2 in this launch
// (step 5, whose grid-wide barrier needs a cooperative launch), or nullptr (pass 2 left to
// ln_param_reduce_kernel). gamma, dsum may be nullptr. Dynamic shared memory: tree_bytes(teams per
// block, team_threads), for step 4.
template <typename T, int VEC, bool kWarpPerRow, bool kPrefetch>
__global__ void __launch_bounds__(kBlockThreads)
ln_backward_cached_kernel(const T* __restrict__ dy, const T* __restrict__ s, const T* __restrict__ gamma,
                          const T* __restrict__ dsum, T* __restrict__ ds, float* __restrict__ partial_dgamma,
                          float* __restrict__ partial_dbeta, T* __restrict__ dgamma, T* __restrict__ dbeta,
                          int64_t rows, int64_t hidden, float eps, int team_threads) {
  constexpr int NV = kRowElems / VEC;  // chunks per thread
  static_assert(kRowElems % VEC == 0, "a thread holds whole chunks");
  // Rows in 16-byte chunks leave registers to spare: there step 2 loads step 3's dsum early and a
  // mean is its sum times 1/n. The scalar path (a register per element) keeps step 3's load and the
  // division: with either change ptxas spilled 76-132 bytes in its block version.
  constexpr bool kSpareRegisters = VEC > 1;
  __shared__ float scratch[kTeamSums * kBlockThreads / course::kWarpSize];
  const int team_size = kWarpPerRow ? course::kWarpSize : team_threads;
  const int teams_per_block = blockDim.x / team_size;
  const int team_in_block = threadIdx.x / team_size;
  const int rank = threadIdx.x % team_size;
  float* slots = scratch + team_in_block * kTeamSums * (team_size / course::kWarpSize);  // team_sums'
  const int warp = rank / course::kWarpSize;                                              // in the team
  const int64_t team = static_cast<int64_t>(blockIdx.x) * teams_per_block + team_in_block;
  const int64_t teams = static_cast<int64_t>(gridDim.x) * teams_per_block;
  const int64_t chunks = hidden / VEC;
  const float n = static_cast<float>(hidden), inv_n = 1.0f / n;
  auto mean_of = [&](float sum) { return kSpareRegisters ? sum * inv_n : sum / n; };  // no division per row
  float acc_dgamma[NV][VEC] = {};  // this thread's columns: sum over its team's rows of dy * xhat
  float acc_dbeta[NV][VEC] = {};   // ... and of dy

  // Version 4: the row after this one, as loaded (s_next, dy_next) and its shift (K_next).
  Chunk<T, VEC> s_next[NV], dy_next[NV];
  T K_next{};
  auto fetch = [&](int64_t row) {
    const int64_t base = row * hidden;
    K_next = s[base];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
        s_next[i] = load_chunk<T, VEC>(s + base + c * VEC);
        dy_next[i] = load_chunk<T, VEC>(dy + base + c * VEC);
      }
    }
  };
  if (kPrefetch && team < rows) fetch(team);

  for (int64_t row = team; row < rows; row += teams) {  // uniform over the team
    const int64_t base = row * hidden;
    // Step 1: the forward's statistics, recomputed: d = s - s[0] into registers, mean_d, then
    // the variance of d from the registers, rstd. dy is loaded here too (its loads fly with s's);
    // version 4 converts the chunks fetched during the previous row and fetches the next row's.
    const float K = kPrefetch ? to_float(K_next) : to_float(s[base]);
    float d[NV][VEC], g[NV][VEC];
    float local = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
        if constexpr (kPrefetch) {
          to_floats<T, VEC>(s_next[i], d[i]);
          to_floats<T, VEC>(dy_next[i], g[i]);
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
    if (kPrefetch && row + teams < rows) fetch(row + teams);
    const float mean_d = mean_of(team_sum<kWarpPerRow>(local, slots, warp, team_in_block, team_size));
    local = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          d[i][e] -= mean_d;  // d - mean(d), kept: step 2 scales it into xhat
          local += d[i][e] * d[i][e];
        }
      }
    }
    const float rstd = rsqrtf(mean_of(team_sum<kWarpPerRow>(local, slots, warp, team_in_block, team_size)) + eps);

    // Step 2: xhat = (d - mean(d)) * rstd (in place), g = dy * gamma (in place of dy); the column sums take
    // dy * xhat and dy; the row sums take g and g * xhat, both summed over the team at once. In
    // 16-byte chunks (a few registers) dsum's chunks of the row, step 3's, are loaded first, so that
    // they fly during the sums; the scalar path (a register per element) loads them in step 3.
    Chunk<T, VEC> dsum_chunk[NV];
    if (kSpareRegisters && dsum != nullptr) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t c = rank + static_cast<int64_t>(i) * team_size;
        if (c < chunks) dsum_chunk[i] = load_chunk<T, VEC>(dsum + base + c * VEC);
      }
    }
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
        float gm[VEC];
        if (gamma != nullptr) load_vec<T, VEC>(gamma + c * VEC, gm);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float xhat = d[i][e] * rstd;
          d[i][e] = xhat;
          acc_dgamma[i][e] += g[i][e] * xhat;
          acc_dbeta[i][e] += g[i][e];
          if (gamma != nullptr) g[i][e] *= gm[e];
          sum_g += g[i][e];
          sum_gx += g[i][e] * xhat;
        }
      }
    }
    float sums[2] = {sum_g, sum_gx};
    team_sums<kWarpPerRow>(sums, slots, warp, team_in_block, team_size);
    const float mean_g = mean_of(sums[0]), mean_gx = mean_of(sums[1]);

    // Step 3: ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ dsum), stored; g - mean(g) first,
    // so that what cancels there cancels exactly (rstd * g - rstd * mean(g) would not).
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c = rank + static_cast<int64_t>(i) * team_size;
      if (c < chunks) {
        float out[VEC], extra[VEC] = {};
        if (dsum != nullptr) {
          if constexpr (kSpareRegisters) to_floats<T, VEC>(dsum_chunk[i], extra);
          else load_vec<T, VEC>(dsum + base + c * VEC, extra);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = rstd * (g[i][e] - mean_g - d[i][e] * mean_gx) + extra[e];
        store_vec<T, VEC>(ds + base + c * VEC, out);
      }
    }
  }

  // Step 4 (pass 1 of dgamma / dbeta): the block's row of column partial sums. The block's teams
  // hold the same columns, thread `rank` of every team the same ones; of n teams, the last n / 2
  // store theirs in shared memory and the first n / 2 add them, until team 0 holds the block's sums
  // (a fixed tree). A thread's value k sits at k * team_size + rank of its team's slot: a warp's
  // 32 stores or loads of one k are 32 consecutive floats, no bank conflict. (Sums of columns past
  // the row are zeros.) A block without rows writes zeros, so pass 2 may add every row of the buffer.
  if (partial_dgamma == nullptr) return;  // uniform over the grid
  extern __shared__ float tree[];  // [2][teams_per_block / 2][kRowElems][team_size]
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
  // blocks are resident at once), then the blocks add the partial rows of `cols` columns at a time
  // (fold_columns), block b the columns b * cols, then (b + gridDim.x) * cols, ...
  if (dgamma == nullptr) return;  // uniform over the grid
  cooperative_groups::this_grid().sync();
  __shared__ float sg[kLaneSums];
  __shared__ float sb[kLaneSums];
  const int cols = fold_columns(blockDim.x, gridDim.x);
  for (int64_t col0 = static_cast<int64_t>(blockIdx.x) * cols; col0 < hidden;
       col0 += static_cast<int64_t>(gridDim.x) * cols) {
    add_partial_rows<T>(partial_dgamma, partial_dbeta, gridDim.x, hidden, col0, threadIdx.x % cols,
                        threadIdx.x / cols, blockDim.x / cols, cols, sg, sb, dgamma, dbeta);
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
  __shared__ float sg[kLaneSums];
  __shared__ float sb[kLaneSums];
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kReduceCols;
  add_partial_rows<T>(partial_dgamma, partial_dbeta, partial_rows, hidden, col0, threadIdx.x, threadIdx.y, kReduceRows,
                      kReduceCols, sg, sb, dgamma, dbeta);
}

// ------------------------------------------------------------------------------------------------
// Host side: one plan decides the version, the chunk width and the grid (one partial row per block), so that the
// op can size the partials buffer before the launch.

enum class Version { kWarp, kBlock, kStreaming };

// Versions 1 and 2: the shared memory of step 4's tree. A round stores the kRowElems column sums of
// each thread of at most half the block's teams, for dgamma and dbeta (at most 32 KB).
size_t tree_bytes(int teams_per_block, int team_threads) {
  return 2 * sizeof(float) * (teams_per_block / 2) * kRowElems * team_threads;
}

struct Plan {
  Version version;
  bool vec;          // 16-byte chunks
  int team_threads;  // versions 1 and 2: the threads of a row's team
  int threads;       // per block
  int64_t blocks;
  int64_t partial_rows;  // rows of partial sums: one per block
  bool fold;             // pass 2 in pass 1's launch (cooperative; versions 1 and 2 with teams sharing blocks)
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
  } else {
    p.version = Version::kStreaming;
    p.threads = kStreamingThreads;
    p.blocks = std::min(rows, sms * blocks_per_sm(p.threads));
    p.partial_rows = p.blocks;
  }
  return p;
}

// Versions 1 and 2: a cooperative launch where pass 2 is folded in (step 5 waits on every block),
// else a plain one.
template <typename T, int VEC, bool kWarpPerRow>
void launch_cached(const Plan& p, const T* dy, const T* s, const T* gamma, const T* dsum, T* ds, float* pg, float* pb,
                   T* dgamma, T* dbeta, int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  auto* kernel = ln_backward_cached_kernel<T, VEC, kWarpPerRow, kPrefetchRows<T, VEC>>;
  const unsigned blocks = static_cast<unsigned>(p.blocks);
  int team_threads = p.team_threads;
  const size_t tree = pg == nullptr ? 0 : tree_bytes(p.threads / p.team_threads, p.team_threads);
  if (pg == nullptr || !p.fold) {
    kernel<<<blocks, p.threads, tree, stream>>>(dy, s, gamma, dsum, ds, pg, pb, nullptr, nullptr, rows, hidden, eps,
                                                team_threads);
    return;
  }
  void* args[] = {&dy, &s, &gamma, &dsum, &ds, &pg, &pb, &dgamma, &dbeta, &rows, &hidden, &eps, &team_threads};
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(blocks), dim3(p.threads), args,
                                             tree, stream));
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
