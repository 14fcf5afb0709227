"""GELU, the fused-epilogue linear layer (its GEMMs) and the MLP against the float64 reference."""

import pytest
import torch

import phase6_layernorm_mlp as p6
from utils import reference
from utils.testing import assert_close, randn, requires_gpu


def _linear_ref(x, w, b, activation, residual):
    y = x.double() @ w.double().t()
    if b is not None:
        y = y + b.double()
    if activation is not None:
        y = reference.gelu(y, "tanh" if activation == "gelu_tanh" else "none")
    if residual is not None:
        y = y + residual.double()
    return y


def _weights(out_f, in_f):
    # nn.Linear's scale, so activations stay O(1) through both GEMMs.
    return randn(out_f, in_f, scale=in_f ** -0.5), randn(out_f, scale=0.1)


def _check_linear(M, K, N, activation, variant=None):
    """p6.linear with bias and residual on fresh inputs against the float64 reference."""
    x = randn(M, K)
    w, b = _weights(N, K)
    residual = randn(M, N)
    out = p6.linear(x, w, b, activation, residual, variant=variant)
    assert_close(out, _linear_ref(x, w, b, activation, residual),
                 what=f"linear {M}x{K}x{N} {activation} variant {variant}")


# --- runs without a GPU ---------------------------------------------------------------------------

def test_cpu_tensors_rejected():
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        p6.gelu(x)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        p6.linear(x, w)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        p6.mlp(x, w, None, w.t(), None)


# --- GELU -----------------------------------------------------------------------------------------

@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("approximate", ("tanh", "none"))
@pytest.mark.parametrize("n", (1, 7, 1000, 4099, 1 << 20))
def test_gelu(dtype, approximate, n):
    # Clamped at -9: below about -10 the tanh form's FP32 value underflows (the tail has its own test).
    x = randn(n, dtype=torch.float32, scale=3.0).clamp_(min=-9.0).to(dtype)
    assert_close(p6.gelu(x, approximate), reference.gelu(x, approximate), what=f"gelu {approximate} n={n}")


@requires_gpu
@pytest.mark.parametrize("approximate", ("tanh", "none"))
def test_gelu_negative_tail(approximate):
    # Where GELU is tiny (x from -9 to -3), each value keeps its own relative accuracy: a form
    # that computes 1 + tanh(u) or 1 + erf(z) in FP32 loses every digit from x = -4 on. Rounding
    # u in FP32 costs up to |2u| ulp (about 1e-5 at x = -9): the bound leaves room for that only.
    x = torch.linspace(-9.0, -3.0, 4099, device="cuda")
    out, ref = p6.gelu(x, approximate).double(), reference.gelu(x, approximate)
    worst = ((out - ref).abs() / ref.abs()).max().item()
    assert worst < 1e-4, f"gelu {approximate}: worst elementwise relative error {worst:.2e} on [-9, -3]"


@requires_gpu
@pytest.mark.parametrize("approximate", ("tanh", "none"))
def test_gelu_unaligned_and_shaped(approximate):
    storage = randn(3 * 5 * 67 + 1)
    x = storage[1:].view(3, 5, 67)
    out = p6.gelu(x, approximate)
    assert out.shape == x.shape
    assert_close(out, reference.gelu(x, approximate))


@requires_gpu
@pytest.mark.parametrize("approximate", ("tanh", "none"))
def test_gelu_large_magnitude(approximate):
    x = randn(4096, scale=1e20)
    out = p6.gelu(x, approximate)
    assert not torch.isnan(out).any()
    assert_close(out, reference.gelu(x, approximate))


@requires_gpu
def test_gelu_bad_approximate():
    with pytest.raises(ValueError, match="approximate"):
        p6.gelu(randn(8), "erf")


# --- linear (GEMM with fused epilogue) -------------------------------------------------------------

OTHER_VARIANTS = [v for v in range(len(p6.LINEAR_TILES)) if v != p6.LINEAR_DEFAULT]
SHAPES = [  # (M tokens, K in, N out): none a multiple of the 128 x 128 x 16 tile unless noted
    (1, 1, 1),
    (1, 64, 128),          # M = 1, aligned K and N
    (37, 29, 45),          # scalar path (K, N odd)
    (130, 64, 200),        # vector path, M and N tails
    (257, 515, 131),       # scalar path, all tails
    (256, 512, 384),       # tile multiples
    (300, 1000, 36),       # vector path, N < one tile
]


@requires_gpu
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("activation", (None, "gelu_tanh", "gelu"))
def test_linear(M, K, N, activation):
    _check_linear(M, K, N, activation)


@requires_gpu
@pytest.mark.parametrize("variant", OTHER_VARIANTS)
@pytest.mark.parametrize("M,K,N", [(37, 29, 45), (130, 64, 200), (257, 515, 131), (256, 512, 384)])
def test_linear_tile_variants(variant, M, K, N):
    # Every other kernel and tile configuration on the scalar and vector paths, tails and tile multiples.
    _check_linear(M, K, N, "gelu_tanh", variant)


