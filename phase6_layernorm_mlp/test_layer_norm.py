"""LayerNorm and residual-add + LayerNorm against the float64 reference (utils.reference)."""

import pytest
import torch

import phase6_layernorm_mlp as p6
from utils import reference
from utils.testing import assert_close, randn, requires_gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HIDDENS = (1, 7, 31, 512, 768, 1000, 4096)


def _params(hidden, dtype, affine):
    weight = randn(hidden, dtype=dtype) if affine in ("both", "weight") else None
    bias = randn(hidden, dtype=dtype) if affine == "both" else None
    return weight, bias


# --- runs without a GPU: bad inputs are rejected before anything is built -------------------------

def test_cpu_tensor_rejected():
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        p6.layer_norm(torch.randn(4, 8))
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        p6.add_layer_norm(torch.randn(4, 8), torch.randn(4, 8))


def test_non_tensor_rejected():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        p6.layer_norm([1.0, 2.0])


# --- GPU ------------------------------------------------------------------------------------------

@requires_gpu
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("rows", (1, 37))
@pytest.mark.parametrize("affine", ("both", "none", "weight"))
def test_layer_norm_fp32(rows, hidden, affine):
    x = randn(rows, hidden)
    weight, bias = _params(hidden, torch.float32, affine)
    out = p6.layer_norm(x, weight, bias)
    assert_close(out, reference.layer_norm(x, weight, bias), what=f"rows={rows} hidden={hidden} {affine}")


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("hidden", HIDDENS)
def test_layer_norm_half(dtype, hidden):
    x = randn(5, 3, hidden, dtype=dtype)
    weight, bias = _params(hidden, dtype, "both")
    out = p6.layer_norm(x, weight, bias)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, reference.layer_norm(x, weight, bias), what=f"{dtype} hidden={hidden}")


@requires_gpu
@pytest.mark.parametrize("rows,hidden", ((65536, 512), (16384, 1024)))
def test_layer_norm_many_rows(rows, hidden):
    x = randn(rows, hidden)
    weight, bias = _params(hidden, torch.float32, "both")
    assert_close(p6.layer_norm(x, weight, bias), reference.layer_norm(x, weight, bias))


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (1500, 2049, 8192, 20000, 40000))
def test_layer_norm_block_and_streaming_versions(dtype, hidden):
    """Block-per-row (registers) and the streaming version for rows too long for registers."""
    x = randn(3, hidden, dtype=dtype)
    weight, bias = _params(hidden, dtype, "both")
    assert_close(p6.layer_norm(x, weight, bias), reference.layer_norm(x, weight, bias), what=f"hidden={hidden}")


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (512, 1000, 4096))
def test_layer_norm_unaligned_pointers(dtype, hidden):
    """A view starting one element into its storage: not 16-byte aligned, so the scalar path."""
    rows = 9
    storage = randn(rows * hidden + 1, dtype=dtype)
    x = storage[1:].view(rows, hidden)
    assert x.data_ptr() % 16 != 0
    weight, bias = _params(hidden, dtype, "both")
    assert_close(p6.layer_norm(x, weight, bias), reference.layer_norm(x, weight, bias))


@requires_gpu
@pytest.mark.parametrize("hidden", (7, 512, 1000, 4096, 40000))
def test_large_offset_no_cancellation(hidden):
    """Mean 1e4, standard deviation 0.1: E[x^2] - E[x]^2 in FP32 would lose every digit of the
    variance; the shifted two-pass keeps FP32 accuracy (the tolerance is the usual FP32 one)."""
    x = 1e4 + randn(64, hidden, scale=0.1)
    weight, bias = _params(hidden, torch.float32, "both")
    out = p6.layer_norm(x, weight, bias)
    assert_close(out, reference.layer_norm(x, weight, bias), what=f"offset 1e4, hidden={hidden}")
    r = randn(64, hidden, scale=0.05)
    out, total = p6.add_layer_norm(x, r, weight, bias)
    assert_close(out, reference.layer_norm(x, weight, bias, residual=r), what="add, offset 1e4")


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_magnitude_never_nan(dtype):
    scale = 1e4 if dtype == torch.float32 else 1e2
    x = randn(16, 768, dtype=dtype, scale=scale)
    out = p6.layer_norm(x)
    assert torch.isfinite(out).all()
    assert_close(out, reference.layer_norm(x))


@requires_gpu
def test_constant_row_gives_beta():
    """Zero variance: (x - mu) = 0 exactly, so the output is beta (eps keeps rstd finite)."""
    x = torch.full((4, 1000), 3.25, device="cuda")
    bias = randn(1000)
    out = p6.layer_norm(x, randn(1000), bias)
    assert torch.equal(out, bias.expand_as(out))


@requires_gpu
@pytest.mark.parametrize("eps", (0.0, 1e-5, 0.5))
def test_eps(eps):
    x = randn(8, 333)
    assert_close(p6.layer_norm(x, eps=eps), reference.layer_norm(x, eps=eps))


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_add_layer_norm(dtype, hidden):
    x = randn(2, 19, hidden, dtype=dtype)
    r = randn(2, 19, hidden, dtype=dtype)
    weight, bias = _params(hidden, dtype, "both")
    out, total = p6.add_layer_norm(x, r, weight, bias)
    assert_close(total, x.double() + r.double(), what="sum")
    assert_close(out, reference.layer_norm(x, weight, bias, residual=r), what=f"out {dtype} hidden={hidden}")


@requires_gpu
def test_add_layer_norm_many_rows():
    x, r = randn(65536, 768), randn(65536, 768)
    out, total = p6.add_layer_norm(x, r)
    assert_close(total, x.double() + r.double(), what="sum")
    assert_close(out, reference.layer_norm(x, residual=r))


@requires_gpu
def test_non_contiguous_input_is_made_contiguous():
    x = randn(64, 96).t()
    assert_close(p6.layer_norm(x), reference.layer_norm(x))


@requires_gpu
def test_empty_rows():
    x = torch.empty(0, 64, device="cuda")
    assert p6.layer_norm(x).shape == (0, 64)


@requires_gpu
def test_bad_inputs_name_the_argument():
    x = randn(4, 64)
    with pytest.raises(TypeError, match="x must have dtype"):
        p6.layer_norm(x.to(torch.float64))
    with pytest.raises(TypeError, match="x must have dtype"):
        p6.layer_norm(x.to(torch.int32))
    with pytest.raises(ValueError, match="weight must have shape"):
        p6.layer_norm(x, weight=randn(63))
    with pytest.raises(ValueError, match="bias must have shape"):
        p6.layer_norm(x, bias=randn(4, 64))
    with pytest.raises(TypeError, match="weight must have dtype"):
        p6.layer_norm(x, weight=randn(64, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight must be a CUDA tensor"):
        p6.layer_norm(x, weight=torch.randn(64))
    with pytest.raises(ValueError, match="residual must have shape"):
        p6.add_layer_norm(x, randn(4, 65))
    with pytest.raises(TypeError, match="residual must have dtype"):
        p6.add_layer_norm(x, randn(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="eps"):
        p6.layer_norm(x, eps=-1.0)
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        p6.layer_norm(torch.empty(4, 0, device="cuda"))


@requires_gpu
def test_op_checks_too():
    """The C++ op validates on its own (for callers that skip the Python API)."""
    ops = p6.load()
    x = randn(4, 64)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ops.layer_norm(x, randn(3), None, 1e-5)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        ops.layer_norm(x.double(), None, None, 1e-5)
