"""Every instantiation of the tensor-core kernel, once, on small awkward sizes, checked against the
float64 reference; run under compute-sanitizer by `python -m utils.sanitize phase5_fused.tensor_cores`
(memcheck + racecheck).

Head dims: per tile head dim Dp (tc.TILE_D) a padded D = Dp - 16 (80 on Dp = 96, the common one)
and the unpadded D = Dp (256 the largest): every instance. Sizes: Sq = 17 and Sk = 70 (neither a
multiple of any tile, Sq != Sk), one batch with a key length inside a block and one with none,
causal, non-causal (where Bc <= 64 the first key block of the full batch runs the copy of the step
without mask code), and the mask path with a fully masked row. Then the window instances (with and without a
mask) once each per D, grouped-query (H = 4 over H_kv = 2) at Sq = 300, Sk = 270, so that query
blocks start past their first key blocks. The lesson's numbered versions: sanitize_versions.py.
"""

from __future__ import annotations

import sys

import torch

from phase5_fused import tensor_cores as tc
from utils import reference
from utils.testing import assert_close, poisoned_like, random_bool_mask, random_qkv

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
HEAD_DIMS = tuple(d for dp in tc.TILE_D for d in (dp - 16, dp))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to sanitize")
        return 0
    B, H, Sq, Sk = 3, 2, 17, 70
    lengths = torch.tensor([Sk, 33, 0], device="cuda", dtype=torch.int32)
    # The window instances: grouped-query heads, query blocks that start past their first key blocks.
    H_w, H_kv, Sq_w, Sk_w, window = 4, 2, 300, 270, 40
    lengths_w = torch.tensor([Sk_w, 150, 0], device="cuda", dtype=torch.int32)
    cases = 0
    for dtype in (torch.float16, torch.bfloat16):
        for D in HEAD_DIMS:
            q, k, v = random_qkv(B, H, Sq, Sk, D, dtype=dtype)
            mask = random_bool_mask((B, 1, Sq, Sk))
            mask[:, :, 3] = False
            for m, causal in ((None, True), (None, False), (mask, False)):
                out = poisoned_like(q)
                tc.attention(q, k, v, mask=m, is_causal=causal, key_lengths=lengths, out=out)
                ref = reference.attention(q, k, v, mask=m, is_causal=causal, key_lengths=lengths)
                assert_close(out, ref, dtype=dtype, rel_tol=TOL[dtype],
                             what=f"{dtype} D={D} causal={causal} mask={m is not None}")
                cases += 1
            q, k, v = random_qkv(B, H_w, Sq_w, Sk_w, D, dtype=dtype, H_kv=H_kv)
            for m in (None, random_bool_mask((B, 1, Sq_w, Sk_w))):
                out = poisoned_like(q)
                tc.attention(q, k, v, mask=m, is_causal=True, key_lengths=lengths_w, window=window, out=out)
                ref = reference.attention(q, k, v, mask=m, is_causal=True, key_lengths=lengths_w, window=window)
                assert_close(out, ref, dtype=dtype, rel_tol=TOL[dtype],
                             what=f"{dtype} D={D} GQA window={window} mask={m is not None}")
                cases += 1
    torch.cuda.synchronize()
    print(f"tensor-core attention: {cases} kernel instantiations correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
