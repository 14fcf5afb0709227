"""The backward of phase 6's ops (LayerNorm, add + LayerNorm, GELU, linear, MLP) against float64
autograd through utils.reference, and the backward ops called directly."""

import pytest
import torch

import phase6_layernorm_mlp as p6
from utils import reference
from utils.testing import assert_close, poisoned_call, randn, requires_gpu, requires_toolkit

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Warp per row (<= 512), block per row (<= 8192), streaming (longer); odd widths take the scalar path.
HIDDENS = (1, 7, 31, 512, 513, 768, 1000, 1536, 4096, 8192, 8200, 20000)
# The brief of these tests: FP32 gradients within 1e-4 of float64 (relative norm).
FP32_GRAD_TOL = 1e-4


def _leaf64(t):
    """A float64 copy of t that requires grad (utils.reference keeps it in the graph)."""
    return None if t is None else t.detach().double().requires_grad_()


def _grad_tol(dtype):
    return FP32_GRAD_TOL if dtype == torch.float32 else None  # None: assert_close's dtype tolerance


def _check_grads(grads, refs, dtype, what):
    for name, g in grads.items():
        if refs[name] is None:
            assert g is None, f"{what}: {name} got a gradient it should not have"
            continue
        assert g is not None, f"{what}: no gradient for {name}"
        assert g.dtype == dtype and g.shape == refs[name].shape, f"{what}: {name} {g.dtype} {tuple(g.shape)}"
        assert_close(g, refs[name], dtype=dtype, rel_tol=_grad_tol(dtype), what=f"{what} d{name}")


# --- runs without a GPU -------------------------------------------------------------------------

def test_backward_apis_reject_cpu_tensors():
    with pytest.raises(ValueError, match="s must be a CUDA tensor"):
        p6.layer_norm_backward(torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        p6.gelu_backward(torch.randn(4), torch.randn(4))


def test_reference_gradients_come_from_float64_autograd():
    """utils.reference keeps float64 leaves in the graph: its LayerNorm gradient is the textbook one."""
    x, dy = torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 10, dtype=torch.float64)
    x64 = x.clone().requires_grad_()
    reference.layer_norm(x64).backward(dy)
    xhat = reference.layer_norm(x)
    rstd = 1 / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    expected = rstd * (dy - dy.mean(-1, keepdim=True) - xhat * (dy * xhat).mean(-1, keepdim=True))
    torch.testing.assert_close(x64.grad, expected)
    assert not reference.layer_norm(x.float().requires_grad_()).requires_grad  # other inputs: detached


@requires_toolkit
@pytest.mark.compile
def test_every_backward_runs_on_meta_tensors():
    """Forward and backward of each op on meta tensors (the fake implementations and the registered
    autograd, called on the ops themselves: the Python API takes CUDA tensors only). Builds the
    extension, runs no kernel: every input gets a gradient of its own shape and dtype."""
    ops = p6.load()

    def leaf(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype).requires_grad_()

    for dtype in DTYPES:
        x, r, w, b = (leaf(3, 5, 64, dtype=dtype), leaf(3, 5, 64, dtype=dtype), leaf(64, dtype=dtype),
                      leaf(64, dtype=dtype))
        y, s = ops.add_layer_norm(x, r, w, b, 1e-5)
        (ops.layer_norm(y, w, None, 1e-5).sum() + ops.gelu(s, "none").sum()).backward()
        for t in (x, r, w, b):
            assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == dtype
    x, res = leaf(7, 64), leaf(7, 32)
    w1, b1, w2, b2 = leaf(128, 64), leaf(128), leaf(32, 128), leaf(32)
    h = ops.gelu(ops.linear(x, w1, b1, "none", None, 0), "tanh")
    (ops.linear(h, w2, b2, "none", res, 0).sum() + ops.linear(x, w1, b1, "gelu_tanh", None, 0).sum()).backward()
    for t in (x, res, w1, b1, w2, b2):
        assert t.grad is not None and t.grad.shape == t.shape


# --- LayerNorm ----------------------------------------------------------------------------------

