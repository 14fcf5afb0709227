"""Every kernel version once, on small awkward sizes, checked for correctness.

Run by `python -m utils.sanitize phase6_layernorm_mlp` under compute-sanitizer memcheck and
racecheck: unaligned views, tails of every tile, each LayerNorm version (warp, block, streaming),
every GEMM epilogue on both load paths, split-K, the few-rows kernel and the 3xTF32 tensor-core
one; the backward kernels (each LayerNorm backward version with its column-sum reduction, GELU
backward) and the autograd of linear and the MLP.
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
    # (200, 515, 131) and (70, 1024, 260) split K over the blocks of the tiled kernels.
    for M, K, N, make in ((130, 64, 132, randn), (37, 29, 45, randn), (33, 64, 64, unaligned),
                          (200, 515, 131, randn), (70, 1024, 260, randn)):
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
    backward_cases()
    torch.cuda.synchronize()
    print("phase6 sanitize cases: all correct")


def _grad64(fn, *tensors, dy):
    """float64 autograd through a utils.reference function, on the CPU (no kernel launches for the
    sanitizer to slow down): the gradient of each tensor."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in tensors]
    fn(*leaves).backward(dy.cpu().double())
    return [t.grad for t in leaves]


def backward_cases() -> None:
    # LayerNorm backward: warp (7, 512), block (1000, 1536, 8192), streaming (8200, 20000); rows
    # below and above the number of teams (700 rows: blocks of several teams, five of 1536's
    # three-warp teams, an odd count for the tree); each dtype, aligned and not, with dsum and gamma.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, hidden in ((5, 7), (3, 512), (2, 1000), (700, 1000), (700, 1536), (2, 8192), (2, 8200), (1, 20000),
                             (2500, 64)):
            for make in (randn, unaligned):
                s, dy, dsum = make(rows, hidden, dtype=dtype), make(rows, hidden, dtype=dtype), make(rows, hidden, dtype=dtype)
                w = randn(hidden, dtype=dtype)
                ds, dw, db = p6.layer_norm_backward(dy, s, w, dsum=dsum)
                ref_ds, ref_dw = _grad64(lambda a, g: reference.layer_norm(a, g), s, w, dy=dy)
                assert_close(ds, ref_ds + dsum.cpu().double(), what="layer_norm_backward ds")
                assert_close(dw, ref_dw, what="layer_norm_backward dweight")
                assert_close(db, dy.cpu().double().sum(0), what="layer_norm_backward dbias")
        for approximate in ("tanh", "none"):
            for x, dy in ((randn(1037, dtype=dtype), randn(1037, dtype=dtype)),
                          (unaligned(67, dtype=dtype), unaligned(67, dtype=dtype))):
                (ref,) = _grad64(lambda a: reference.gelu(a, approximate), x, dy=dy)
                assert_close(p6.gelu_backward(dy, x, approximate), ref, what="gelu_backward")
    # linear and MLP backward (phase 6's default GEMM for dX, the GELU backward, cuBLAS for dW).
    x, res = randn(77, 61).requires_grad_(), randn(77, 61).requires_grad_()
    w1, b1 = randn(250, 61, scale=61 ** -0.5).requires_grad_(), randn(250).requires_grad_()
    w2, b2 = randn(61, 250, scale=250 ** -0.5).requires_grad_(), randn(61).requires_grad_()
    dout = randn(77, 61)
    p6.mlp(x, w1, b1, w2, b2, res).backward(dout)
    refs = _grad64(reference.mlp, x, w1, b1, w2, b2, res, dy=dout)
    for name, t, ref in zip(("x", "w1", "b1", "w2", "b2", "residual"), (x, w1, b1, w2, b2, res), refs):
        assert_close(t.grad, ref, what=f"mlp backward d{name}")
    xs = unaligned(33, 64).detach().requires_grad_()  # the scalar load path of the GEMM for dX
    w = randn(45, 64, scale=0.125).requires_grad_()
    dout = randn(33, 45)
    p6.linear(xs, w, None, "gelu").backward(dout)
    refs = _grad64(lambda a, b: reference.gelu(a @ b.t(), "none"), xs, w, dy=dout)
    assert_close(xs.grad, refs[0], what="linear backward dx")
    assert_close(w.grad, refs[1], what="linear backward dweight")


if __name__ == "__main__":
    main()
