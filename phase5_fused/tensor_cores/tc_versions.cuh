// What the lesson's intermediate versions of the tensor-core kernel share (tc_v1_mma.cu ...
// tc_v6_lazy.cu; README "Versions"): the tiles, the block's view of the problem, the two
// shared-memory layouts, the scale and mask of S, the online-softmax step of versions 1-4 (versions
// 5 and 6 bring their own, in log2 units), P as an A fragment, the final O / l with its store, and
// the launch. Each version's file keeps its kernel: how tiles reach
// shared memory, how fragments reach registers, and the loop with its barriers, so that the diff
// of two neighbours is the idea that separates them.
//
// FlashAttention-2, Algorithm 1, as the fast kernel (tc_attention.cu) runs it: a block of Br query
// rows Q_i; for each block of Bc keys K_j, V_j: S = Q_i K_j^T, m_new = max(m, rowmax(S)),
// P = exp(S - m_new), l = e^(m - m_new) l + rowsum(P), O = e^(m - m_new) O + P V_j; finally O / l.
// Each of the 4 warps owns Br/4 = 32 query rows (two m16 tiles), so a row's statistics never
// leave its warp. Every version takes D in {64, 128} with the fast kernel's tiles there
// (Br = 128, Bc = 64) and FP32 softmax statistics and accumulators; versions 1-4 use expf.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdint>

#include "common.cuh"
#include "cp_async.cuh"
#include "shared_memory_opt_in.h"
#include "tc_mma.cuh"

namespace tc_versions {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * course::kWarpSize;
constexpr int kBr = 128;                  // query rows per block
constexpr int kBc = 64;                   // keys per K/V block
constexpr int kWarpRows = kBr / kWarps;   // query rows owned by one warp
constexpr int kM = kWarpRows / 16;        // m16 tiles of a warp's rows
constexpr int kN = kBc / 8;               // n8 tiles of S (keys)
static_assert(kBr % (16 * kWarps) == 0, "each warp owns whole m16 tiles of query rows");
static_assert(kBc % 16 == 0, "P V steps over keys in 16s (m16n8k16)");

// Shared memory of Q_i and `stages` blocks of K and V: (Br + 2 stages Bc) D elements.
template <typename T, int D>
constexpr size_t smem_bytes(int stages) {
  return static_cast<size_t>(kBr + 2 * stages * kBc) * D * sizeof(T);
}

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int H, Sq, Sk;
  float scale;  // versions 5 and 6: c = scale log2 e > 0 (course::fold_scale)
  bool causal;
};

// Two layouts of a [rows][D] tile of b16 elements: offset(row, col) is the element offset of
// (row, col); an ldmatrix.x4 of the 16 x 16 block at rows R.., chunks C, C + 1 (16-byte chunks)
// reads from ldsm_addr(lane_base(tile, lane), R, C), where lane l gives row R + l % 16, chunk
// C + l / 16, so the four 8x8 matrices are (rows 0-7 | 8-15) x (chunk C | C + 1), in that order.
// Plain: rows one after the other. A row is 128 or 256 bytes, so the same column of 8 rows falls
// in the same 4 banks: an 8-way conflict for the 8 rows a fragment load or an ldmatrix matrix reads.
template <int D>
struct PlainTile {
  __device__ __forceinline__ static int offset(int row, int col) { return row * D + col; }
  __device__ __forceinline__ static uint32_t lane_base(uint32_t tile, int lane) {
    return tile + 2 * offset(lane & 15, (lane >> 4) * 8);
  }
  __device__ __forceinline__ static uint32_t ldsm_addr(uint32_t lane_base, int R, int C) {
    return lane_base + 2 * offset(R, C * 8);
  }
};

// Swizzled: 16-byte chunk c of row r stored at chunk tc::swizzle(r, c) = c ^ (r % 8) of the same
// row (tc_mma.cuh), so those 8 rows hit 8 different groups of 4 banks. The ldmatrix address is
// one XOR and one add of constants to the lane's base (tc::ldsm_addr).
template <int D>
struct SwizzledTile {
  __device__ __forceinline__ static int offset(int row, int col) {
    return row * D + tc::swizzle<D / 8>(row, col / 8) * 8 + col % 8;
  }
  __device__ __forceinline__ static uint32_t lane_base(uint32_t tile, int lane) {
    return tile + tc::lane_tile_offset<D>(lane);
  }
  __device__ __forceinline__ static uint32_t ldsm_addr(uint32_t lane_base, int R, int C) {
    return tc::ldsm_addr<D>(lane_base, R, C);
  }
};

