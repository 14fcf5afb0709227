"""Every kernel version once, on small awkward sizes, checked for correctness.

Run by `python -m utils.sanitize phase6_layernorm_mlp` under compute-sanitizer memcheck and
racecheck: unaligned views, tails of every tile, each LayerNorm version (warp, block, streaming),
every GEMM epilogue on both load paths.
"""

from __future__ import annotations

import torch

import phase6_layernorm_mlp as p6
from utils import reference
from utils.testing import assert_close, randn


def unaligned(*shape, dtype=torch.float32):
    n = 1
    for s in shape:
        n *= s
    return randn(n + 1, dtype=dtype)[1:].view(*shape)


def main() -> None:
    torch.manual_seed(0)
    # LayerNorm: warp-per-row (scalar and vector), block-per-row, streaming; each dtype; +residual.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, hidden in ((5, 7), (3, 512), (2, 1000), (2, 4096), (2, 2049), (1, 20000)):
            for make in (randn, unaligned):
                x, r = make(rows, hidden, dtype=dtype), make(rows, hidden, dtype=dtype)
                w, b = randn(hidden, dtype=dtype), randn(hidden, dtype=dtype)
                assert_close(p6.layer_norm(x, w, b), reference.layer_norm(x, w, b), what="layer_norm")
                out, total = p6.add_layer_norm(x, r, w, b)
                assert_close(out, reference.layer_norm(x, w, b, residual=r), what="add_layer_norm")
                assert_close(total, x.double() + r.double(), what="sum")
        # GELU: vector body + tail, and the scalar path.
        for approximate in ("tanh", "none"):
            for x in (randn(1037, dtype=dtype), unaligned(67, dtype=dtype)):
                assert_close(p6.gelu(x, approximate), reference.gelu(x, approximate), what="gelu")
    # Linear: vector path with M/N tails, scalar path with every tail, each epilogue, each tile.
    for M, K, N, make in ((130, 64, 132, randn), (37, 29, 45, randn), (33, 64, 64, unaligned)):
        x, w, b, res = make(M, K), randn(N, K, scale=K ** -0.5), randn(N), randn(M, N)
        for act in (None, "gelu_tanh", "gelu"):
            ref = x.double() @ w.double().t() + b.double()
            if act is not None:
                ref = reference.gelu(ref, "tanh" if act == "gelu_tanh" else "none")
            for variant in range(len(p6.LINEAR_TILES)):
                out = p6.linear(x, w, b, act, res, variant=variant)
                assert_close(out, ref + res.double(), what=f"linear {act} variant {variant}")
    # MLP: tokens and widths off every tile.
    x, res = randn(77, 61), randn(77, 61)
    w1, b1 = randn(250, 61, scale=61 ** -0.5), randn(250)
    w2, b2 = randn(61, 250, scale=250 ** -0.5), randn(61)
    assert_close(p6.mlp(x, w1, b1, w2, b2, res), reference.mlp(x, w1, b1, w2, b2, res), what="mlp")
    torch.cuda.synchronize()
    print("phase6 sanitize cases: all correct")


if __name__ == "__main__":
    main()
