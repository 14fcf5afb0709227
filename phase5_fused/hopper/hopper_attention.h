// Host interface of the Hopper attention kernels (forward: hopper_v1_wgmma_tma.cu,
// hopper_v2_warp_specialized.cu, hopper_v3_intra_overlap.cu, hopper_v4_pingpong.cu,
// hopper_v5_tiles.cu, hopper_v6_persistent.cu, hopper_v7_split_tail.cu, hopper_v8_stream_k.cu;
// backward: hopper_bwd.cu),
// called by hopper_ops.cpp.
// Plain C++: no device code, so the .cpp can include it.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace hopper {

// Head dims with compiled kernels: a K/V row is one or two 128-byte swizzle panels (README: Why D = 64 and 128).
inline bool supported_head_dim(int64_t d) { return d == 64 || d == 128; }

// The work of v7 and v8 beyond whole tiles (hopper_v7_split_tail.cu, hopper_v8_stream_k.cu): the
// last tiles of the grid, each cut into pieces along the keys, whose partial results meet in FP32
// buffers (hopper_merge.cuh). launch_v7 and launch_v8 fill it; the other versions ignore it.
struct SplitTail {
  int whole_tiles;     // the tiles before the cut ones, in v5's grid order (v7: one CTA each; v8: whole rounds)
  int splits;          // v7: pieces of each cut tile; v8: the most pieces of a cut tile (the buffers' stride)
  float* partial_o;    // [split tiles, splits, consumers, D / 8, 128] float4: a piece's O / l, by fragment
  float* partial_lse;  // [split tiles, splits, consumers, 128] float2: its rows' log2-sum-exp
  int* arrivals;       // [split tiles, consumers] pieces of the tile finished, per warpgroup: zero at the
                       // start, and the last piece resets its counter (zeroed_counters.h)
};

// The kernels' arguments. q, k, v are seen by TMA as 4-D tensors (D, S, heads, B) with their own
// strides (D contiguous; [B, H, S, D] or a view of [B, S, H, D], of a packed qkv, ...): the box of a
// tile is 64 columns (one 128-byte swizzle panel) x Rows rows x 1 head x 1 batch, so rows past S of
// one head are zero-filled instead of read from the next head.
struct Params {
  CUtensorMap q_map;          // box 64 x tile rows x 1 x 1
  CUtensorMap k_map;          // box 64 x tile keys x 1 x 1
  CUtensorMap v_map;          // box 64 x tile keys x 1 x 1
  void* o;                    // [B, H, Sq, D], q's dtype, D contiguous
  int64_t o_stride_b, o_stride_h, o_stride_s;  // o's strides in elements
  float* lse;                 // [B, H, Sq] natural-log logsumexp, or nullptr
  const int* key_lengths;     // [B] clamped to [0, Sk], or nullptr (every key valid)
  int B, H, Sq, Sk;
  int H_kv;                   // K/V heads: query head h reads K/V head h / (H / H_kv)
  float scale_log2;           // c = scale * log2(e) > 0: exp(scale x) = 2^(c x)
  int causal;                 // query i sees keys j <= i (top-left aligned)
  SplitTail split;            // v7 and v8 only
  int section_pairs;          // v6, causal: (head, batch) pairs per section of its schedule
};

// A CTA's tile, shared by the host (tensor-map boxes, grid) and the kernels: `rows` query rows (64
// per consumer warpgroup) and `keys` keys per K/V block. v1-v4 use kBaseTile at both head dims; v5
// to v7 give D = 64 three consumer warpgroups (README: v5).
struct TileSize {
  int rows;
  int keys;
};
constexpr TileSize kBaseTile{128, 128};
constexpr TileSize tile_size(int version, int d) {
  return version >= 5 && d == 64 ? TileSize{192, 128} : kBaseTile;
}

enum class Dtype { kFloat16, kBFloat16 };

// The versions, hopper_v1_*.cu .. hopper_v8_*.cu (the op's `version` argument; __init__.py's VERSIONS
// names them in order).
constexpr int kVersions = 8;

// Launch one version on `stream` (checks the launch). D in {64, 128}; p's maps built for
// tile_size(version, D).
void launch_v1(const Params& p, int D, Dtype dtype, cudaStream_t stream);
void launch_v2(const Params& p, int D, Dtype dtype, cudaStream_t stream);
void launch_v3(const Params& p, int D, Dtype dtype, cudaStream_t stream);
void launch_v4(const Params& p, int D, Dtype dtype, cudaStream_t stream);
void launch_v5(const Params& p, int D, Dtype dtype, cudaStream_t stream);
void launch_v6(const Params& p, int D, Dtype dtype, cudaStream_t stream);
void launch_v7(const Params& p, int D, Dtype dtype, cudaStream_t stream);
void launch_v8(const Params& p, int D, Dtype dtype, cudaStream_t stream);

// The backward's arguments (hopper_bwd.cu). q and dO [B, H, Sq, D], k and v [B, H_kv, Sk, D] (H a
// multiple of H_kv: query head h reads K/V head h / (H / H_kv)), seen by TMA as the forward's are:
// boxes of 64 columns x kBwdBr (q, dO) or kBwdBc (k, v) rows.
struct BwdParams {
  CUtensorMap q_map, k_map, v_map, do_map;
  const float* lse;         // [B, H, Sq] the forward's natural-log logsumexp
  const float* delta;       // [B, H, Sq] D_i = rowsum(dO_i * O_i) - dlse_i (../backward/bwd_preprocess.cu)
  float* dq_accum;          // [B * H, n_qblocks, kBwdBr * D] FP32, zeroed, in fragment order (hopper_bwd.cu)
  void* dk;                 // [B, H_kv, Sk, D] q's dtype
  void* dv;
  const int* key_lengths;   // [B] clamped to [0, Sk], or nullptr
  int B, H, H_kv, Sq, Sk, n_qblocks;
  float scale;
  int causal;
};

// The backward's tiles: kBwdBc keys per CTA (two warpgroups of 64), kBwdBr query rows per step.
constexpr int kBwdBr = 64;
constexpr int kBwdBc = 128;
// The variant autograd runs (hopper_autograd.cpp; __init__.py's BWD_DEFAULT_VARIANT): the faster in
// the backward lesson's variants table, at both head dims.
constexpr int kBwdDefaultVariant = 1;

// dk, dv and the dQ accumulator of one backward call; then dq = scale * accumulator in q's dtype.
// variant (hopper_bwd.cu): 0 dQ by keys, 1 dQ by columns.
void launch_backward(const BwdParams& p, int D, int variant, Dtype dtype, cudaStream_t stream);
void launch_dq_convert(const float* accum, void* dq, int64_t BH, int Sq, int D, int variant, int n_qblocks,
                       float scale, Dtype dtype, cudaStream_t stream);

}  // namespace hopper
