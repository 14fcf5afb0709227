// FP32 linear layer, version 4: the same C[M, N] = act(A[M, K] W[N, K]^T + bias[N]) + residual[M, N]
// on tensor cores, in 3xTF32 (sm_80+: every GPU the course supports).
//
// Versions 1-2 run every product on the FFMA pipe and stop short of cuBLAS's SGEMM, which does the
// same. A TF32 tensor-core MMA reads 19 bits of each operand; splitting each FP32 operand in two
// TF32 numbers (big + small, utils/csrc/tf32x3.cuh: phase 5's version 6 does it for attention) and
// running three MMAs per product (small*big, big*small, big*big) keeps about 21 bits of each
// product. The tensor pipe runs several times the FFMA pipe's FLOPs (the ceilings of utils/results:
// TF32 against FP32), so three MMAs per product still leave room to pass an FFMA SGEMM, at an
// accuracy level with it (run.py measures both against float64).
//
// The mapping (mma.sync.m16n8k8, TF32 operands, FP32 accumulators):
//   1. Block tile BM x BN = 128 x 128, k-slices of BK = 32, 8 warps as 2 x 4; warp (wm, wn) owns the
//      64 x 32 sub-tile rows 64 wm.., columns 32 wn..: 4 m16 tiles x 4 n8 tiles, 16 accumulators of
//      4 floats per thread.
//   2. A and W tiles stay K-contiguous in shared memory (no transpose: both operands of
//      "A W^T" are K-major, which is what the MMA's row.col operands want), rows kLd = BK + 4
//      floats apart: 16-byte copies land row by row, and ldmatrix's 8 rows of 16 bytes fall in 8
//      different bank groups (row r at group (9 r) mod 8).
//   3. ldmatrix.x4 reads a whole A fragment (16 x 8) or the B fragments of two n8 tiles in one
//      instruction: its 8x8 b16 matrices are 8 rows of 4 floats, and lane l receives word l % 4 of
//      row l / 4, exactly where the TF32 MMA wants element (g, t) (tf32x3.cuh's layouts).
//   4. A cp.async ring of kStages slices, as linear_async.cu (3 where a block may have 108 KiB of
//      shared memory, else 2: launch_linear_tf32x3); 16-byte copies when K % 4 == 0 and A,
//      W are 16-byte aligned, else 4-byte copies (any K, any alignment), zero-filled past M, N, K.
//   5. The tensor core does not round its FP32 additions to nearest: over a K of thousands, the
//      accumulator drifts (phase 5's version 6 measured it on O). Each k-slice is summed in fresh
//      accumulators (12 MMAs into each), added to the running sum C_acc by one FADD, rounded to
//      nearest. It costs 64 registers and one FADD per accumulator per slice (64 per 192 MMAs).
//   6. The epilogue (bias, activation, residual) from the accumulators: element (g, 2t..2t+1) and
//      (g + 8, 2t..2t+1) of each m16n8 tile, a float2 per pair when the vector epilogue applies.
// Split-K (linear_split_k.cuh) as in linear.cu, for grids of less than one wave.
#include <cstdint>

#include <c10/cuda/CUDAFunctions.h>

#include "common.cuh"
#include "cp_async.cuh"
#include "gelu.cuh"
#include "launchers.h"
#include "linear_split_k.cuh"
#include "linear_tile.cuh"
#include "shared_memory_opt_in.h"
#include "tf32x3.cuh"
#include "vec_io.cuh"