@requires_gpu
@pytest.mark.parametrize("variant", OTHER_VARIANTS)
def test_mlp_tile_variants(variant):
    x, res = randn(77, 61), randn(77, 61)
    w1, b1 = _weights(250, 61)
    w2, b2 = _weights(61, 250)
    assert_close(p6.mlp(x, w1, b1, w2, b2, res, variant=variant), reference.mlp(x, w1, b1, w2, b2, res))


FEW_ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 40)  # every kRows of linear_rows.cu, partial ones, M > 16 in blocks


@requires_gpu
@pytest.mark.parametrize("M", FEW_ROWS)
@pytest.mark.parametrize("K,N", [(512, 2048), (2048, 512), (515, 131), (4, 3)])
@pytest.mark.parametrize("variant", (None, p6.LINEAR_ROWS, p6.LINEAR_SGEMM, p6.LINEAR_TF32X3))
def test_linear_few_rows(M, K, N, variant):
    # The few-rows kernel (what the API picks up to LINEAR_ROWS_UP_TO rows) on both load paths,
    # and the tiled kernels on the same decode-step shapes.
    _check_linear(M, K, N, "gelu_tanh", variant)


@requires_gpu
def test_linear_few_rows_unaligned_and_epilogues():
    storage = randn(3 * 64 + 1)
    x = storage[1:].view(3, 64)  # not 16-byte aligned: the scalar path
    w, b = _weights(33, 64)
    for activation in (None, "gelu_tanh", "gelu"):
        for bias in (b, None):
            out = p6.linear(x, w, bias, activation, variant=p6.LINEAR_ROWS)
            assert_close(out, _linear_ref(x, w, bias, activation, None), what=f"rows {activation} bias={bias is not None}")


@requires_gpu
@pytest.mark.parametrize("M,K,N", [(256, 2048, 512), (200, 515, 131), (129, 1024, 260), (512, 512, 2048)])
@pytest.mark.parametrize("activation", (None, "gelu_tanh"))
@pytest.mark.parametrize("variant", (p6.LINEAR_SGEMM, p6.LINEAR_TF32X3))
def test_linear_split_k(M, K, N, activation, variant):
    # Few 128 x 128 tiles and a long K: the tiled kernels split K over blocks (linear_split_k.cuh)
    # and a second kernel sums the partials and applies the epilogue.
    _check_linear(M, K, N, activation, variant)


@requires_gpu
@pytest.mark.parametrize("K", (4096, 16384))
def test_linear_tf32x3_long_positive_sums(K):
    # Positive operands: every addition of a K-long dot product rounds the same way if the
    # tensor core's truncating adds pile up in one accumulator. The kernel sums each k-slice in
    # fresh accumulators and adds it to the running sum rounded to nearest; the FP32 tolerance holds.
    # 9 x 8 tiles: more than half a wave on a GPU of fewer than 144 SMs, so no split-K shortens the sums.
    x = torch.rand(9 * 128, K, device="cuda")
    w = torch.rand(8 * 128, K, device="cuda") / K
    out = p6.linear(x, w, variant=p6.LINEAR_TF32X3)
    assert_close(out, _linear_ref(x, w, None, None, None), what=f"tf32x3 positive sums K={K}")


