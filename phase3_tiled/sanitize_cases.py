"""Every phase 3 kernel once on small awkward sizes, checked; run under compute-sanitizer by
`python -m utils.sanitize phase3_tiled` (memcheck and racecheck)."""

import torch

import phase3_tiled as ph
from utils import reference
from utils.testing import assert_close, random_additive_mask, random_bool_mask, random_qkv, randn


def main() -> None:
    for tile in ph.TILES:
        check(tile)
    torch.cuda.synchronize()
    print("phase3_tiled sanitize cases: ok")


def check(tile: int) -> None:
    B, H, Sq, Sk, D = 2, 3, 17, 29, 36  # no size a multiple of a warp or of any tile
    q, k, v = random_qkv(B, H, Sq, Sk, D)
    s = ph.matmul_qk(q, k, tile=tile)
    assert_close(s, (q.double() @ k.double().transpose(-1, -2)) / D**0.5, what="matmul_qk")
    bool_mask = random_bool_mask((B, 1, Sq, Sk))
    bias = reference.attention_bias(B, H, Sq, Sk, bool_mask, True, device=s.device)
    assert_close(ph.softmax(s, mask=bool_mask, is_causal=True), reference.softmax(s.double() + bias),
                 what="softmax")
    p = torch.softmax(randn(B, H, Sq, Sk), dim=-1)
    assert_close(ph.matmul_av(p, v, tile=tile), p.double() @ v.double(), what="matmul_av")
    additive = random_additive_mask((Sq, Sk))
    assert_close(ph.attention(q, k, v, mask=additive, tile=tile), reference.attention(q, k, v, mask=additive),
                 what="attention, additive mask")
    q1, k1, v1 = random_qkv(1, 1, 1, 1, 32)
    assert_close(ph.attention(q1, k1, v1, is_causal=True, tile=tile), reference.attention(q1, k1, v1, is_causal=True),
                 what="attention S=1")


if __name__ == "__main__":
    main()
