"""Tests of the attention backward (phase5_fused.backward) and of the autograd it gives the fused
forwards: dq, dk, dv against float64 autograd through the reference formula (utils.reference's
semantics and its attention_bias), relative error <= 1e-4 in FP32; in FP16 / BF16 no worse than
twice the error of PyTorch's own SDPA gradients in the same dtype on the same inputs. Fully masked
rows and padding keys must give zero gradients, never NaN. GPU tests skip without a GPU; the
float64 reference itself is checked on the CPU (against utils.reference.attention, and by gradcheck).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from phase5_fused import backward, fp32
from phase5_fused import tensor_cores as tc
from utils import reference
from utils.testing import (assert_close, new_seed, random_additive_mask, random_bool_mask, randn, rel_error,
                           requires_gpu)

FP32_TOL = 1e-4
# SDPA's gradient error can be ~0 (S = 1: dV = dO); below this the 2x rule is not applied.
SDPA_FLOOR = 1e-4
TC_DTYPES = (torch.float16, torch.bfloat16)
# FP32 head dims on the backward's padded tiles: not a multiple of 16 (8, 40, 136, 200), a tile's
# width itself (256); each of a different tile width.
FP32_PADDED_D = (8, 40, 136, 200, 256)
# Test ids of the FP32 kernels: 0, bwd_fp32.cu (the teaching kernel, whose steps the starter kit
# leaves to the student), 1, bwd_tf32x3.cu.
FP32_VARIANT_IDS = ["teaching", "tf32x3"]
# FP16 / BF16 head dims on the tensor-core kernels' padded tiles (tile widths 32, 96, 128, 224),
# and the widths themselves.
TC_PADDED_D = (8, 80, 120, 200)
TC_GRID_D = tuple(sorted(backward.TC_TILE_D + TC_PADDED_D))


# ------------------------------------------------------------------------------------------------
# The float64 reference gradients (utils.reference.attention_grads)


def reference_grads(q, k, v, dout, **kwargs):
    """(out, dq, dk, dv) in float64: utils.reference's output and gradients."""
    return (reference.attention(q, k, v, **kwargs), *reference.attention_grads(q, k, v, dout, **kwargs))


def test_reference_grads_zero_where_hidden():
    """utils.reference.attention_grads: finite, zero for fully masked rows and padding keys (CPU)."""
    gen = torch.Generator().manual_seed(new_seed())
    q = torch.randn(2, 2, 9, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 11, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(2, 1, 9, 11, generator=gen) > 0.3
    mask[..., 4, :] = False
    lengths = torch.tensor([11, 6])
    _, dq, dk, dv = reference_grads(q, k, v, torch.randn_like(q), mask=mask, is_causal=True, key_lengths=lengths)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[..., 4, :], torch.zeros_like(dq[..., 4, :])), "a fully masked row has zero dq"
    assert torch.equal(dk[1, :, 6:], torch.zeros_like(dk[1, :, 6:])), "padding keys have zero dk"


def test_reference_grads_pass_gradcheck():
    """utils.reference.attention_grads are the derivatives of <attention, dout>: the formula passes
    torch.autograd.gradcheck in float64, and the helper agrees with autograd through it (CPU)."""
    gen = torch.Generator().manual_seed(new_seed())
    q = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64)
    mask = torch.randn(1, 1, 5, 7, generator=gen, dtype=torch.float64)

    def loss(q_, k_, v_):
        # The gradient reference_grads returns must be the derivative of <out, dout>.
        bias = reference.attention_bias(1, 2, 5, 7, mask, True, None, None)
        p = torch.softmax(q_ @ k_.transpose(-1, -2) / math.sqrt(8) + bias, dim=-1)
        return ((p @ v_) * dout).sum()

    assert torch.autograd.gradcheck(loss, (q, k, v))
    _, dq, dk, dv = reference_grads(q, k, v, dout, mask=mask, is_causal=True)
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for got, want in zip((dq, dk, dv), expected):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Helpers


def test_cancelling_terms_bound_the_gradients():
    """cancelling_terms bounds |dq| and |dk| element by element, and at Sk = 1 the reference's dq and
    dk are exactly zero while the terms are not (CPU)."""
    gen = torch.Generator().manual_seed(new_seed())
    for Sk in (1, 13):
        q, dout = (torch.randn(2, 2, 9, 16, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, 2, Sk, 16, generator=gen, dtype=torch.float64) for _ in range(2))
        dq, dk, _ = reference.attention_grads(q, k, v, dout, is_causal=True, scale=-0.7)
        dq_terms, dk_terms = cancelling_terms(q, k, v, dout, is_causal=True, scale=-0.7)
        assert (dq.abs() <= dq_terms + 1e-12).all() and (dk.abs() <= dk_terms + 1e-12).all()
        if Sk == 1:
            assert not dq.any() and not dk.any() and dq_terms.any() and dk_terms.any()


def make_inputs(B, H, Sq, Sk, D, dtype, scale=1.0):
    seed = new_seed()
    q = randn(B, H, Sq, D, dtype=dtype, scale=scale, seed=seed)
    k = randn(B, H, Sk, D, dtype=dtype, scale=scale, seed=seed + 1)
    v = randn(B, H, Sk, D, dtype=dtype, seed=seed + 2)
    dout = randn(B, H, Sq, D, dtype=dtype, seed=seed + 3)
    return q, k, v, dout, f"(seed {seed}, B={B} H={H} Sq={Sq} Sk={Sk} D={D} {dtype})"