namespace phase6 {
namespace {

constexpr int BK = 32;                 // k-slice per stage
constexpr int kLd = BK + 4;            // shared-memory row pitch, floats (2.)
constexpr int kWarpsM = 2, kWarpsN = 4;
constexpr int kThreads = kWarpsM * kWarpsN * course::kWarpSize;
constexpr int WM = BM / kWarpsM;       // 64 rows per warp
constexpr int WN = BN / kWarpsN;       // 32 columns per warp
constexpr int kMTiles = WM / 16;       // m16 tiles per warp
constexpr int kNTiles = WN / 8;        // n8 tiles per warp
static_assert(kNTiles % 2 == 0, "ldmatrix.x4 reads the B fragments of two n8 tiles");

// One tile configuration: the ring depth and the blocks per SM the registers are sized for.
template <int STAGES_, int MIN_BLOCKS_>
struct Tf32Config {
  static constexpr int kStages = STAGES_;
  static constexpr int kMinBlocks = MIN_BLOCKS_;
  static constexpr int kStageFloats = (BM + BN) * kLd;
  static constexpr int kSmemBytes = kStages * kStageFloats * static_cast<int>(sizeof(float));
};

// Four 8x8 b16 matrices from shared memory: lane l gives the address of row l % 8 of matrix l / 8
// and receives, in r[j], word l % 4 of row l / 4 of matrix j (3.).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Global -> shared: one BM (or BN) x BK slice of A (or W), rows row0.. and k's k0.., rows past
// `rows` and k's past K zero-filled (4.).
template <bool kVec>
__device__ __forceinline__ void copy_slice(float* tile, const float* __restrict__ src, int64_t row0, int64_t rows,
                                           int64_t K, int64_t k0) {
  constexpr int kWidth = kVec ? 4 : 1;            // floats per copy
  constexpr int kPerRow = BK / kWidth;            // copies per tile row
  constexpr int kCopies = BM * kPerRow / kThreads;  // copies per thread
  static_assert(BM == BN, "A's and W's slices have the same rows");
#pragma unroll
  for (int c = 0; c < kCopies; ++c) {
    const int idx = threadIdx.x + c * kThreads;
    const int r = idx / kPerRow;
    const int k = (idx % kPerRow) * kWidth;
    const bool valid = row0 + r < rows && k0 + k < K;  // kVec: K % 4 == 0, so 4 k's are all in or all out
    const float* from = valid ? src + (row0 + r) * K + k0 + k : src;
    const uint32_t to = course::smem_u32(tile + r * kLd + k);
    if constexpr (kVec) course::cp_async_16(to, from, valid);
    else course::cp_async_4(to, from, valid);
  }
}

// acc += A_slice W_slice^T over one k-slice in 3xTF32, for this warp's 64 x 32 sub-tile. As and Ws
// are the slice's tiles offset to the warp's first row and column.
__device__ __forceinline__ void multiply_slice(const float* As, const float* Ws, int lane,
                                               float (&acc)[kMTiles][kNTiles][4]) {
  const uint32_t a_lane = course::smem_u32(As + (lane % 8 + 8 * ((lane / 8) % 2)) * kLd + 4 * (lane / 16));
  const uint32_t w_lane = course::smem_u32(Ws + (lane % 8 + 8 * (lane / 16)) * kLd + 4 * ((lane / 8) % 2));
#pragma unroll
  for (int s = 0; s < BK / 8; ++s) {
    // Step 1: W's fragments, b0 (k t, n g) and b1 (k t + 4, n g) of each n8 tile, split.
    course::Tf32Split b[kNTiles][2];
#pragma unroll
    for (int j = 0; j < kNTiles; j += 2) {
      uint32_t r[4];
      ldmatrix_x4(r, w_lane + static_cast<uint32_t>((8 * j * kLd + 8 * s) * sizeof(float)));
      b[j][0] = course::split_tf32(__uint_as_float(r[0]));
      b[j][1] = course::split_tf32(__uint_as_float(r[1]));
      b[j + 1][0] = course::split_tf32(__uint_as_float(r[2]));
      b[j + 1][1] = course::split_tf32(__uint_as_float(r[3]));
    }
    // Step 2: per m16 tile, A's fragment, split, times every n8 tile: three MMAs each.
#pragma unroll
    for (int i = 0; i < kMTiles; ++i) {
      uint32_t r[4];
      ldmatrix_x4(r, a_lane + static_cast<uint32_t>((16 * i * kLd + 8 * s) * sizeof(float)));
      const float a[4] = {__uint_as_float(r[0]), __uint_as_float(r[1]), __uint_as_float(r[2]), __uint_as_float(r[3])};
      uint32_t a_big[4], a_small[4];
      course::split_fragment(a, a_big, a_small);
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) course::mma_1688_3xtf32(acc[i][j], a_big, a_small, b[j][0], b[j][1]);
    }
  }
}

// Epilogue (6.): element (row, col) of the warp's accumulators gets bias, activation and residual
// and is stored; a float2 per pair of columns when kVec, else one float at a time.
template <Activation ACT, bool kVec>
__device__ __forceinline__ void store_fragments(const float (&acc)[kMTiles][kNTiles][4], const float* __restrict__ bias,
                                                const float* __restrict__ residual, float* __restrict__ C, int64_t M,
                                                int64_t N, int64_t m_warp, int64_t n_warp, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the m16 tile
      const int64_t m = m_warp + 16 * i + g + 8 * half;
      if (m >= M) continue;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const int64_t n = n_warp + 8 * j + 2 * t;
        const float* v = &acc[i][j][2 * half];
        if constexpr (kVec) {
          if (n >= N) continue;  // N % 4 == 0: the pair is fully in or fully out
          const float2 b = bias != nullptr ? *reinterpret_cast<const float2*>(bias + n) : make_float2(0.0f, 0.0f);
          float2 out = make_float2(activate<ACT>(v[0] + b.x), activate<ACT>(v[1] + b.y));
          if (residual != nullptr) {
            const float2 r = *reinterpret_cast<const float2*>(residual + m * N + n);
            out.x += r.x;
            out.y += r.y;
          }
          *reinterpret_cast<float2*>(C + m * N + n) = out;
        } else {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (n + e >= N) continue;
            float out = activate<ACT>(v[e] + (bias != nullptr ? bias[n + e] : 0.0f));
            if (residual != nullptr) out += residual[m * N + n + e];
            C[m * N + n + e] = out;
          }
        }
      }
    }
}

