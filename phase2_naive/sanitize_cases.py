"""Every phase 2 kernel once on small awkward sizes, checked; run under compute-sanitizer by
`python -m utils.sanitize phase2_naive` (memcheck and racecheck)."""

import torch

import phase2_naive as ph
from utils import reference
from utils.testing import assert_close, random_additive_mask, random_bool_mask, random_qkv, randn


def main() -> None:
    B, H, Sq, Sk, D = 2, 3, 17, 29, 80  # no size a multiple of a warp or block
    q, k, v = random_qkv(B, H, Sq, Sk, D)
    s = ph.matmul_qk(q, k)
    assert_close(s, (q.double() @ k.double().transpose(-1, -2)) / D**0.5, what="matmul_qk")
    bool_mask = random_bool_mask((B, 1, Sq, Sk))
    bias = reference.attention_bias(B, H, Sq, Sk, bool_mask, True, device=s.device)
    assert_close(ph.softmax(s, mask=bool_mask, is_causal=True), reference.softmax(s.double() + bias),
                 what="softmax")
    p = torch.softmax(randn(B, H, Sq, Sk), dim=-1)
    assert_close(ph.matmul_av(p, v), p.double() @ v.double(), what="matmul_av")
    additive = random_additive_mask((Sq, Sk))
    assert_close(ph.attention(q, k, v, mask=additive), reference.attention(q, k, v, mask=additive),
                 what="attention, additive mask")
    q1, k1, v1 = random_qkv(1, 1, 1, 1, 32)
    assert_close(ph.attention(q1, k1, v1, is_causal=True), reference.attention(q1, k1, v1, is_causal=True),
                 what="attention S=1")
    torch.cuda.synchronize()
    print("phase2_naive sanitize cases: ok")


if __name__ == "__main__":
    main()