// Calls copy(tile offset, source, valid) for each 16-byte chunk this thread copies of rows
// [row0, row0 + kRows) of a row-major [rows, D] matrix into a [kRows][D] tile; a row at or past
// row_limit is not valid (the copy then writes zeros and reads nothing). Thread t copies chunk
// t % (D / 8) of rows t / (D / 8) + n kRowStep: one source address plus constants, and, as
// kRowStep is a multiple of 8, one swizzle for all its rows.
template <int D, int kRows, class Layout, typename T, class Copy>
__device__ __forceinline__ void for_each_chunk(const T* src, int row0, int row_limit, Copy copy) {
  constexpr int kChunks = D / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0,
                "every thread copies the same chunk of every kRowStep-th row");
  const int r0 = static_cast<int>(threadIdx.x) / kChunks;
  const int col = (static_cast<int>(threadIdx.x) % kChunks) * 8;
  const T* from = src + (static_cast<int64_t>(row0) + r0) * D + col;
#pragma unroll
  for (int n = 0; n < kRows / kRowStep; ++n) {
    const int r = r0 + n * kRowStep;
    copy(Layout::offset(r, col), from + n * kRowStep * D, row0 + r < row_limit);
  }
}

// The synchronous copy of versions 1-3: each chunk through a register (zeros for invalid rows).
template <int D, int kRows, class Layout, typename T>
__device__ __forceinline__ void copy_tile(T* tile, const T* src, int row0, int row_limit) {
  for_each_chunk<D, kRows, Layout>(src, row0, row_limit, [&](int offset, const T* from, bool valid) {
    *reinterpret_cast<uint4*>(tile + offset) =
        valid ? *reinterpret_cast<const uint4*>(from) : make_uint4(0, 0, 0, 0);
  });
}

// The block's part of the problem: its head's Q, K, V and O, its first query row, and the key
// blocks it visits (with causal masking only up to its last row's diagonal: the blocks above are
// never loaded).
template <typename T, int D>
struct Block {
  const T* Q;
  const T* K;
  const T* V;
  T* O;
  int q0;
  int n_blocks;

  __device__ explicit Block(const Params& p) {
    // The last query blocks have the most keys under causal masking: they start first.
    q0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * kBr;
    const int64_t bh = static_cast<int64_t>(blockIdx.z) * p.H + blockIdx.y;
    Q = static_cast<const T*>(p.q) + bh * p.Sq * D;
    K = static_cast<const T*>(p.k) + bh * p.Sk * D;
    V = static_cast<const T*>(p.v) + bh * p.Sk * D;
    O = static_cast<T*>(p.o) + bh * p.Sq * D;
    n_blocks = course::ceil_div(p.causal ? min(p.Sk, q0 + kBr) : p.Sk, kBc);
  }
};

// Per thread: the O fragments of its warp's rows, and m, l of its two rows of each m16 tile
// (rows lane/4 and lane/4 + 8). l is this lane's partial sum, reduced over 4 lanes at the end.
template <int D>
struct RowState {
  float o[kM][D / 8][4];
  float m[kM][2];
  float l[kM][2];

  __device__ __forceinline__ RowState() {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][dn][e] = 0.0f;
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m[mt][r] = -CUDART_INF_F;
        l[mt][r] = 0.0f;
      }
    }
  }
};

// The S fragments of a warp's rows against one key block: C fragments of kM x kN m16n8 tiles.
using Scores = float[kM][kN][4];

__device__ __forceinline__ void zero(Scores& s) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
    }
  }
}

// S *= scale (kScale; versions 5 and 6 keep S unscaled and fold the scale into the exponent); then,
// only in the blocks that cross the end of the keys or the causal diagonal of this warp's rows, the
// hidden scores become -inf (query row i, key jj: jj >= Sk, or causal jj > i).
template <bool kScale = true>
__device__ __forceinline__ void scale_and_mask(Scores& s, const Params& p, int warp_q0, int kv0, int lane) {
  const bool need_mask = kv0 + kBc > p.Sk || (p.causal && kv0 + kBc - 1 > warp_q0);
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = kScale ? s[mt][nt][e] * p.scale : s[mt][nt][e];
        if (need_mask) {
          const int i = warp_q0 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
          const int jj = kv0 + nt * 8 + (lane & 3) * 2 + (e & 1);
          if (jj >= p.Sk || (p.causal && jj > i)) x = -CUDART_INF_F;
        }
        s[mt][nt][e] = x;
      }
    }
  }
}

// Online softmax in FP32 on the thread's fragments; S becomes P in place.
template <int D>
__device__ __forceinline__ void online_softmax(Scores& s, RowState<D>& st) {
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's online-softmax TODO (Lines 10-13), once the teaching kernel's tests pass, for every version of this lesson: this thread holds two rows of every m16 tile (rows lane/4 and lane/4 + 8), whose columns are spread over the 4 lanes with the same lane/4 (a row's max needs all four); natural-log units (expf), and st.l stays the lane's partial sum (README: Versions)
  // m_new = max(m, rowmax(S)), P = e^(S - m_new), l = e^(m - m_new) l + rowsum(P),
  // O = e^(m - m_new) O. A row with no visible key so far keeps m = -inf; it subtracts 0 instead,
  // so P = 0 and the rescale factor is 0, never NaN.
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float row_max = -CUDART_INF_F;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) row_max = fmaxf(row_max, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
      // The four lanes lane/4 == g share row g: reduce across them.
      row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, 1));
      row_max = fmaxf(row_max, __shfl_xor_sync(course::kFullMask, row_max, 2));
      const float m_new = fmaxf(st.m[mt][r], row_max);
      const float m_ref = m_new == -CUDART_INF_F ? 0.0f : m_new;
      const float rescale = expf(st.m[mt][r] - m_ref);
      st.m[mt][r] = m_new;
      float p_sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
        s[mt][nt][2 * r] = expf(s[mt][nt][2 * r] - m_ref);
        s[mt][nt][2 * r + 1] = expf(s[mt][nt][2 * r + 1] - m_ref);
        p_sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
      }
      st.l[mt][r] = st.l[mt][r] * rescale + p_sum;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        st.o[mt][dn][2 * r] *= rescale;
        st.o[mt][dn][2 * r + 1] *= rescale;
      }
    }
  }
  // END SOLUTION
}