def _ln_case(rows, hidden, dtype, affine):
    x = randn(rows, hidden, dtype=dtype, scale=2.0) + 0.5
    weight = randn(hidden, dtype=dtype).requires_grad_() if affine in ("both", "weight") else None
    bias = randn(hidden, dtype=dtype).requires_grad_() if affine in ("both", "bias") else None
    return x.requires_grad_(), weight, bias


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("rows", (1, 37, 3000))
def test_layer_norm_backward(rows, hidden, dtype):
    if rows * hidden > 2**24:
        pytest.skip("large enough: the shape's rows are covered by the smaller cases")
    x, weight, bias = _ln_case(rows, hidden, dtype, "both")
    dy = randn(rows, hidden, dtype=dtype)
    out = poisoned_call(lambda: p6.layer_norm(x, weight, bias), (rows, hidden))
    out.backward(dy)
    x64, w64, b64 = _leaf64(x), _leaf64(weight), _leaf64(bias)
    reference.layer_norm(x64, w64, b64).backward(dy.double())
    _check_grads({"x": x.grad, "weight": weight.grad, "bias": bias.grad},
                 {"x": x64.grad, "weight": w64.grad, "bias": b64.grad}, dtype, f"rows={rows} hidden={hidden}")


@requires_gpu
@pytest.mark.parametrize("affine", ("none", "weight", "bias"))
@pytest.mark.parametrize("hidden", (31, 512, 4096, 20000))
def test_layer_norm_backward_without_affine(affine, hidden):
    x, weight, bias = _ln_case(19, hidden, torch.float32, affine)
    dy = randn(19, hidden)
    p6.layer_norm(x, weight, bias).backward(dy)
    x64, w64, b64 = _leaf64(x), _leaf64(weight), _leaf64(bias)
    reference.layer_norm(x64, w64, b64).backward(dy.double())
    _check_grads({"x": x.grad, "weight": None if weight is None else weight.grad,
                  "bias": None if bias is None else bias.grad},
                 {"x": x64.grad, "weight": None if w64 is None else w64.grad,
                  "bias": None if b64 is None else b64.grad}, torch.float32, affine)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (7, 512, 1000, 8192, 20000))
def test_add_layer_norm_backward_both_outputs(dtype, hidden):
    """(y, s) = (LN(x + r), x + r): gradients reach x and r through y and through s."""
    x, weight, bias = _ln_case(2 * 23, hidden, dtype, "both")
    x = x.detach().view(2, 23, hidden).requires_grad_()
    r = randn(2, 23, hidden, dtype=dtype).requires_grad_()
    dy, dsum = randn(2, 23, hidden, dtype=dtype), randn(2, 23, hidden, dtype=dtype)
    y, s = p6.add_layer_norm(x, r, weight, bias)
    torch.autograd.backward((y, s), (dy, dsum))
    x64, r64, w64, b64 = (_leaf64(t) for t in (x, r, weight, bias))
    y64 = reference.layer_norm(x64, w64, b64, residual=r64)
    torch.autograd.backward((y64, x64 + r64), (dy.double(), dsum.double()))
    _check_grads({"x": x.grad, "r": r.grad, "weight": weight.grad, "bias": bias.grad},
                 {"x": x64.grad, "r": r64.grad, "weight": w64.grad, "bias": b64.grad}, dtype, f"hidden={hidden}")


@requires_gpu
def test_add_layer_norm_backward_through_one_output():
    x, r = randn(9, 300).requires_grad_(), randn(9, 300).requires_grad_()
    y, _ = p6.add_layer_norm(x, r)
    dy = randn(9, 300)
    y.backward(dy)
    x64 = _leaf64(x)
    reference.layer_norm(x64, residual=r.detach()).backward(dy.double())
    assert_close(x.grad, x64.grad, rel_tol=FP32_GRAD_TOL, what="dx")
    assert torch.equal(x.grad, r.grad)


@requires_gpu
@pytest.mark.parametrize("hidden", (512, 1000, 20000))
def test_layer_norm_backward_large_offset(hidden):
    """Mean 1e4, standard deviation 0.1: the recomputed statistics keep FP32 accuracy (shifted two-pass)."""
    x = (1e4 + randn(64, hidden, scale=0.1)).requires_grad_()
    weight = randn(hidden).requires_grad_()
    dy = randn(64, hidden)
    p6.layer_norm(x, weight).backward(dy)
    x64, w64 = _leaf64(x), _leaf64(weight)
    reference.layer_norm(x64, w64).backward(dy.double())
    assert_close(x.grad, x64.grad, rel_tol=FP32_GRAD_TOL, what="dx, offset 1e4")
    assert_close(weight.grad, w64.grad, rel_tol=FP32_GRAD_TOL, what="dweight, offset 1e4")


