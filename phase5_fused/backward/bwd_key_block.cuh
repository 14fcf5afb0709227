// What one thread block of a key-block backward kernel (bwd_tc.cu, bwd_tf32x3.cu) works on: block x
// takes key block x % n_kblocks of head x / n_kblocks (a head's key blocks run side by side, so the
// Q, dO and dQ rows they all read and add to stay in L2: FlashAttention-2's order), and the query
// blocks of kBr rows that see its keys: from the diagonal on (causal) to the last row whose window
// reaches the block (a sliding window), none for a block of padding keys. With grouped-query heads
// the block reads the K/V rows of its query head's K/V head and writes dK, dV per query head (the
// op sums each group).
#pragma once

#include <cstdint>

#include "bwd.h"
#include "common.cuh"

namespace phase5_bwd {

// T: the inputs' element type.
template <typename T>
struct KeyBlock {
  int64_t bh, b, h;   // (batch, head) pair and its parts
  int64_t k0;         // first key of the block
  int64_t kv_len;     // valid keys of the batch (key padding)
  int64_t qb_first;   // first query block that sees a key of the block
  int64_t n_steps;    // query blocks to walk
  const T *Q, *dO;           // the head's rows
  const T *K, *V;            // its K/V head's rows (grouped-query attention: K/V head h / (H / H_kv))
  const float *lse, *delta;  // the head's L_i and D_i
  float* dQ;                 // the head's FP32 dQ accumulator
};

// row_len: the elements of a row of q, k, v, dout and dQ (the head dim; rows are contiguous).
template <typename T, int kBc, int kBr>
__device__ __forceinline__ KeyBlock<T> key_block(const BwdParams& p, int row_len) {
  KeyBlock<T> w;
  const int64_t n_kblocks = course::ceil_div<int64_t>(p.Sk, kBc);
  w.bh = blockIdx.x / n_kblocks;
  w.k0 = static_cast<int64_t>(blockIdx.x % n_kblocks) * kBc;
  w.b = w.bh / p.H;
  w.h = w.bh % p.H;
  w.kv_len = p.key_lengths != nullptr ? p.key_lengths[w.b] : p.Sk;
  w.qb_first = p.masking.causal ? w.k0 / kBr : 0;
  w.n_steps = w.k0 < w.kv_len ? course::ceil_div<int64_t>(query_rows_end(p, w.k0, kBc), kBr) - w.qb_first : 0;
  w.Q = static_cast<const T*>(p.q) + w.bh * p.Sq * row_len;
  const int64_t kv_rows = kv_pair(w.bh, p) * p.Sk * row_len;
  w.K = static_cast<const T*>(p.k) + kv_rows;
  w.V = static_cast<const T*>(p.v) + kv_rows;
  w.dO = static_cast<const T*>(p.dout) + w.bh * p.Sq * row_len;
  w.lse = p.lse + w.bh * p.Sq;
  w.delta = p.delta + w.bh * p.Sq;
  w.dQ = p.dq + w.bh * p.Sq * row_len;
  return w;
}

}  // namespace phase5_bwd