template <class Cfg, Activation ACT, bool kVec, bool kSplitK>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks)
linear_tf32x3_kernel(const float* __restrict__ A, const float* __restrict__ W, const float* __restrict__ bias,
                     const float* __restrict__ residual, float* __restrict__ C, int64_t M, int64_t N, int64_t K,
                     float* __restrict__ partials, int64_t tiles_per_split) {
  constexpr int kStages = Cfg::kStages;
  extern __shared__ __align__(16) float smem[];  // kStages x (A slice | W slice), rows of kLd floats

  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int lane = threadIdx.x % course::kWarpSize;
  const int warp = threadIdx.x / course::kWarpSize;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  // Split-K: this block multiplies k-slices [t_first, t_first + tiles) only.
  const int64_t t_first = kSplitK ? static_cast<int64_t>(blockIdx.z) * tiles_per_split : 0;
  const int64_t tiles = kSplitK ? min(course::ceil_div<int64_t>(K, BK) - t_first, tiles_per_split)
                                : course::ceil_div<int64_t>(K, BK);

  auto issue = [&](int64_t t) {  // k-slice t of this block's range into its ring stage
    float* stage = smem + (t % kStages) * Cfg::kStageFloats;
    const int64_t k0 = (t_first + t) * BK;
    copy_slice<kVec>(stage, A, m0, M, K, k0);
    copy_slice<kVec>(stage + BM * kLd, W, n0, N, K, k0);
  };

  // Prologue: slices 0 .. kStages-2 in flight, one commit group each (empty past the end).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) issue(s);
    course::cp_async_commit();
  }

  float acc[kMTiles][kNTiles][4] = {};  // C_acc: the running sum, FP32 rounded to nearest (5.)
  for (int64_t t = 0; t < tiles; ++t) {
    // Step 1: wait for slice t; the barrier also tells that every warp is done with slice t-1,
    // whose stage is refilled next.
    course::cp_async_wait<kStages - 2>();
    __syncthreads();
    // Step 2: refill that stage with slice t + kStages - 1 (an empty group past the end).
    if (t + kStages - 1 < tiles) issue(t + kStages - 1);
    course::cp_async_commit();
    // Step 3: this slice's sum in fresh accumulators, in 3xTF32 on the tensor cores.
    const float* stage = smem + (t % kStages) * Cfg::kStageFloats;
    float slice[kMTiles][kNTiles][4] = {};
    multiply_slice(stage + wm * WM * kLd, stage + BM * kLd + wn * WN * kLd, lane, slice);
    // Step 4: C_acc += the slice's sum, one FADD per element.
#pragma unroll
    for (int i = 0; i < kMTiles; ++i)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] += slice[i][j][e];
  }
  course::cp_async_wait<0>();  // nothing may be in flight when the block exits

  // Step 5: bias, activation, residual, store; with split-K, the raw partial sum into this split's
  // slice of `partials` (linear_split_reduce_kernel finishes the output).
  const int64_t m_warp = m0 + wm * WM, n_warp = n0 + wn * WN;
  if constexpr (kSplitK) {
    store_fragments<Activation::kNone, kVec>(acc, nullptr, nullptr, partials + blockIdx.z * M * N, M, N, m_warp,
                                             n_warp, lane);
  } else {
    store_fragments<ACT, kVec>(acc, bias, residual, C, M, N, m_warp, n_warp, lane);
  }
}