def test_api_picks_the_few_rows_kernel_by_rows():
    assert p6._variant_for(None, torch.empty(2, p6.LINEAR_ROWS_UP_TO // 2, 8)) == p6.LINEAR_ROWS
    assert p6._variant_for(None, torch.empty(p6.LINEAR_ROWS_UP_TO + 1, 8)) == p6.LINEAR_DEFAULT
    assert p6._variant_for(3, torch.empty(1, 8)) == 3


@pytest.mark.parametrize("variant", (-1, 99, 1.0, True))
def test_bad_linear_variant_is_named(variant):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="variant"):
        p6.linear(x, torch.randn(8, 8), variant=variant)


@requires_gpu
@pytest.mark.parametrize("with_bias", (True, False))
@pytest.mark.parametrize("with_residual", (True, False))
def test_linear_optional_parts_and_leading_dims(with_bias, with_residual):
    x = randn(2, 33, 64)
    w, b = _weights(96, 64)
    b = b if with_bias else None
    residual = randn(2, 33, 96) if with_residual else None
    out = p6.linear(x, w, b, residual=residual)
    assert out.shape == (2, 33, 96)
    assert_close(out, _linear_ref(x, w, b, None, residual))


@requires_gpu
def test_linear_unaligned_pointers():
    storage = randn(50 * 64 + 1)
    x = storage[1:].view(50, 64)
    w, b = _weights(64, 64)
    assert_close(p6.linear(x, w, b, "gelu_tanh"), _linear_ref(x, w, b, "gelu_tanh", None))


@requires_gpu
def test_linear_long_k():
    x = randn(129, 4100)
    w, b = _weights(70, 4100)
    assert_close(p6.linear(x, w, b), _linear_ref(x, w, b, None, None))


@requires_gpu
def test_linear_zero_in_features():
    x = torch.empty(5, 0, device="cuda")
    w = torch.empty(7, 0, device="cuda")
    b = randn(7)
    assert_close(p6.linear(x, w, b), b.double().expand(5, 7))


# --- MLP ------------------------------------------------------------------------------------------

@requires_gpu
@pytest.mark.parametrize("tokens,hidden,inner", ((1, 8, 32), (77, 61, 250), (300, 128, 512), (129, 512, 2048)))
@pytest.mark.parametrize("approximate", ("tanh", "none"))
@pytest.mark.parametrize("with_residual", (True, False))
def test_mlp(tokens, hidden, inner, approximate, with_residual):
    x = randn(tokens, hidden)
    w1, b1 = _weights(inner, hidden)
    w2, b2 = _weights(hidden, inner)
    residual = randn(tokens, hidden) if with_residual else None
    out = p6.mlp(x, w1, b1, w2, b2, residual, approximate)
    ref = reference.mlp(x, w1, b1, w2, b2, residual, approximate)
    assert_close(out, ref, what=f"mlp {tokens}x{hidden}x{inner} {approximate}")


@requires_gpu
def test_mlp_without_biases_and_batched():
    x = randn(3, 17, 40)
    w1, _ = _weights(100, 40)
    w2, _ = _weights(24, 100)
    out = p6.mlp(x, w1, None, w2, None)
    assert out.shape == (3, 17, 24)
    assert_close(out, reference.mlp(x, w1, None, w2, None))


@requires_gpu
def test_mlp_large_magnitude_finite():
    x = randn(64, 128, scale=1e3)
    w1, b1 = _weights(256, 128)
    w2, b2 = _weights(128, 256)
    out = p6.mlp(x, w1, b1, w2, b2)
    assert torch.isfinite(out).all()
    assert_close(out, reference.mlp(x, w1, b1, w2, b2))


@requires_gpu
def test_bad_inputs_name_the_argument():
    x = randn(4, 64)
    w1, b1 = _weights(128, 64)
    w2, b2 = _weights(64, 128)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        p6.linear(x.half(), w1.half())
    with pytest.raises(TypeError, match="weight must have dtype"):
        p6.linear(x, w1.double())
    with pytest.raises(ValueError, match="weight must have shape"):
        p6.linear(x, randn(128, 63))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        p6.linear(x, randn(128))
    with pytest.raises(ValueError, match="bias must have shape"):
        p6.linear(x, w1, randn(127))
    with pytest.raises(ValueError, match="residual must have shape"):
        p6.linear(x, w1, b1, residual=randn(4, 64))
    with pytest.raises(ValueError, match="weight must be a CUDA tensor"):
        p6.linear(x, w1.cpu())
    with pytest.raises(ValueError, match="activation"):
        p6.linear(x, w1, activation="relu")
    with pytest.raises(ValueError, match="w1 must have shape"):
        p6.mlp(randn(4, 65), w1, b1, w2, b2)       # hidden mismatch between x and w1
    with pytest.raises(ValueError, match="w2 must have shape"):
        p6.mlp(x, w1, b1, randn(64, 127), b2)      # inner mismatch between w1 and w2
    with pytest.raises(ValueError, match="b1 must have shape"):
        p6.mlp(x, w1, b2, w2, b2)
    with pytest.raises(ValueError, match="b2 must have shape"):
        p6.mlp(x, w1, b1, w2, b1)
    with pytest.raises(ValueError, match="residual must have shape"):
        p6.mlp(x, w1, b1, w2, b2, residual=randn(4, 128))
    with pytest.raises(ValueError, match="approximate"):
        p6.mlp(x, w1, b1, w2, b2, approximate="erf")
    with pytest.raises(TypeError, match="w2 must have dtype"):
        p6.mlp(x, w1, b1, w2.half(), b2)


@requires_gpu
def test_ops_trace_under_torch_compile():
    """register_fake lets torch.compile trace the ops (fullgraph: no graph breaks)."""
    p6.load()
    ops = torch.ops.phase6_layernorm_mlp
    x, r = randn(16, 64), randn(16, 64)
    w1, b1 = _weights(128, 64)
    w2, b2 = _weights(64, 128)

    def block(x, r):
        y, s = ops.add_layer_norm(x, r, None, None, 1e-5)
        h = ops.linear(y, w1, b1, "gelu_tanh", None)
        return ops.linear(h, w2, b2, "none", s)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert_close(compiled(x, r), block(x, r).double(), rel_tol=1e-6)

