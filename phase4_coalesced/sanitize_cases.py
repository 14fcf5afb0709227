"""Every phase-4 kernel once on small awkward sizes, checked, for compute-sanitizer
(`python -m utils.sanitize phase4_coalesced` runs memcheck and racecheck on this module).

Covers: the float4 and the scalar matmul paths (D or Sk not a multiple of 4), both AV tile widths
(D <= 64 and D > 64), tails in every dimension, causal tile skipping, Sq != Sk, every softmax
version (warp per row, block per row, the streaming one for Sk > 32768), bool and additive masks.
"""

from __future__ import annotations

import torch

import phase4_coalesced as p4
from utils import reference
from utils.testing import assert_close, random_additive_mask, random_bool_mask, random_qkv, randn


def main() -> None:
    # (B, H, Sq, Sk, D, causal, mask kind)
    cases = [
        (1, 2, 17, 17, 64, True, None),         # float4 path would need Sk % 4 == 0: scalar
        (2, 1, 17, 20, 80, False, "bool"),      # float4, AV 128-wide tiles, Sq != Sk
        (1, 1, 130, 129, 3, True, "additive"),  # scalar everything, 2 row tiles, causal skip
        (1, 1, 200, 132, 64, True, None),       # float4, Sq > Sk, causal
    ]
    for B, H, Sq, Sk, D, causal, kind in cases:
        q, k, v = random_qkv(B, H, Sq, Sk, D)
        mask = {None: None, "bool": random_bool_mask((B, H, Sq, Sk)),
                "additive": random_additive_mask((Sq, Sk))}[kind]
        what = f"attention B={B} H={H} Sq={Sq} Sk={Sk} D={D} causal={causal} mask={kind}"
        assert_close(p4.attention(q, k, v, mask=mask, is_causal=causal),
                     reference.attention(q, k, v, mask=mask, is_causal=causal), what=what)
        assert_close(p4.matmul_qk(q, k), (q.double() @ k.double().transpose(-1, -2)) / D**0.5,
                     what="matmul_qk " + what)
        p = torch.softmax(randn(B, H, Sq, Sk), dim=-1)
        assert_close(p4.matmul_av(p, v), p.double() @ v.double(), what="matmul_av " + what)
    # The softmax versions: warp per row (Sk <= 1024), block per row, streaming (Sk > 32768).
    for Sk in (17, 1000, 3001, 33000):
        s = randn(1, 1, 2, Sk)
        bias = reference.attention_bias(1, 1, 2, Sk, is_causal=True, device="cuda")
        assert_close(p4.softmax(s, is_causal=True), reference.softmax(s.double() + bias),
                     what=f"softmax Sk={Sk}")
    torch.cuda.synchronize()
    print("phase4_coalesced sanitize cases: all kernels ran and matched the reference")


if __name__ == "__main__":
    main()