def autograd_grads(module, q, k, v, dout, **kwargs):
    """dq, dk, dv through the forward's autograd (the registered backward), on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module.attention(*leaves, **kwargs)
    out.backward(dout)
    return [t.grad for t in leaves]


def sdpa_grads(q, k, v, dout, mask=None, is_causal=False, scale=None, key_lengths=None, window=None):
    """PyTorch SDPA's gradients in q's dtype (its default backend choice); masks, padding and a window
    as one additive bias in that dtype. NaN of fully masked rows counts as the zeros the reference
    defines."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if mask is None and key_lengths is None and window is None:
        out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=scale)
    else:
        B, H, Sq, _ = q.shape
        bias = reference.attention_bias(B, H, Sq, k.shape[2], mask, is_causal, None, key_lengths, q.device,
                                         window=window)
        out = F.scaled_dot_product_attention(*leaves, attn_mask=bias.to(q.dtype), scale=scale)
    out.backward(dout)
    return [t.grad.nan_to_num(0.0) for t in leaves]


def cancelling_terms(q, k, v, dout, mask=None, is_causal=False, scale=None, stride=None, key_lengths=None,
                     window=None):
    """The sizes of the terms whose differences make dq and dk, in float64: with T = P * (|dO| |V|^T
    + |D_i|), c T |K| and c T^T |Q| (dS = P * (dP - D_i) and |dP - D_i| <= T / P). Where the terms
    cancel exactly (one visible key per row, Sk = 1 or a window of 1: P = 1, O = v, so dP = D_i and
    dq = dk = 0), FP32's rounding of dP - D_i is all that is left, and it is measured against them,
    as assert_close's ref_scale does for a product. Grouped k, v: the dk terms sum over each group."""
    group = q.shape[1] // k.shape[1]
    q64, do64 = (t.detach().to(torch.float64) for t in (q, dout))
    k64, v64 = (t.detach().to(torch.float64).repeat_interleave(group, dim=1) for t in (k, v))
    B, H, Sq, D = q.shape
    c = 1.0 / math.sqrt(D) if scale is None else scale
    bias = reference.attention_bias(B, H, Sq, k.shape[2], mask, is_causal, stride, key_lengths, q.device,
                                    window=window)
    p = reference.softmax(c * q64 @ k64.mT + bias)
    d_i = (do64 * (p @ v64)).sum(-1, keepdim=True)
    t = p * (do64.abs() @ v64.abs().mT + d_i.abs())
    dk_terms = abs(c) * t.mT @ q64.abs()
    return abs(c) * t @ k64.abs(), dk_terms.unflatten(1, (k.shape[1], group)).sum(2)


def check_fp32(grads, refs, info, scales=(None, None, None)):
    for name, got, want, scale in zip(("dq", "dk", "dv"), grads, refs, scales):
        assert_close(got, want, dtype=torch.float32, rel_tol=FP32_TOL, what=name, seed_info=info, ref_scale=scale)


def check_tc(grads, refs, peers, info):
    for name, got, want, peer in zip(("dq", "dk", "dv"), grads, refs, peers):
        assert torch.isfinite(got).all(), f"{name}: non-finite gradient {info}"
        err, peer_err = rel_error(got, want), rel_error(peer, want)
        assert err <= 2 * peer_err + SDPA_FLOOR, f"{name}: rel error {err:.3e} > 2 x SDPA's {peer_err:.3e} {info}"


def check_tc_variants(q, k, v, dout, info, peers, **kwargs):
    """Each variant of the tensor-core backward that takes q's D, called directly on the forward's out
    and lse, checked against float64 beside SDPA's gradients `peers`; {variant: (dq, dk, dv)}."""
    out, lse = tc.attention(q, k, v, return_lse=True, **kwargs)
    _, *refs = reference_grads(q, k, v, dout, **kwargs)
    grads = {}
    for variant in backward.variants_for(q.dtype, q.shape[-1]):
        grads[variant] = backward.attention_backward(q, k, v, out, lse, dout, variant=variant, **kwargs)
        check_tc(grads[variant], refs, peers, f"{info} variant {variant}")
    return grads


def fp32_scales(q, k, v, dout, Sk, **kwargs):
    """assert_close's ref_scale for dq, dk, dv in FP32: the cancelling terms where dq and dk are
    exactly zero (Sk = 1, or a window of one key), the references themselves otherwise."""
    one_key = Sk == 1 or kwargs.get("window") == 1
    return (*cancelling_terms(q, k, v, dout, **kwargs), None) if one_key else (None, None, None)


def run_case(dtype, B, H, Sq, Sk, D, **kwargs):
    """One shape and mask setting through the forward's autograd, checked against the reference."""
    q, k, v, dout, info = make_inputs(B, H, Sq, Sk, D, dtype)
    info = f"{info} {sorted(kwargs)}"
    _, *refs = reference_grads(q, k, v, dout, **kwargs)
    if dtype == torch.float32:
        grads = autograd_grads(fp32, q, k, v, dout, **kwargs)
        check_fp32(grads, refs, info, fp32_scales(q, k, v, dout, Sk, **kwargs))
    else:
        grads = autograd_grads(tc, q, k, v, dout, **kwargs)
        check_tc(grads, refs, sdpa_grads(q, k, v, dout, **kwargs), info)
    return grads


def grouped_inputs(B, H, H_kv, Sq, Sk, D, dtype):
    """make_inputs with k, v of H_kv heads (grouped-query attention)."""
    q, _, _, dout, info = make_inputs(B, H, Sq, Sk, D, dtype)
    _, k, v, _, _ = make_inputs(B, H_kv, 1, Sk, D, dtype)
    return q, k, v, dout, f"{info} H_kv={H_kv}"


def expanded_sdpa_grads(q, k, v, dout, **kwargs):
    """sdpa_grads on K and V repeated per query head; autograd sums dk, dv over each group."""
    group = q.shape[1] // k.shape[1]
    leaves = [t.detach().clone().requires_grad_() for t in (k, v)]
    with torch.enable_grad():
        expanded = [t.repeat_interleave(group, dim=1) for t in leaves]
        dq, dk_expanded, dv_expanded = sdpa_grads(q, *expanded, dout, **kwargs)
        torch.autograd.backward(expanded, (dk_expanded, dv_expanded))
    return dq, leaves[0].grad, leaves[1].grad


