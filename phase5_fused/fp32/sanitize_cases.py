"""Every version of phase 5's FP32 fused kernel (fp32.KERNELS) once on small awkward sizes, checked
against the float64 reference; run under compute-sanitizer by `python -m utils.sanitize
phase5_fused.fp32` (memcheck + racecheck).

Sizes, for every version: S=17 (no tile multiple), Sq != Sk both ways, Sk below one key tile, masks,
causal, stride, key padding, every D (each version's template instance per D), a row with every key
hidden; then every fast-kernel tile variant, and one grouped-query (H=4 over H_kv=2) sliding-window
call of the fast kernel (its window instance) with padding and stride; then each padded tile width
of the fast kernel at a D 8 below it (zero-filled columns), plain and in its window instance.
"""

from __future__ import annotations

import torch

from phase5_fused import fp32
from utils import reference
from utils.testing import assert_close, random_additive_mask, random_bool_mask, random_qkv


def case(kernel, B, H, Sq, Sk, D, H_kv=None, **kw):
    q, k, v = random_qkv(B, H, Sq, Sk, D, H_kv=H_kv)
    out, lse = fp32.attention(q, k, v, kernel=kernel, return_lse=True, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True,
                                       **{n: x for n, x in kw.items() if n != "variant"})
    assert_close(out, ref, dtype=torch.float32, what=f"{kernel} {Sq}x{Sk} D={D} {sorted(kw)}")
    assert_close(lse, ref_lse, dtype=torch.float32, what=f"{kernel} lse")


def main() -> None:
    for kernel in fp32.KERNELS:
        case(kernel, 1, 2, 17, 17, 64)
        case(kernel, 1, 2, 17, 70, 64, is_causal=True)
        case(kernel, 1, 2, 70, 17, 64, is_causal=True)
        case(kernel, 2, 1, 33, 45, 32, mask=random_bool_mask((2, 1, 33, 45)))
        case(kernel, 1, 2, 40, 19, 80, mask=random_additive_mask((40, 19)), is_causal=True)
        case(kernel, 1, 1, 65, 130, 96, stride=3, is_causal=True)
        case(kernel, 2, 1, 17, 90, 128, stride=2,
             key_lengths=torch.tensor([0, 61], dtype=torch.int64, device="cuda"))
    for D, tiles in fp32.FAST_TILES.items():
        for variant in range(len(tiles)):
            case("fast", 1, 1, 70, 131, D, variant=variant, is_causal=True)
    case("fast", 2, 4, 150, 130, 64, H_kv=2, is_causal=True, window=37, stride=2,
         key_lengths=torch.tensor([100, 0], dtype=torch.int32, device="cuda"))
    for width in fp32.PADDED_TILE_D:
        case("fast", 1, 1, 70, 131, width - 8, is_causal=True)
        case("fast", 2, 4, 77, 130, width - 8, H_kv=2, is_causal=True, window=37, stride=2,
             mask=random_additive_mask((77, 130)), key_lengths=torch.tensor([100, 0], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    print("phase5_fused.fp32 sanitize cases: ok")


if __name__ == "__main__":
    main()
