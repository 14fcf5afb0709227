// The merge of a tile cut along the keys into pieces (v7's split tail, v8's Stream-K tail): each
// piece ran the online softmax over its own key blocks; its epilogue writes O / l and
// lse2 = m + log2 l of each row to FP32 buffers and counts itself on the tile's arrival counter
// (one per consumer warpgroup: the 64 rows it owns). The piece that arrives last merges them all in
// piece order (the same sums whichever piece that is), as the decode lesson's merge does,
//   lse2 = log2 sum_s 2^lse2_s,   O = sum_s 2^(lse2_s - lse2) O_s,
// and stores the tile. No piece waits for another: whichever finishes last does the merge.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "hopper_pipeline.cuh"
#include "zeroed_counters.h"

namespace hopper {

// At most this many pieces per tile: the piece that merges reads every piece's rows.
constexpr int kMaxSplits = 8;

// The epilogue of piece `piece` of the `pieces` of cut tile `slot`, on one consumer warpgroup (64
// rows); the buffers hold p.split.splits pieces per tile. sO: the output staging (store_rows).
template <typename T, int D, class Tl>
__device__ __forceinline__ void merge_pieces(float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                             unsigned char* sO, int wg, const Params& p, const Block& b, int slot,
                                             int piece, int pieces) {
  constexpr int kConsumers = Tl::kConsumers;
  const SplitTail& st = p.split;
  const int tid = static_cast<int>(threadIdx.x % kWarpgroup);
  const int barrier = kEpilogueBarrier + wg;
  // A piece's rows in the buffers: this thread's fragment, float4 c of it at [c][tid], so that a warp
  // writes and reads 512 contiguous bytes at a time.
  auto o_of = [&](int s) {
    return reinterpret_cast<float4*>(st.partial_o) + ((slot * st.splits + s) * kConsumers + wg) * (D / 8) * kWarpgroup +
           tid;
  };
  auto lse_of = [&](int s) {
    return reinterpret_cast<float2*>(st.partial_lse) + ((slot * st.splits + s) * kConsumers + wg) * kWarpgroup + tid;
  };
  __shared__ int merges[kMaxConsumers];  // per warpgroup: this piece arrived last

  // 1. This piece's O / l and lse2, to its place in the buffers.
  float inv[2], lse2[2];
  finish_rows(m, l, inv, lse2);
#pragma unroll
  for (int c = 0; c < D / 8; ++c) {
    o[4 * c] *= inv[0];
    o[4 * c + 1] *= inv[0];
    o[4 * c + 2] *= inv[1];
    o[4 * c + 3] *= inv[1];
    o_of(piece)[c * kWarpgroup] = make_float4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
  }
  *lse_of(piece) = make_float2(lse2[0], lse2[1]);

  // 2. Count the piece once the warpgroup's writes are visible to the whole GPU; only the last
  //    piece of the tile goes on.
  __threadfence();
  named_barrier_sync(barrier, kWarpgroup);
  if (tid == 0) {
    int* arrivals = &st.arrivals[slot * kConsumers + wg];
    const bool last = atomicAdd(arrivals, 1) == pieces - 1;
    // Every piece has counted: leave the counter at zero for the next call (zeroed_counters.h).
    if (last) *arrivals = 0;
    merges[wg] = last;
  }
  named_barrier_sync(barrier, kWarpgroup);
  // merges[wg] is the same in every thread, but ptxas cannot know that of a shared-memory load: a
  // branch on it would leave the rest of a persistent loop (v8) possibly divergent, and ptxas would
  // move the ring's stage arithmetic out of the uniform datapath (an R2UR before every wgmma). A
  // warp vote's result is the same in every lane by construction.
  if (!__any_sync(0xffffffffu, merges[wg])) return;
  __threadfence();

  // 3. Merge every piece, this one's too, in piece order from the buffers (L2 reads: __ldcg), so
  //    that the result does not depend on which piece finished last. All the pieces' lse2 first,
  //    then their rows: no load waits for the arithmetic on an earlier one.
  // BEGIN SOLUTION: Port of ../decode/decode_merge.cu's merge TODO as step 3 here, once the decode lesson's tests pass: read every piece's lse2_s (float2 at lse_of(s): rows g and g + 8) with __ldcg; per row lse2 = log2 sum_s 2^lse2_s (-inf when every piece's is -inf: no visible key); then o = sum over s = 0 .. pieces - 1 in order of 2^(lse2_s - lse2) O_s, O_s being the D / 8 float4 at o_of(s)[c * kWarpgroup] (read with __ldcg), and o = 0 for a row with lse2 = -inf (README: v7)
  float lse_s[kMaxSplits][2];
  float top[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s < pieces) {
      const float2 x = __ldcg(lse_of(s));
      lse_s[s][0] = x.x;
      lse_s[s][1] = x.y;
      top[0] = fmaxf(top[0], x.x);
      top[1] = fmaxf(top[1], x.y);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      if (s < pieces && top[h] != -CUDART_INF_F) sum += exp2f(lse_s[s][h] - top[h]);
    }
    lse2[h] = top[h] == -CUDART_INF_F ? top[h] : top[h] + log2f(sum);
  }
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s < pieces) {
      const float w0 = lse2[0] == -CUDART_INF_F ? 0.0f : exp2f(lse_s[s][0] - lse2[0]);
      const float w1 = lse2[1] == -CUDART_INF_F ? 0.0f : exp2f(lse_s[s][1] - lse2[1]);
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const float4 x = __ldcg(o_of(s) + c * kWarpgroup);
        o[4 * c] += w0 * x.x;
        o[4 * c + 1] += w0 * x.y;
        o[4 * c + 2] += w1 * x.z;
        o[4 * c + 3] += w1 * x.w;
      }
    }
  }
  // END SOLUTION

  // 4. The merged rows, already divided by their l, stored as every tile's are.
  const float one[2] = {1.0f, 1.0f};
  store_rows<T, D, Tl>(o, one, lse2, sO, wg, p, b, barrier);
}

// The host's side: the FP32 buffers of `cut_tiles` cut tiles of at most `pieces` pieces each (freed
// in stream order once the call's kernel ran) and their arrival counters, which every call leaves
// at zero (utils/csrc/zeroed_counters.h: no memset per call). split() gives the kernel's view.
struct MergeBuffers {
  at::Tensor partials;  // every piece's O / l, then every piece's lse2
  at::Tensor arrivals;
  int64_t o_floats;

  MergeBuffers(int64_t cut_tiles, int pieces, int consumers, int D, cudaStream_t stream) {
    const int64_t slots = cut_tiles * pieces * consumers;
    o_floats = slots * 64 * D;
    const int device = at::cuda::current_device();
    partials = at::empty({o_floats + slots * kWarpgroup * 2},
                         at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device));
    arrivals = course::zeroed_counters(cut_tiles * consumers, device, stream);
  }
  SplitTail split(int64_t whole_tiles, int pieces) const {
    return SplitTail{static_cast<int>(whole_tiles), pieces, partials.data_ptr<float>(),
                     partials.data_ptr<float>() + o_floats, arrivals.data_ptr<int>()};
  }
};

}  // namespace hopper
