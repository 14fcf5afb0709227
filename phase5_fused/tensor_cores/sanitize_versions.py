"""Every instance of the lesson's numbered versions (tc.VERSIONS other than "fast": version x dtype
x D in tc.VERSION_D), causal and not, once, at Sq = 77 and Sk = 130 (query and key blocks with
tails, Sq != Sk), checked against the float64 reference; run under compute-sanitizer by
`python -m utils.sanitize phase5_fused.tensor_cores` (memcheck + racecheck).
"""

from __future__ import annotations

import sys

import torch

from phase5_fused import tensor_cores as tc
from phase5_fused.tensor_cores.sanitize_cases import TOL
from utils import reference
from utils.testing import assert_close, poisoned_like, random_qkv


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to sanitize")
        return 0
    cases = 0
    for version in (name for name in tc.VERSIONS if name != tc.DEFAULT_VERSION):
        for dtype in (torch.float16, torch.bfloat16):
            for D in tc.VERSION_D:
                q, k, v = random_qkv(2, 3, 77, 130, D, dtype=dtype)
                for causal in (False, True):
                    out = poisoned_like(q)
                    tc.attention(q, k, v, is_causal=causal, out=out, version=version)
                    assert_close(out, reference.attention(q, k, v, is_causal=causal), dtype=dtype,
                                 rel_tol=TOL[dtype], what=f"version {version} {dtype} D={D} causal={causal}")
                    cases += 1
    torch.cuda.synchronize()
    print(f"tensor-core attention versions: {cases} kernel instances correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
