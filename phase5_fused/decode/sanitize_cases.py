"""Every instantiation of the decoding kernels (split kernel x dtype x D x contiguous / paged x,
on tensor cores, each ring of TENSOR_CORE_STAGES that fits the GPU; one split, and several merged in
the split kernel and by the merge kernel), once, on
small awkward sizes, checked against the float64 reference; run under compute-sanitizer by
`python -m utils.sanitize phase5_fused.decode` (memcheck + racecheck).

Sizes: ragged lengths (Sq, a tail inside a tile, a tile edge plus one, a longer one whose single
split wraps every kernel's ring of stages at least once: 5 tiles at D = 64), a cache with
spare capacity, pages shuffled with free pages, GQA with 3 query heads per KV head and Sq = 5
(15 rows: one short block), more splits than some sequences have tiles (empty splits; 40 splits
are more than the merge's eight warps load in one round), and a bad length and a bad page entry
(the NaN path: nothing may be read out of bounds there either).
"""

from __future__ import annotations

import sys

import torch

from phase5_fused import decode
from phase5_fused.decode.test_decode import TOL, make_case
from utils import reference
from utils.testing import assert_close


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to sanitize")
        return 0
    Sq, lengths = 5, [5, 70, 129, 520]
    cases = 0
    device_smem = decode.smem_per_block(torch.cuda.current_device())
    for dtype in decode.DTYPES:
        for D in decode.SUPPORTED_D:
            rings = [("cuda_cores", decode.CUDA_CORE_STAGES)]
            if decode.choose_kernel(dtype, D) == "tensor_cores":
                rings += [("tensor_cores", s) for s in decode.TENSOR_CORE_STAGES
                          if decode.tensor_core_smem_bytes(s) <= device_smem]
            for page_size in (None, 16):
                q, k, v, n, table, info = make_case(lengths, 6, 2, Sq, D, dtype, page_size, spare=40)
                ref = reference.decode_attention(q, k, v, n, page_table=table)
                for kernel, stages in rings:
                    # (splits, fused_merge); 40 splits: the merge's warps each take several rounds
                    for splits, fused in ((1, True), (3, True), (40, True), (40, False)):
                        out = decode.attention(q, k, v, n, page_table=table, num_splits=splits, kernel=kernel,
                                               stages=stages, fused_merge=fused)
                        assert_close(out, ref, dtype=dtype, rel_tol=TOL[dtype],
                                     seed_info=f"{info} {kernel} stages={stages} splits={splits} fused={fused}")
                        cases += 1
    # The NaN path: a length past the capacity, a page entry past the cache.
    q, k, v, n, table, info = make_case(lengths, 6, 2, Sq, 64, torch.float16, 16, spare=40)
    n[1] = table.shape[1] * 16 + 1
    table[3, 2] = k.shape[0]
    for kernel in decode.KERNELS:
        for splits, fused in ((1, True), (3, True), (3, False)):
            out = decode.attention(q, k, v, n, page_table=table, num_splits=splits, kernel=kernel, fused_merge=fused)
            assert out[1].isnan().all() and out[3].isnan().all() and not out[[0, 2]].isnan().any(), info
            cases += 1
    torch.cuda.synchronize()
    print(f"decoding attention: {cases} kernel launches correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
