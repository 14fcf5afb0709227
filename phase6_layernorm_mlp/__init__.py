"""Phase 6: LayerNorm, GELU and the fused MLP (CUDA kernels of the course's own).

Public API (inputs are validated here first; every error names the argument it rejects):
    layer_norm(x, weight=None, bias=None, eps=1e-5) -> y
    add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5) -> (y, x + residual)
    gelu(x, approximate="tanh" | "none") -> y
    linear(x, weight, bias=None, activation=None | "gelu_tanh" | "gelu", residual=None)
        = activation(x @ weight.T + bias) + residual            (FP32 GEMM, fused epilogue)
    mlp(x, w1, b1, w2, b2, residual=None, approximate="tanh")
        = gelu(x @ w1.T + b1) @ w2.T + b2 + residual             (two fused-epilogue GEMMs)

Backward (every op above is differentiable: layer_norm, add_layer_norm and gelu by formulas in
C++, autograd.cpp; linear by torch.library.register_autograd on its op, here):
    layer_norm_backward(dy, s, weight=None, eps=1e-5, dsum=None, param_grads=True) -> (ds, dweight, dbias)
        s the LayerNorm's input (x, or add_layer_norm's sum); dsum is added to ds
    gelu_backward(dy, x, approximate="tanh") -> dy * gelu'(x)
    linear's backward: dX on this phase's GEMM (against a transposed copy of the weight), dW on
    cuBLAS (torch.matmul: it reads the transposed activations in place), db a column sum.
    mlp with autograd on: GEMM 1 without its GELU epilogue (its output, the pre-activation, is what
    the GELU backward needs), the GELU kernel, GEMM 2; with grad off, the fused path.

LayerNorm and GELU take float32, float16 and bfloat16 (statistics and math in FP32); linear and
mlp take float32. Weights are laid out as nn.Linear's: [out_features, in_features].
Importing this package builds nothing; the extension is built (or loaded) by the first call.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from utils.build import op_loader
from utils.checks import check_cuda_tensor

NAME = "phase6_layernorm_mlp"
SOURCES = ["ops.cpp", "autograd.cpp", "layer_norm.cu", "layer_norm_backward.cu", "gelu.cu", "linear.cu", "linear_async.cu", "linear_rows.cu", "linear_tf32x3.cu"]
# The GEMM's kernels and tile configurations, in variant order (the headers of linear.cu,
# linear_async.cu, linear_rows.cu and linear_tf32x3.cu). Variants 0-6 are SGEMMs on the FFMA pipe;
# LINEAR_SGEMM is the one that won in run.py's timing on the H100. LINEAR_TF32X3 runs the products
# on tensor cores in 3xTF32 (FP32 accuracy: run.py measures its error beside cuBLAS SGEMM's) and is
# LINEAR_DEFAULT; LINEAR_ROWS is the few-rows kernel, which the API picks for M (the product of x's
# leading dimensions) up to LINEAR_ROWS_UP_TO: the crossover of run.py's few-rows sweep.
LINEAR_TILES = ("registers, 8x8 per thread, 256 threads, 2 blocks/SM",
                "registers, 8x8 per thread, 256 threads, 1 block/SM",
                "registers, 8x16 per thread, 128 threads, 2 blocks/SM",
                "cp.async, 8x8 per thread, 256 threads, BK 16, 3 stages",
                "cp.async, 8x8 per thread, 256 threads, BK 32, 3 stages",
                "cp.async, 8x16 per thread, 128 threads, BK 16, 4 stages",
                "few rows: a warp per output column, lanes over K, up to 16 rows per block",
                "tensor cores, 3xTF32 mma.sync m16n8k8, 8 warps of 64x32, BK 32, 3 stages")
LINEAR_SGEMM = 0
LINEAR_ROWS = 6
LINEAR_TF32X3 = 7
LINEAR_DEFAULT = LINEAR_TF32X3
LINEAR_ROWS_UP_TO = 16
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = {None: "none", "none": "none", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
# linear's activation -> the GELU form its backward differentiates.
GELU_FORM = {"gelu_tanh": "tanh", "gelu": "none"}


def _register() -> None:
    """Shape-only (meta) implementations, so torch.compile can trace through the ops, and the
    backward formulas that make the forward ops differentiable."""
    _register_fakes()
    _register_autograd()


def _register_fakes() -> None:
    """Shape-only (meta) implementations of every op."""

    @torch.library.register_fake(f"{NAME}::layer_norm")
    def _(x, weight, bias, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAME}::add_layer_norm")
    def _(x, residual, weight, bias, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake(f"{NAME}::gelu")
    def _(x, approximate):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAME}::linear")
    def _(x, weight, bias, activation, residual, variant=0):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake(f"{NAME}::layer_norm_backward")
    def _(dy, s, weight, dsum, eps, param_grads):
        n = s.shape[-1] if param_grads else 0
        return torch.empty_like(s), s.new_empty((n,)), s.new_empty((n,))

    @torch.library.register_fake(f"{NAME}::gelu_backward")
    def _(dy, x, approximate):
        return torch.empty_like(x)


# ------------------------------------------------------------------------------------------------
# Autograd of linear: its backward from the ops above (and cuBLAS for dW); layer_norm's,
# add_layer_norm's and gelu's are in C++ (autograd.cpp)


def _linear_setup(ctx, inputs, output):
    x, weight, bias, activation, residual, *variant = inputs
    ctx.save_for_backward(x, weight, bias if activation != "none" else None)
    ctx.activation, ctx.variant = activation, variant[0] if variant else 0
    ctx.has_bias, ctx.has_residual = bias is not None, residual is not None


def _linear_backward(ctx, dout):
    """out = act(x W^T + b) + residual, x [M, K] (leading dims flattened), W [N, K]:
    dpre = dout * act'(pre), dx = dpre W (this phase's SGEMM, NT against W^T copied: N x K floats),
    dW = dpre^T x and db = column sums of dpre (cuBLAS: it reads dpre^T and x in place, where this
    phase's SGEMM would need transposed copies of both M-row activations), dresidual = dout.
    With an activation, the pre-activation is recomputed by one more GEMM (mlp avoids that: with
    autograd on it runs GEMM 1 without the activation)."""
    x, weight, bias = ctx.saved_tensors
    needs = ctx.needs_input_grad
    ops = load()
    dout = dout.contiguous()
    dpre = dout
    if ctx.activation != "none":
        pre = ops.linear(x, weight, bias, "none", None, ctx.variant)
        dpre = ops.gelu_backward(dout, pre, GELU_FORM[ctx.activation])
    N, K = weight.shape
    dpre2 = dpre.reshape(-1, N)
    dx = ops.linear(dpre, weight.t().contiguous(), None, "none", None, ctx.variant) if needs[0] else None
    dweight = dpre2.t() @ x.reshape(-1, K) if needs[1] else None
    dbias = dpre2.sum(0) if ctx.has_bias and needs[2] else None
    dresidual = dout if ctx.has_residual and needs[4] else None
    return dx, dweight, dbias, None, dresidual, None


def _register_autograd() -> None:
    torch.library.register_autograd(f"{NAME}::linear", _linear_backward, setup_context=_linear_setup)


load = op_loader(Path(__file__).parent, NAME, SOURCES, _register)


# ------------------------------------------------------------------------------------------------
# Validation helpers


def _check_like(t, name: str, x: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """t must be a CUDA tensor on x's device, of x's dtype and of `shape`; returns it contiguous."""
    check_cuda_tensor(t, name, (x.dtype,))
    if t.device != x.device:
        raise ValueError(f"{name} must be on {x.device} (x's device), got {t.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)} ({what}), got {list(t.shape)}")
    return t.contiguous()


def _check_eps(eps) -> float:
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    return float(eps)


def _check_x(x, name: str = "x", dtypes=FLOAT_DTYPES) -> torch.Tensor:
    check_cuda_tensor(x, name, dtypes)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(x.shape)}")
    return x.contiguous()


def _ln_params(x, weight, bias):
    hidden = x.shape[-1]
    if weight is not None:
        weight = _check_like(weight, "weight", x, (hidden,), "the last dimension of x")
    if bias is not None:
        bias = _check_like(bias, "bias", x, (hidden,), "the last dimension of x")
    return weight, bias


# ------------------------------------------------------------------------------------------------
# Public API


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension of x (any shape [..., hidden]); FP32 statistics."""
    x = _check_x(x)
    weight, bias = _ln_params(x, weight, bias)
    return load().layer_norm(x, weight, bias, _check_eps(eps))


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(x + residual), x + residual) in one pass over memory."""
    x = _check_x(x)
    residual = _check_like(residual, "residual", x, tuple(x.shape), "the shape of x")
    weight, bias = _ln_params(x, weight, bias)
    out, total = load().add_layer_norm(x, residual, weight, bias, _check_eps(eps))
    return out, total


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GELU elementwise: approximate="tanh" (the tanh form) or "none" (the exact erf form)."""
    check_cuda_tensor(x, "x", FLOAT_DTYPES)
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return load().gelu(x.contiguous(), approximate)