@requires_gpu
@pytest.mark.parametrize("hidden", (512, 1000, 4096, 20000))
def test_layer_norm_backward_unaligned_views(hidden):
    """Views one element into their storage: the scalar (VEC = 1) path of every version."""
    rows = 11
    s = randn(rows * hidden + 1)[1:].view(rows, hidden)
    dy = randn(rows * hidden + 1)[1:].view(rows, hidden)
    dsum = randn(rows * hidden + 1)[1:].view(rows, hidden)
    weight = randn(hidden + 1)[1:]
    assert s.data_ptr() % 16 != 0
    ds, dweight, dbias = p6.layer_norm_backward(dy, s, weight, dsum=dsum)
    s64, w64 = _leaf64(s), _leaf64(weight)
    b64 = torch.zeros(hidden, dtype=torch.float64, device="cuda", requires_grad=True)
    reference.layer_norm(s64, w64, b64).backward(dy.double())
    assert_close(ds, s64.grad + dsum.double(), rel_tol=FP32_GRAD_TOL, what="ds")
    assert_close(dweight, w64.grad, rel_tol=FP32_GRAD_TOL, what="dweight")
    assert_close(dbias, b64.grad, rel_tol=FP32_GRAD_TOL, what="dbias")


@requires_gpu
def test_layer_norm_backward_is_deterministic_and_param_grads_optional():
    s, dy, weight = randn(4096, 768), randn(4096, 768), randn(768)
    first = p6.layer_norm_backward(dy, s, weight)
    again = p6.layer_norm_backward(dy, s, weight)
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # no atomics: the same bits
    ds, dweight, dbias = p6.layer_norm_backward(dy, s, weight, param_grads=False)
    assert torch.equal(ds, first[0]) and dweight.numel() == 0 and dbias.numel() == 0


@requires_gpu
def test_layer_norm_backward_empty_rows():
    ds, dweight, dbias = p6.layer_norm_backward(torch.empty(0, 64, device="cuda"), torch.empty(0, 64, device="cuda"))
    assert ds.shape == (0, 64) and torch.equal(dweight, torch.zeros(64, device="cuda")) and not dbias.any()


@requires_gpu
def test_layer_norm_backward_bad_inputs_name_the_argument():
    s = randn(4, 64)
    with pytest.raises(ValueError, match="dy must have shape"):
        p6.layer_norm_backward(randn(4, 65), s)
    with pytest.raises(TypeError, match="dy must have dtype"):
        p6.layer_norm_backward(randn(4, 64, dtype=torch.float16), s)
    with pytest.raises(ValueError, match="weight must have shape"):
        p6.layer_norm_backward(randn(4, 64), s, randn(63))
    with pytest.raises(ValueError, match="dsum must have shape"):
        p6.layer_norm_backward(randn(4, 64), s, dsum=randn(4, 63))
    with pytest.raises(TypeError, match="s must have dtype"):
        p6.layer_norm_backward(randn(4, 64).double(), s.double())
    with pytest.raises(ValueError, match="eps"):
        p6.layer_norm_backward(randn(4, 64), s, eps=-1.0)
    ops = p6.load()  # the C++ op checks on its own
    with pytest.raises(RuntimeError, match="dy must have s's shape"):
        ops.layer_norm_backward(randn(4, 65), s, None, None, 1e-5, True)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ops.layer_norm_backward(randn(4, 64), s, randn(3), None, 1e-5, True)


# --- GELU ---------------------------------------------------------------------------------------

@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ("tanh", "none"))
@pytest.mark.parametrize("n", (1, 7, 1000, 4099, 1 << 20))
def test_gelu_backward(dtype, approximate, n):
    x = randn(n, scale=3.0).clamp_(min=-9.0).to(dtype).requires_grad_()
    dy = randn(n, dtype=dtype)
    p6.gelu(x, approximate).backward(dy)
    x64 = _leaf64(x)
    reference.gelu(x64, approximate).backward(dy.double())
    assert_close(x.grad, x64.grad, dtype=dtype, rel_tol=_grad_tol(dtype), what=f"gelu' {approximate} n={n}")