template <class Cfg, Activation ACT, bool kVec, bool kSplitK>
void launch_instance(const LinearArgs& p, dim3 grid, const SplitK& split, int device) {
  constexpr auto kernel = linear_tf32x3_kernel<Cfg, ACT, kVec, kSplitK>;
  course::opt_in_shared_memory<kernel>(device, Cfg::kSmemBytes);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, p.stream>>>(p.A, p.W, p.bias, p.residual, p.C, p.M, p.N, p.K,
                                                        split.workspace(), split.tiles_per_split);
}

template <class Cfg, Activation ACT>
void launch_config(const LinearArgs& p, int device) {
  dim3 grid = linear_grid(p);
  const SplitK split = plan_split_k(grid, course::ceil_div<int64_t>(p.K, BK), Cfg::kMinBlocks, p);
  // The 16-byte copies need K % 4 == 0 and aligned A, W; the float2 epilogue the vector epilogue's
  // conditions. One flag for both keeps the instances at two per activation and split.
  const bool vec = p.K % 4 == 0 && aligned16(p.A) && aligned16(p.W) && vector_epilogue(p);
  if (vec) {
    if (split.split()) launch_instance<Cfg, ACT, true, true>(p, grid, split, device);
    else launch_instance<Cfg, ACT, true, false>(p, grid, split, device);
  } else {
    if (split.split()) launch_instance<Cfg, ACT, false, true>(p, grid, split, device);
    else launch_instance<Cfg, ACT, false, false>(p, grid, split, device);
  }
  if (split.split()) reduce_split_k<ACT>(split, p);
}

// Three stages (108 KiB) where a block may have that much shared memory (sm_80, sm_90), two
// (72 KiB) on the GPUs that allow 99 KiB (sm_86, sm_89).
using ThreeStages = Tf32Config<3, 1>;
using TwoStages = Tf32Config<2, 1>;

}  // namespace

void launch_linear_tf32x3(const LinearArgs& p) {
  const int device = c10::cuda::current_device();
  const bool three = course::shared_memory_per_block(device) >= ThreeStages::kSmemBytes;
  with_activation(p.act, [&](auto act) {
    if (three) launch_config<ThreeStages, decltype(act)::value>(p, device);
    else launch_config<TwoStages, decltype(act)::value>(p, device);
  });
}

}  // namespace phase6