// P of keys 16kk..16kk+15, rounded to T, as the A fragments of P V: the C fragments of S tiles
// 2kk and 2kk + 1 are exactly that A fragment.
template <typename T>
__device__ __forceinline__ void p_fragments(const Scores& s, int kk, uint32_t (&pa)[kM][4]) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
    pa[mt][0] = tc::pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
    pa[mt][1] = tc::pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
    pa[mt][2] = tc::pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
    pa[mt][3] = tc::pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
  }
}

// O / l rounded to T, staged in this warp's own rows of sQ (only this warp ever read them), then
// stored as 16-byte rows; rows past Sq are never stored.
template <typename T, int D, class Layout>
__device__ __forceinline__ void store_output(const RowState<D>& st, T* sQ, T* O, int q0, int Sq) {
  const int warp = static_cast<int>(threadIdx.x) / course::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % course::kWarpSize;
  const int warp_row0 = warp * kWarpRows;
  // BEGIN SOLUTION: Port of ../fp32/fused_teaching.cu's Line 15 TODO, once the teaching kernel's tests pass, for this thread's two rows of each m16 tile: the 4 lanes' partial sums of a row added, then O / l (zeros when l = 0) rounded to T into this warp's own rows of sQ at Layout::offset (README: Versions)
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l_row = st.l[mt][r];
      l_row += __shfl_xor_sync(course::kFullMask, l_row, 1);
      l_row += __shfl_xor_sync(course::kFullMask, l_row, 2);
      const float inv_l = l_row > 0.0f ? 1.0f / l_row : 0.0f;
      const int row = warp_row0 + mt * 16 + (lane >> 2) + r * 8;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        *reinterpret_cast<uint32_t*>(sQ + Layout::offset(row, dn * 8 + (lane & 3) * 2)) =
            tc::pack2<T>(st.o[mt][dn][2 * r] * inv_l, st.o[mt][dn][2 * r + 1] * inv_l);
      }
    }
  }
  // END SOLUTION
  __syncwarp();
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int n = 0; n < kWarpRows * kChunks / course::kWarpSize; ++n) {
    const int idx = n * course::kWarpSize + lane;
    const int row = warp_row0 + idx / kChunks;
    const int col = (idx % kChunks) * 8;
    if (q0 + row < Sq)
      *reinterpret_cast<uint4*>(O + static_cast<int64_t>(q0 + row) * D + col) =
          *reinterpret_cast<const uint4*>(sQ + Layout::offset(row, col));
  }
}

// Launch version V: V<T, D>::kKernel with V<T, D>::kSmem bytes of dynamic shared memory, one
// block per Br query rows of each (batch, head).
template <template <typename, int> class V>
void launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, bool causal, float scale,
            cudaStream_t stream) {
  const Params p{q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), static_cast<int>(q.size(1)),
                 static_cast<int>(q.size(2)), static_cast<int>(k.size(2)), scale, causal};
  const dim3 grid(course::ceil_div(p.Sq, kBr), p.H, static_cast<unsigned>(q.size(0)));
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TORCH_CHECK(major >= 8, "the tensor-core attention versions need compute capability 8.0 or newer "
              "(mma.sync m16n8k16, ldmatrix, cp.async); this GPU has ", major, ".x");
  const auto run = [&](auto instance) {
    using Instance = decltype(instance);
    static_assert(2 * Instance::kSmem <= 227 * 1024, "two blocks per SM must fit in 227 KB of shared memory");
    course::opt_in_shared_memory<Instance::kKernel>(device, static_cast<int>(Instance::kSmem));
    Instance::kKernel<<<grid, kThreads, Instance::kSmem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const int D = static_cast<int>(q.size(3));
  TORCH_CHECK(D == 64 || D == 128, "head dim D=", D, " (q.size(3)) is not supported by the versions: use 64 or 128");
  if (q.scalar_type() == at::kBFloat16) {
    D == 64 ? run(V<__nv_bfloat16, 64>{}) : run(V<__nv_bfloat16, 128>{});
  } else {
    D == 64 ? run(V<__half, 64>{}) : run(V<__half, 128>{});
  }
}

}  // namespace tc_versions