@requires_gpu
@pytest.mark.parametrize("approximate", ("tanh", "none"))
def test_gelu_backward_tail_and_large_magnitude(approximate):
    """The negative tail keeps its relative accuracy (no 1 + tanh or 1 + erf cancellation), and huge
    inputs give the limits 0 and 1, never NaN (x^2 overflows FP32 from |x| ~ 2e19)."""
    x = torch.linspace(-9.0, -3.0, 4099, device="cuda")
    out, ref = p6.gelu_backward(torch.ones_like(x), x, approximate).double(), _gelu_grad64(x, approximate)
    worst = ((out - ref).abs() / ref.abs()).max().item()
    assert worst < 1e-4, f"gelu' {approximate}: worst elementwise relative error {worst:.2e} on [-9, -3]"
    big = torch.tensor([-1e30, -1e20, -50.0, 50.0, 1e20, 1e30], device="cuda")
    assert torch.equal(p6.gelu_backward(torch.ones_like(big), big, approximate),
                       torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], device="cuda"))


def _gelu_grad64(x, approximate):
    x64 = _leaf64(x)
    reference.gelu(x64, approximate).sum().backward()
    return x64.grad


@requires_gpu
def test_gelu_backward_unaligned_and_bad_inputs():
    x, dy = randn(3 * 67 + 1)[1:].view(3, 67), randn(3 * 67 + 1)[1:].view(3, 67)
    assert_close(p6.gelu_backward(dy, x, "none"), _gelu_grad64(x, "none") * dy.double(), rel_tol=FP32_GRAD_TOL)
    with pytest.raises(ValueError, match="dy must have shape"):
        p6.gelu_backward(randn(3, 66), x)
    with pytest.raises(TypeError, match="dy must have dtype"):
        p6.gelu_backward(dy.half(), x)
    with pytest.raises(ValueError, match="approximate"):
        p6.gelu_backward(dy, x, "sigmoid")


# --- linear and MLP -----------------------------------------------------------------------------

def _weights(out_f, in_f):
    return (randn(out_f, in_f, scale=in_f ** -0.5).requires_grad_(), randn(out_f, scale=0.1).requires_grad_())


@requires_gpu
@pytest.mark.parametrize("activation", (None, "gelu_tanh", "gelu"))
@pytest.mark.parametrize("M,K,N", ((1, 64, 128), (37, 29, 45), (130, 512, 256)))
def test_linear_backward(activation, M, K, N):
    x = randn(M, K).requires_grad_()
    w, b = _weights(N, K)
    res = randn(M, N).requires_grad_()
    dout = randn(M, N)
    p6.linear(x, w, b, activation, res).backward(dout)
    x64, w64, b64, r64 = (_leaf64(t) for t in (x, w, b, res))
    y = x64 @ w64.t() + b64
    if activation is not None:
        y = reference.gelu(y, "tanh" if activation == "gelu_tanh" else "none")
    (y + r64).backward(dout.double())
    _check_grads({"x": x.grad, "w": w.grad, "b": b.grad, "res": res.grad},
                 {"x": x64.grad, "w": w64.grad, "b": b64.grad, "res": r64.grad}, torch.float32, f"{activation}")


@requires_gpu
@pytest.mark.parametrize("approximate", ("tanh", "none"))
@pytest.mark.parametrize("tokens,hidden,inner", ((1, 64, 256), (2 * 77, 61, 250), (512, 512, 2048)))
def test_mlp_backward(approximate, tokens, hidden, inner):
    x, res = randn(tokens, hidden).requires_grad_(), randn(tokens, hidden).requires_grad_()
    (w1, b1), (w2, b2) = _weights(inner, hidden), _weights(hidden, inner)
    dout = randn(tokens, hidden)
    out = p6.mlp(x, w1, b1, w2, b2, res, approximate)
    with torch.no_grad():  # the fused inference path computes the same function
        assert_close(p6.mlp(x, w1, b1, w2, b2, res, approximate), out.detach().double(), what="fused vs training path")
    out.backward(dout)
    leaves = [_leaf64(t) for t in (x, w1, b1, w2, b2, res)]
    reference.mlp(*leaves, approximate=approximate).backward(dout.double())
    names = ("x", "w1", "b1", "w2", "b2", "res")
    _check_grads(dict(zip(names, (x.grad, w1.grad, b1.grad, w2.grad, b2.grad, res.grad))),
                 dict(zip(names, (t.grad for t in leaves))), torch.float32, f"mlp {approximate}")


@requires_gpu
def test_no_grad_inputs_record_nothing():
    x = randn(8, 64)
    w, b = (t.detach() for t in _weights(32, 64))
    assert not p6.linear(x, w, b, "gelu_tanh").requires_grad
    assert not p6.layer_norm(x, randn(64)).requires_grad
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        assert not p6.layer_norm(xg).requires_grad and not p6.gelu(xg).requires_grad