# ------------------------------------------------------------------------------------------------
# The shape grid


@requires_gpu
@pytest.mark.parametrize("D", fp32.VERSION_D)
@pytest.mark.parametrize("S", [1, 17, 127, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_grid(S, D, causal):
    run_case(torch.float32, 2, 2, S, S, D, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("D", fp32.SUPPORTED_D)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_every_head_dim(D, causal):
    """Every D the FP32 forward takes, through its autograd: key and query blocks cut short."""
    run_case(torch.float32, 2, 2, 77, 130, D, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("D", FP32_PADDED_D)
def test_fp32_padded_head_dims_masks_padding_stride(D):
    """Padded tiles with a fully masked row, a batch of no keys, padding keys, causal and stride."""
    B, H, Sq, Sk = 3, 2, 77, 130
    mask = random_additive_mask((B, 1, Sq, Sk))
    mask[..., 5, :] = float("-inf")
    lengths = torch.tensor([Sk, 70, 0], device="cuda")
    dq, dk, dv = run_case(torch.float32, B, H, Sq, Sk, D, mask=mask, is_causal=True, key_lengths=lengths)
    for name, g in (("dq row 5", dq[..., 5, :]), ("dk of padding keys", dk[1, :, 70:]),
                    ("dv of a batch with no keys", dv[2])):
        assert torch.equal(g, torch.zeros_like(g)), f"{name} must be zeros"
    run_case(torch.float32, 2, 2, Sq, Sk, D, is_causal=True, stride=3)


CROSS = [(1, 300), (300, 1), (77, 1000), (1000, 77), (130, 64), (64, 130)]


def run_variant_case(variant, B, H, Sq, Sk, D, **kwargs):
    """One FP32 kernel (variant 0: bwd_fp32.cu, 1: bwd_tf32x3.cu), called directly whichever autograd
    runs at D, on the float64 reference's out and lse rounded to FP32 (so no forward kernel is under
    test: the starter kit's teaching tests need only the backward's own TODOs), against the float64
    reference gradients at the FP32 tolerance."""
    q, k, v, dout, info = make_inputs(B, H, Sq, Sk, D, torch.float32)
    info = f"{info} {sorted(kwargs)} variant {variant}"
    out, lse = (t.to(torch.float32) for t in reference.attention(q, k, v, return_lse=True, **kwargs))
    grads = backward.attention_backward(q, k, v, out, lse, dout, variant=variant, **kwargs)
    _, *refs = reference_grads(q, k, v, dout, **kwargs)
    check_fp32(grads, refs, info, fp32_scales(q, k, v, dout, Sk, **kwargs))
    return grads


@requires_gpu
@pytest.mark.parametrize("variant", [0, 1], ids=FP32_VARIANT_IDS)
@pytest.mark.parametrize("D", backward.TF32X3_SUPPORTED_D)
@pytest.mark.parametrize("S", [1, 17, 127, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_variants_grid(variant, S, D, causal):
    run_variant_case(variant, 2, 2, S, S, D, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("D", [64, 128])
def test_fp32_tf32x3_long_sums(D):
    """dK and dV sum over every query block (128 of them here): summed in fresh accumulators per
    block, they keep the FP32 tolerance where the tensor core's own additions would drift."""
    run_variant_case(1, 1, 1, 4096, 4096, D)


@requires_gpu
@pytest.mark.parametrize("variant", [0, 1], ids=FP32_VARIANT_IDS)
@pytest.mark.parametrize("Sq,Sk", CROSS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_variants_cross_lengths(variant, Sq, Sk, causal):
    run_variant_case(variant, 2, 2, Sq, Sk, 64, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("variant", [0, 1], ids=FP32_VARIANT_IDS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_variants_masks_padding_stride_scale(variant, kind, causal):
    """A fully masked row and a batch of no keys give zeros; stride and an explicit scale."""
    B, H, Sq, Sk, D = 3, 2, 150, 333, 96
    if kind == "bool":
        mask = random_bool_mask((B, H, Sq, Sk))
        mask[..., 5, :] = False
    else:
        mask = random_additive_mask((B, 1, Sq, Sk))
        mask[..., 5, :] = float("-inf")
    lengths = torch.tensor([Sk, 200, 0], device="cuda")
    dq, dk, dv = run_variant_case(variant, B, H, Sq, Sk, D, mask=mask, is_causal=causal, key_lengths=lengths)
    for name, g in (("dq row 5", dq[..., 5, :]), ("dk of padding keys", dk[1, :, 200:]),
                    ("dv of a batch with no keys", dv[2])):
        assert torch.equal(g, torch.zeros_like(g)), f"{name} must be zeros"
    run_variant_case(variant, 2, 2, 129, 200, 64, is_causal=causal, stride=3, scale=-0.3)


@requires_gpu
def test_fp32_tf32x3_padding_values_never_reach_gradients():
    q, k, v, dout, info = make_inputs(2, 2, 90, 150, 64, torch.float32)
    lengths = torch.tensor([70, 150], device="cuda", dtype=torch.int32)
    out, lse = fp32.attention(q, k, v, key_lengths=lengths, return_lse=True)
    expected = backward.attention_backward(q, k, v, out, lse, dout, key_lengths=lengths, variant=1)
    k[0, :, 70:] = float("nan")
    v[0, :, 70:] = float("nan")
    got = backward.attention_backward(q, k, v, out, lse, dout, key_lengths=lengths, variant=1)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert torch.isfinite(g).all(), f"{name}: padding leaked NaN {info}"
        assert_close(g, e, dtype=torch.float32, rel_tol=1e-5, what=name, seed_info=info)


@requires_gpu
def test_fp32_tf32x3_head_dims_are_named():
    q, k, v, dout, _ = make_inputs(1, 1, 16, 16, 80, torch.float32)
    out, lse = fp32.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"head dim D=80 is not supported by the 3xTF32 backward"):
        backward.attention_backward(q, k, v, out, lse, dout, variant=1)
    with pytest.raises(RuntimeError, match=r"head dim D=80 is not supported by the 3xTF32 backward"):
        backward.load().attention_backward_fp32(q, k, v, out, lse, dout, None, None, False, None, 1, None, 1)


@requires_gpu
@pytest.mark.parametrize("dtype", TC_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", TC_GRID_D)
@pytest.mark.parametrize("S", [1, 17, 127, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tc_grid(S, D, dtype, causal):
    run_case(dtype, 2, 2, S, S, D, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("Sq,Sk", CROSS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cross_lengths(dtype, Sq, Sk, causal):
    run_case(dtype, 2, 2, Sq, Sk, 64, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kind", ["bool", "bool_broadcast", "additive", "additive_broadcast"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_masks_and_padding(dtype, kind, causal):
    """Masks with a fully masked row, key padding with a batch of no keys: zero gradients there."""
    B, H, Sq, Sk, D = 3, 2, 150, 333, 64
    shape = {"bool": (B, H, Sq, Sk), "bool_broadcast": (Sq, Sk), "additive": (B, H, Sq, Sk),
             "additive_broadcast": (B, 1, Sq, Sk)}[kind]
    if kind.startswith("bool"):
        mask = random_bool_mask(shape)
        mask[..., 5, :] = False
    else:
        mask = random_additive_mask(shape)
        mask[..., 5, :] = float("-inf")
    lengths = torch.tensor([Sk, 200, 0], device="cuda")
    dq, dk, dv = run_case(dtype, B, H, Sq, Sk, D, mask=mask, is_causal=causal, key_lengths=lengths)
    for name, g in (("dq row 5", dq[..., 5, :]), ("dq of a batch with no keys", dq[2]),
                    ("dk of padding keys", dk[1, :, 200:]), ("dv of padding keys", dv[1, :, 200:]),
                    ("dk of a batch with no keys", dk[2]), ("dv of a batch with no keys", dv[2])):
        assert torch.equal(g, torch.zeros_like(g)), f"{name} must be zeros"


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
def test_key_lengths_edges(dtype):
    """Lengths of one key, inside a block, on a block edge, past Sk (all keys)."""
    Sk = 300
    lengths = torch.tensor([1, 131, 192, Sk + 10], device="cuda", dtype=torch.int32)
    run_case(dtype, 4, 2, 200, Sk, 128, is_causal=False, key_lengths=lengths)


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
def test_padding_values_never_reach_gradients(dtype):
    """NaN in padded keys and values must not leak into any gradient."""
    q, k, v, dout, info = make_inputs(2, 2, 90, 150, 64, dtype)
    lengths = torch.tensor([70, 150], device="cuda", dtype=torch.int32)
    module = fp32 if dtype == torch.float32 else tc
    expected = autograd_grads(module, q, k, v, dout, key_lengths=lengths)
    k[0, :, 70:] = float("nan")
    v[0, :, 70:] = float("nan")
    got = autograd_grads(module, q, k, v, dout, key_lengths=lengths)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert torch.isfinite(g).all(), f"{name}: padding leaked NaN {info}"
        assert_close(g, e, dtype=torch.float32 if dtype == torch.float32 else dtype,
                     rel_tol=1e-5 if dtype == torch.float32 else 1e-3, what=name, seed_info=info)


@requires_gpu
@pytest.mark.parametrize("stride", [2, 5])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_stride(stride, causal):
    run_case(torch.float32, 2, 2, 129, 200, 64, is_causal=causal, stride=stride)


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("scale", [0.05, -0.3])
def test_explicit_scale(dtype, scale):
    run_case(dtype, 2, 2, 129, 257, 64, is_causal=True, scale=scale)


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
def test_many_heads_and_batches(dtype):
    run_case(dtype, 24, 20, 17, 33, 32, is_causal=True)


@requires_gpu
def test_fp32_every_forward_version_is_differentiable():
    q, k, v, dout, info = make_inputs(2, 2, 70, 90, 64, torch.float32)
    _, *refs = reference_grads(q, k, v, dout, is_causal=True)
    for kernel in fp32.KERNELS:
        check_fp32(autograd_grads(fp32, q, k, v, dout, is_causal=True, kernel=kernel), refs, f"{info} {kernel}")


# ------------------------------------------------------------------------------------------------
# Grouped-query heads (k, v with H_kv < H heads) and sliding windows


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("H,H_kv", [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_heads(dtype, D, H, H_kv, causal):
    """Grouped-query K/V (GQA, MQA at H_kv = 1) through the forwards' autograd: dk and dv have k's
    shape, each the sum over the query heads that share it, as float64 autograd through the
    reference has it; a bool mask with a fully masked row, a batch's keys padded, Sq != Sk with the
    last query and key blocks cut short."""
    B, Sq, Sk = 2, 150, 333
    q, k, v, dout, info = grouped_inputs(B, H, H_kv, Sq, Sk, D, dtype)
    mask = random_bool_mask((B, 1, Sq, Sk))
    mask[..., 5, :] = False
    kw = {"mask": mask, "is_causal": causal, "key_lengths": torch.tensor([Sk, 200], device="cuda")}
    _, *refs = reference_grads(q, k, v, dout, **kw)
    module = fp32 if dtype == torch.float32 else tc
    grads = autograd_grads(module, q, k, v, dout, **kw)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape, f"dk, dv shapes {info}"
    if dtype == torch.float32:
        check_fp32(grads, refs, info)
    else:
        check_tc(grads, refs, expanded_sdpa_grads(q, k, v, dout, **kw), info)
    assert torch.equal(grads[0][..., 5, :], torch.zeros_like(grads[0][..., 5, :])), f"masked row {info}"


@requires_gpu
def test_grouped_query_heads_fp32_padded_head_dim_and_stride():
    """The FP32 kernel's grouped path at a padded head dim (D = 40) and with a stride."""
    q, k, v, dout, info = grouped_inputs(2, 4, 2, 77, 130, 40, torch.float32)
    for kw in ({"is_causal": True}, {"stride": 3}):
        _, *refs = reference_grads(q, k, v, dout, **kw)
        check_fp32(autograd_grads(fp32, q, k, v, dout, **kw), refs, f"{info} {sorted(kw)}")


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
def test_grouped_direct_call_matches_expanded_heads(dtype):
    """Every variant called directly on grouped K/V against the same call on K/V repeated per query
    head: the kernel writes the expanded call's per-head dk, dv and the op sums each group as torch
    sums the expanded gradients, so dk and dv are the same bits; dq equal to rounding (its atomics
    add in any order)."""
    q, k, v, dout, info = grouped_inputs(2, 8, 2, 200, 260, 64, dtype)
    module = fp32 if dtype == torch.float32 else tc
    out, lse = module.attention(q, k, v, is_causal=True, return_lse=True)
    kx, vx = (t.repeat_interleave(4, dim=1) for t in (k, v))
    for variant in backward.variants_for(dtype, 64):
        grouped = backward.attention_backward(q, k, v, out, lse, dout, is_causal=True, variant=variant)
        expanded = backward.attention_backward(q, kx, vx, out, lse, dout, is_causal=True, variant=variant)
        assert_close(grouped[0], expanded[0].to(torch.float64), dtype=dtype,
                     rel_tol=1e-5 if dtype == torch.float32 else 2e-3, what="dq", seed_info=f"{info} v{variant}")
        for name, got, per_head in zip(("dk", "dv"), grouped[1:], expanded[1:]):
            assert torch.equal(got, per_head.unflatten(1, (2, 4)).sum(2)), f"{name} variant {variant} {info}"


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("window", [1, 40, 130, 1000])
def test_sliding_window(dtype, D, window):
    """A sliding window through the forwards' autograd, on grouped K/V heads, Sq != Sk, a batch's keys
    padded: a window of one key, one inside a block, one spanning blocks, one past Sq (no key
    hidden). Key blocks no query's window reaches are skipped; their keys must still get dk = dv = 0
    where no query sees them (keys past the last query row)."""
    B, H, H_kv, Sq, Sk = 2, 4, 2, 300, 333
    q, k, v, dout, info = grouped_inputs(B, H, H_kv, Sq, Sk, D, dtype)
    kw = {"is_causal": True, "window": window, "key_lengths": torch.tensor([Sk, 200], device="cuda")}
    info = f"{info} window={window}"
    _, *refs = reference_grads(q, k, v, dout, **kw)
    module = fp32 if dtype == torch.float32 else tc
    grads = autograd_grads(module, q, k, v, dout, **kw)
    if dtype == torch.float32:
        check_fp32(grads, refs, info, fp32_scales(q, k, v, dout, Sk, **kw))
    else:
        check_tc(grads, refs, expanded_sdpa_grads(q, k, v, dout, **kw), info)
    for name, g in (("dk", grads[1]), ("dv", grads[2])):
        assert torch.equal(g[..., Sq:, :], torch.zeros_like(g[..., Sq:, :])), f"{name} of keys no query sees {info}"


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
def test_window_every_variant_with_a_mask(dtype):
    """Every variant called directly with a window and a bool mask holding a fully masked row; a
    window of 70 keys across blocks of 64 and 128 keys."""
    B, H, Sq, Sk, D = 2, 2, 260, 260, 64
    q, k, v, dout, info = make_inputs(B, H, Sq, Sk, D, dtype)
    mask = random_bool_mask((B, 1, Sq, Sk))
    mask[..., 5, :] = False
    kw = {"mask": mask, "is_causal": True, "window": 70}
    module = fp32 if dtype == torch.float32 else tc
    out, lse = module.attention(q, k, v, return_lse=True, **kw)
    _, *refs = reference_grads(q, k, v, dout, **kw)
    peers = None if dtype == torch.float32 else sdpa_grads(q, k, v, dout, **kw)
    for variant in backward.variants_for(dtype, D):
        grads = backward.attention_backward(q, k, v, out, lse, dout, variant=variant, **kw)
        if dtype == torch.float32:
            check_fp32(grads, refs, f"{info} variant {variant}")
        else:
            check_tc(grads, refs, peers, f"{info} variant {variant}")
        assert torch.equal(grads[0][..., 5, :], torch.zeros_like(grads[0][..., 5, :])), f"masked row {info}"


@requires_gpu
def test_window_arguments_named():
    q, k, v, dout, _ = make_inputs(1, 2, 16, 24, 64, torch.float16)
    out, lse = tc.attention(q, k, v, is_causal=True, return_lse=True)
    with pytest.raises(ValueError, match="window=4 needs is_causal=True"):
        backward.attention_backward(q, k, v, out, lse, dout, window=4)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        backward.attention_backward(q, k, v, out, lse, dout, is_causal=True, window=0)
    ops = backward.load()
    with pytest.raises(RuntimeError, match="window=4 needs is_causal=True"):
        ops.attention_backward_tc(q, k, v, out, lse, dout, None, None, False, None, 1, None, -1, 4)
    with pytest.raises(RuntimeError, match="window must be >= 1"):
        ops.attention_backward_tc(q, k, v, out, lse, dout, None, None, True, None, 1, None, -1, -2)


@requires_gpu
def test_grouped_heads_not_dividing_named():
    q, k, v, dout, _ = make_inputs(1, 3, 16, 24, 64, torch.float16)
    out, lse = tc.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"H=3 must be a multiple of k's KV heads H_kv=2"):
        backward.attention_backward(q, k[:, :2], v[:, :2], out, lse, dout)
    with pytest.raises(RuntimeError, match=r"H=3 must be a multiple of k's KV heads H_kv=2"):
        backward.load().attention_backward_tc(q, k[:, :2].contiguous(), v[:, :2].contiguous(), out, lse, dout,
                                              None, None, False, None, 1, None)


# ------------------------------------------------------------------------------------------------
# The backward op called directly, the lse gradient, compile


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
def test_direct_call_matches_autograd(dtype):
    q, k, v, dout, info = make_inputs(2, 3, 100, 120, 64, dtype)
    module = fp32 if dtype == torch.float32 else tc
    out, lse = module.attention(q, k, v, is_causal=True, return_lse=True)
    direct = backward.attention_backward(q, k, v, out, lse, dout, is_causal=True)
    via_autograd = autograd_grads(module, q, k, v, dout, is_causal=True)
    for name, a, b in zip(("dq", "dk", "dv"), direct, via_autograd):
        # dq's atomics add in any order: equal up to rounding, not bit for bit.
        assert_close(a, b.to(torch.float64), dtype=dtype, rel_tol=1e-5 if dtype == torch.float32 else 2e-3,
                     what=name, seed_info=info)


@requires_gpu
@pytest.mark.parametrize("dtype", TC_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", backward.TC_SUPPORTED_D)
def test_tc_every_head_dim(D, dtype):
    """Every head dim the tensor-core backward takes, each variant, two query heads on one K/V head
    and causal with a window: the instances of the tile width D runs on, padded where D is below it."""
    q, k, v, dout, info = grouped_inputs(2, 2, 1, 70, 90, D, dtype)
    kw = {"is_causal": True, "window": 40}
    check_tc_variants(q, k, v, dout, info, expanded_sdpa_grads(q, k, v, dout, **kw), **kw)


@requires_gpu
@pytest.mark.parametrize("dtype", TC_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", TC_PADDED_D)
def test_tc_padded_head_dim_is_the_zero_padded_tile(D, dtype):
    """A head dim below its tile width computes what the tile's own instance computes on the inputs
    zero-padded to that width: dk and dv the same bits (each written once, in the same order of
    products), dq (atomics in any order) equal up to rounding. So the padding columns add exactly
    nothing, and the padded instance writes nothing past D (its outputs have D columns)."""
    width = backward.tc_tile_d(D)
    q, k, v, dout, info = make_inputs(2, 2, 150, 300, D, dtype)
    pad = lambda x: F.pad(x, (0, width - D))  # noqa: E731
    kw = {"is_causal": True, "scale": 1.0 / math.sqrt(D)}
    out, lse = tc.attention(q, k, v, return_lse=True, **kw)
    for variant in backward.variants_for(dtype, D):
        dq, dk, dv = backward.attention_backward(q, k, v, out, lse, dout, variant=variant, **kw)
        wide = backward.attention_backward(pad(q), pad(k), pad(v), pad(out), lse, pad(dout), variant=variant, **kw)
        assert torch.equal(dk, wide[1][..., :D]) and torch.equal(dv, wide[2][..., :D]), f"dk, dv {info} v{variant}"
        assert not wide[0][..., D:].any(), f"dq of the padding columns {info} v{variant}"
        assert_close(dq, wide[0][..., :D].double(), dtype=dtype, rel_tol=1e-3, what="dq", seed_info=info)


@requires_gpu
@pytest.mark.parametrize("dtype", TC_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", TC_GRID_D)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tc_variants(D, dtype, causal):
    """Every tile configuration of the tensor-core kernel (8 warps, Bc = 128 too): two key blocks,
    a tail, a mask with a fully masked row, padding."""
    B, H, Sq, Sk = 3, 2, 150, 300
    q, k, v, dout, info = make_inputs(B, H, Sq, Sk, D, dtype)
    mask = random_bool_mask((B, 1, Sq, Sk))
    mask[..., 5, :] = False
    lengths = torch.tensor([Sk, 140, 0], device="cuda")
    kw = {"mask": mask, "is_causal": causal, "key_lengths": lengths}
    for variant, (dq, _, _) in check_tc_variants(q, k, v, dout, info, sdpa_grads(q, k, v, dout, **kw), **kw).items():
        assert torch.equal(dq[..., 5, :], torch.zeros_like(dq[..., 5, :])), f"masked row {info} variant {variant}"


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("D", (32, 64, 80, 120, 128, 200))
def test_default_variant_per_head_dim_and_gpu(dtype, D):
    """variant=None, autograd's, runs the variant the op's default names for D and this GPU: FP32's
    3xTF32 kernel at D = 64 and 128, variant 0 at other D; FP16/BF16's variant 2 where a block may have
    its shared memory (sm_90's 227 KB do, sm_86/89's 99 KB do not), else variant 1, and above D = 128
    variant 2, the only one that takes it. Told apart by the kernels each call launches
    (torch.profiler), every variant's set its own."""
    optin = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    if dtype != torch.float32 and D > backward.TC_ROW_TILE_MAX_D:
        if optin < 227 * 1024:
            pytest.skip(f"a GPU with {optin} bytes per block: variant 2's tiles at D={D} may not fit")
        expected = 2
    elif dtype == torch.float32:
        expected = 1 if D in (64, 128) else 0
    elif optin <= 99 * 1024:
        expected = 1
    elif optin >= 227 * 1024:
        expected = 2
    else:
        pytest.skip(f"a GPU with {optin} bytes per block: between the two whose answer the test knows")
    q, k, v, dout, info = make_inputs(1, 2, 100, 130, D, dtype)
    out, lse = (fp32 if dtype == torch.float32 else tc).attention(q, k, v, return_lse=True)
    default = kernels_launched(lambda: backward.attention_backward(q, k, v, out, lse, dout))
    for variant in backward.variants_for(dtype, D):
        launched = kernels_launched(lambda: backward.attention_backward(q, k, v, out, lse, dout, variant=variant))
        assert (launched == default) == (variant == expected), \
            f"default {sorted(default)} vs variant {variant} {sorted(launched)} (expected {expected}) {info}"


def kernels_launched(fn) -> set[str]:
    """The names of the CUDA kernels that one call of fn launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == DeviceType.CUDA}


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
def test_gradient_through_lse(dtype):
    """A loss that uses lse too: d lse_i / d S_ij = P_ij, folded into D_i."""
    q, k, v, dout, info = make_inputs(2, 2, 65, 90, 64, dtype)
    dlse = randn(2, 2, 65, dtype=torch.float32)
    module = fp32 if dtype == torch.float32 else tc
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = module.attention(*leaves, is_causal=True, return_lse=True)
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()

    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    bias = reference.attention_bias(2, 2, 65, 90, None, True, None, None, q.device)
    scores = (q64 @ k64.transpose(-1, -2)) / math.sqrt(64) + bias
    lse64 = torch.logsumexp(scores, dim=-1)
    out64 = torch.softmax(scores, dim=-1) @ v64
    ((out64 * dout.double()).sum() + (lse64 * dlse.double()).sum()).backward()
    tol = FP32_TOL if dtype == torch.float32 else {torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    for name, got, want in zip(("dq", "dk", "dv"), (t.grad for t in leaves), (q64.grad, k64.grad, v64.grad)):
        assert_close(got, want, dtype=dtype, rel_tol=tol, what=name, seed_info=info)


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=["fp32", "fp16"])
def test_compiled_training_step(dtype):
    """torch.compile(fullgraph=True) of forward + loss; loss.backward() runs the traced backward op."""
    module = fp32 if dtype == torch.float32 else tc
    q, k, v, dout, info = make_inputs(2, 2, 100, 130, 64, dtype)

    def step(q_, k_, v_):
        return (module.attention(q_, k_, v_, is_causal=True).float() * dout.float()).sum()

    compiled = torch.compile(step, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward()
    _, *refs = reference_grads(q, k, v, dout, is_causal=True)
    if dtype == torch.float32:
        check_fp32([t.grad for t in leaves], refs, info)
    else:
        check_tc([t.grad for t in leaves], refs, sdpa_grads(q, k, v, dout, is_causal=True), info)


@requires_gpu
def test_large_magnitude_inputs_never_nan():
    for dtype, magnitude in ((torch.float32, 30.0), (torch.float16, 30.0), (torch.bfloat16, 100.0)):
        q, k, v, dout, info = make_inputs(2, 2, 200, 200, 64, dtype)
        q, k = q * magnitude, k * magnitude
        module = fp32 if dtype == torch.float32 else tc
        for name, g in zip(("dq", "dk", "dv"), autograd_grads(module, q, k, v, dout, is_causal=True)):
            assert torch.isfinite(g).all(), f"{name}: inf/NaN at input magnitude {magnitude} {info}"


@requires_gpu
def test_repeated_calls_agree():
    """dK and dV are written once per key block: the same bits every call (dq's atomics may differ
    in the last bits)."""
    q, k, v, dout, info = make_inputs(2, 4, 500, 500, 128, torch.float16)
    first = autograd_grads(tc, q, k, v, dout, is_causal=True)
    for _ in range(2):
        again = autograd_grads(tc, q, k, v, dout, is_causal=True)
        assert torch.equal(again[1], first[1]) and torch.equal(again[2], first[2]), info


@requires_gpu
@pytest.mark.parametrize("dtype", (torch.float32, *TC_DTYPES), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_lse(dtype, causal):
    """The forwards' lse (what the backward rebuilds P from) against torch.logsumexp in float64,
    masks, padding and a fully masked row included (-inf exactly there)."""
    B, H, Sq, Sk, D = 3, 2, 100, 130, 64
    q, k, v, _, info = make_inputs(B, H, Sq, Sk, D, dtype)
    mask = random_additive_mask((B, 1, Sq, Sk))
    mask[..., 7, :] = float("-inf")
    lengths = torch.tensor([Sk, 64, 0], device="cuda")
    module = fp32 if dtype == torch.float32 else tc
    _, lse = module.attention(q, k, v, mask=mask, is_causal=causal, key_lengths=lengths, return_lse=True)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    scores = scores + reference.attention_bias(B, H, Sq, Sk, mask, causal, None, lengths, q.device)
    ref = torch.logsumexp(scores, dim=-1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), f"-inf rows differ {info}"
    finite = torch.isfinite(ref)
    err = (lse.double() - ref)[finite].abs().max().item()
    assert err <= 1e-4 * max(1.0, ref[finite].abs().max().item()), f"lse max abs error {err:.3e} {info}"


# ------------------------------------------------------------------------------------------------
# Bad input


def test_cpu_tensor_rejected_without_gpu():
    q = torch.randn(1, 1, 8, 64)
    lse = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        backward.attention_backward(q, q, q, q, lse, q)


@pytest.mark.parametrize("D", [0, 12, 264])
def test_fp32_unsupported_head_dim_rejected_without_gpu(D):
    """An input that requires grad at a D the FP32 forward (and so its backward) does not take."""
    q = torch.randn(1, 1, 8, D, requires_grad=True)
    with pytest.raises(ValueError, match=rf"head dim D={D} \(q.shape\[-1\]\) is not supported"):
        fp32.attention(q, q, q)


def test_tc_head_dims_are_the_kernels():
    """TC_SUPPORTED_D is the rule the op checks (bwd.h: every multiple of kTcHeadDimStep up to
    kTcMaxHeadDim), the tensor-core forward's; TC_ROW_TILE_MAX_D and TC_TILE_D are bwd.h's, and every
    supported D has a tile at least as wide."""
    header = (Path(backward.__file__).parent / "bwd.h").read_text()
    step, largest, row_tile_max = (int(re.search(rf"{name} = (\d+)", header).group(1))
                                   for name in ("kTcHeadDimStep", "kTcMaxHeadDim", "kTcRowTileMaxD"))
    assert backward.TC_SUPPORTED_D == tuple(range(step, largest + 1, step)) == tc.SUPPORTED_D
    assert backward.TC_ROW_TILE_MAX_D == row_tile_max
    tiles = re.search(r"kTcTileD\[\] = \{([^}]*)\}", header).group(1)
    assert tuple(int(d) for d in tiles.split(",")) == backward.TC_TILE_D
    assert max(backward.TC_TILE_D) == largest
    assert [backward.tc_tile_d(D) for D in (8, 32, 40, 120, 136, 256)] == [32, 32, 64, 128, 160, 256]


def test_import_builds_nothing():
    """Importing the lesson (and the forwards, which register its autograd on load) builds nothing."""
    import subprocess
    import sys

    from utils.build import REPO_ROOT

    code = ("import phase5_fused.backward, phase5_fused.backward.autograd, phase5_fused.fp32, "
            "phase5_fused.tensor_cores; from utils.build import LOADED_OPS; assert not LOADED_OPS")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@requires_gpu
def test_bad_inputs_named():
    q, k, v, dout, _ = make_inputs(1, 2, 16, 24, 64, torch.float32)
    out, lse = fp32.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        backward.attention_backward(q, k, v, out, lse, dout[:, :, :5])
    with pytest.raises(TypeError, match="out must have dtype float32"):
        backward.attention_backward(q, k, v, out.half(), lse, dout)
    with pytest.raises(ValueError, match="lse must be"):
        backward.attention_backward(q, k, v, out, lse[:, :, :3], dout)
    with pytest.raises(TypeError, match="lse must have dtype float32"):
        backward.attention_backward(q, k, v, out, lse.double(), dout)
    with pytest.raises(ValueError, match="stride is supported in float32 only"):
        h = [t.half() for t in (q, k, v, out, dout)]
        backward.attention_backward(h[0], h[1], h[2], h[3], lse, h[4], stride=2)
    with pytest.raises(ValueError, match="variant must be in"):
        backward.attention_backward(q, k, v, out, lse, dout, variant=2)
    with pytest.raises(ValueError, match="D=136 is above variant 1's 128"):
        h = torch.randn(1, 2, 16, 136, device="cuda", dtype=torch.float16)
        backward.attention_backward(h, h, h, h, lse, h, variant=1)
    with pytest.raises(ValueError, match="mask"):
        backward.attention_backward(q, k, v, out, lse, dout, mask=torch.ones(3, 16, 24, dtype=torch.bool,
                                                                                 device="cuda"))
    with pytest.raises(ValueError, match="out= writes in place"):
        leaf = q.half().requires_grad_()
        tc.attention(leaf, k.half(), v.half(), out=torch.empty_like(leaf))


@requires_gpu
def test_op_checks_name_the_argument():
    """The C++ ops validate again, D against the forwards' own lists."""
    ops = backward.load()
    q, k, v, dout, _ = make_inputs(1, 2, 16, 24, 64, torch.float32)
    out, lse = fp32.attention(q, k, v, return_lse=True)
    args = (None, None, False, None, 1, None)
    with pytest.raises(RuntimeError, match="lse must have shape"):
        ops.attention_backward_fp32(q, k, v, out, lse[:, :1], dout, *args)
    with pytest.raises(RuntimeError, match="dout must be contiguous"):
        ops.attention_backward_fp32(q, k, v, out, lse, dout.transpose(2, 3).contiguous().transpose(2, 3), *args)
    lse48 = torch.zeros(1, 2, 16, device="cuda")
    for D in (12, 264):
        x = torch.randn(1, 2, 16, D, device="cuda")
        with pytest.raises(RuntimeError, match=f"D={D} is not supported by the FP32 backward"):
            ops.attention_backward_fp32(x, x, x, x, lse48, x, *args)
    for D in (12, 264):
        h = torch.randn(1, 2, 16, D, device="cuda", dtype=torch.float16)
        with pytest.raises(RuntimeError, match=f"D={D} is not supported by the tensor-core backward"):
            ops.attention_backward_tc(h, h, h, h, lse48, h, *args)
    h = torch.randn(1, 2, 16, 136, device="cuda", dtype=torch.float16)
    for variant in (0, 1):
        with pytest.raises(RuntimeError, match=f"D=136 is above variant {variant}'s 128"):
            ops.attention_backward_tc(h, h, h, h, lse48, h, *args, variant)
    with pytest.raises(RuntimeError, match="q must be float16 or bfloat16"):
        ops.attention_backward_tc(q, k, v, out, lse, dout, *args)
    with pytest.raises(RuntimeError, match=r"variant must be 0 \(FFMA\) or 1"):
        ops.attention_backward_fp32(q, k, v, out, lse, dout, *args, 2)
    with pytest.raises(RuntimeError, match="variant must be 0, 1 or 2"):
        ops.attention_backward_tc(*(t.half() for t in (q, k, v, out)), lse, dout.half(), *args, 3)


@requires_gpu
def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = backward.load()
    with FakeTensorMode():
        q = torch.empty(2, 3, 17, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 3, 40, 64, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(2, 3, 17, device="cuda")
        dq, dk, dv = ops.attention_backward_tc(q, k, k, q, lse, q, None, None, True, 0.125, 1, None)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape and dq.dtype == torch.bfloat16