def layer_norm_backward(dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-5,
                        dsum: torch.Tensor | None = None, param_grads: bool = True):
    """The gradients of y = LayerNorm(s) * weight + bias given dy = dL/dy: (ds, dweight, dbias).

    s is the LayerNorm's input (x for layer_norm, the sum output for add_layer_norm); dsum, a
    gradient that reached s by another path (add_layer_norm's sum output), is added to ds.
    dweight and dbias ([hidden], s's dtype) are computed when param_grads, else empty tensors."""
    s = _check_x(s, "s")
    dy = _check_like(dy, "dy", s, tuple(s.shape), "the shape of s")
    if weight is not None:
        weight = _check_like(weight, "weight", s, (s.shape[-1],), "the last dimension of s")
    if dsum is not None:
        dsum = _check_like(dsum, "dsum", s, tuple(s.shape), "the shape of s")
    return load().layer_norm_backward(dy, s, weight, dsum, _check_eps(eps), bool(param_grads))


def gelu_backward(dy: torch.Tensor, x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """dy * gelu'(x) elementwise, for the form the forward used ("tanh" or "none")."""
    check_cuda_tensor(x, "x", FLOAT_DTYPES)
    x = x.contiguous()
    dy = _check_like(dy, "dy", x, tuple(x.shape), "the shape of x")
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return load().gelu_backward(dy, x, approximate)


def _check_variant(variant) -> None:
    if variant is not None and (isinstance(variant, bool) or not isinstance(variant, int)
                                or not 0 <= variant < len(LINEAR_TILES)):
        raise ValueError(f"variant must be None or an int in [0, {len(LINEAR_TILES)}) (LINEAR_TILES), got {variant!r}")


def _variant_for(variant: int | None, x: torch.Tensor) -> int:
    """The variant asked for, or (None) the few-rows kernel for x's rows up to LINEAR_ROWS_UP_TO
    and LINEAR_DEFAULT above."""
    if variant is not None:
        return variant
    return LINEAR_ROWS if math.prod(x.shape[:-1]) <= LINEAR_ROWS_UP_TO else LINEAR_DEFAULT


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None, variant: int | None = None) -> torch.Tensor:
    """activation(x @ weight.T + bias) + residual, FP32; weight [out_features, in_features].
    variant picks the GEMM's kernel and tile configuration (LINEAR_TILES; None: by x's rows,
    LINEAR_ROWS up to LINEAR_ROWS_UP_TO of them, else LINEAR_DEFAULT)."""
    _check_variant(variant)
    check_cuda_tensor(x, "x", (torch.float32,))
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., in_features]")
    x = x.contiguous()
    variant = _variant_for(variant, x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'gelu_tanh' or 'gelu', got {activation!r}")
    check_cuda_tensor(weight, "weight", (torch.float32,), dim=2)
    in_features = x.shape[-1]
    out_features = weight.shape[0]
    weight = _check_like(weight, "weight", x, (out_features, in_features),
                         f"[out_features, in_features={in_features}], in_features = x.shape[-1]")
    if bias is not None:
        bias = _check_like(bias, "bias", x, (out_features,), "[out_features] of weight")
    if residual is not None:
        residual = _check_like(residual, "residual", x, (*x.shape[:-1], out_features), "the output's shape")
    return load().linear(x, weight, bias, ACTIVATIONS[activation], residual, variant)


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
        b2: torch.Tensor | None, residual: torch.Tensor | None = None, approximate: str = "tanh",
        variant: int | None = None) -> torch.Tensor:
    """The Transformer MLP: gelu(x @ w1.T + b1) @ w2.T + b2 (+ residual), FP32.

    GEMM 1 applies bias and GELU in its epilogue; GEMM 2 applies bias and the residual add in its.
    With autograd recording (grad enabled and an input that requires grad), GEMM 1 applies the bias
    only and the GELU kernel runs after it, so that the backward has the pre-activation.
    variant: both GEMMs' kernel and tile configuration (LINEAR_TILES; None: picked by x's rows, as
    in linear).
    """
    _check_variant(variant)
    x = _check_x(x, "x", (torch.float32,))
    variant = _variant_for(variant, x)
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    check_cuda_tensor(w1, "w1", (torch.float32,), dim=2)
    check_cuda_tensor(w2, "w2", (torch.float32,), dim=2)
    hidden = x.shape[-1]
    inner = w1.shape[0]
    out_features = w2.shape[0]
    w1 = _check_like(w1, "w1", x, (inner, hidden), f"[inner, hidden={hidden}], hidden = x.shape[-1]")
    w2 = _check_like(w2, "w2", x, (out_features, inner), f"[out, inner={inner}], inner = w1.shape[0]")
    if b1 is not None:
        b1 = _check_like(b1, "b1", x, (inner,), "[inner] = w1.shape[0]")
    if b2 is not None:
        b2 = _check_like(b2, "b2", x, (out_features,), "[out] = w2.shape[0]")
    if residual is not None:
        residual = _check_like(residual, "residual", x, (*x.shape[:-1], out_features), "the output's shape")
    ops = load()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w1, b1, w2, b2, residual)):
        # Training: the GELU backward needs the pre-activation, so GEMM 1 writes it (no epilogue
        # GELU) and the GELU kernel follows; the fused epilogue would make the backward redo GEMM 1.
        h = ops.gelu(ops.linear(x, w1, b1, "none", None, variant), approximate)
    else:
        h = ops.linear(x, w1, b1, "gelu_tanh" if approximate == "tanh" else "gelu", None, variant)
    return ops.linear(h, w2, b2, "none", residual, variant)
