"""Tests of the Hopper backward (hopper_bwd.cu): dq, dk, dv through phase5_fused.hopper.attention's
autograd and through attention_backward, against float64 autograd through the reference formula
(the backward lesson's helpers), no worse than twice the error of PyTorch's own SDPA gradients in
the same dtype on the same inputs. Padding keys and rows with no visible key give zero gradients,
never NaN, even where the padding holds NaN. GPU tests skip without a Hopper GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from phase5_fused import hopper
from phase5_fused.backward.test_backward import (check_tc, expanded_sdpa_grads, grouped_inputs, make_inputs,
                                                 reference_grads, sdpa_grads)
from phase5_fused.hopper.test_hopper import requires_hopper
from utils import reference
from utils.testing import assert_close, new_seed, randn

DTYPES = (torch.float16, torch.bfloat16)
DTYPE_IDS = ["fp16", "bf16"]


def autograd_grads(q, k, v, dout, **kwargs):
    """dq, dk, dv through hopper.attention's autograd, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    hopper.attention(*leaves, **kwargs).backward(dout)
    return [t.grad for t in leaves]


def run_case(dtype, B, H, Sq, Sk, D, **kwargs):
    q, k, v, dout, info = make_inputs(B, H, Sq, Sk, D, dtype)
    info = f"{info} {sorted(kwargs)}"
    _, *refs = reference_grads(q, k, v, dout, **kwargs)
    grads = autograd_grads(q, k, v, dout, **kwargs)
    check_tc(grads, refs, sdpa_grads(q, k, v, dout, **kwargs), info)
    return grads


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("S", [1, 17, 127, 1000, 4096])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grid(S, D, dtype, causal):
    run_case(dtype, 1 if S == 4096 else 2, 2, S, S, D, is_causal=causal)


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("Sq,Sk", [(1, 300), (300, 1), (77, 1000), (1000, 77), (130, 64), (64, 130)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cross_lengths(dtype, Sq, Sk, causal):
    run_case(dtype, 2, 2, Sq, Sk, 128 if Sq == 77 else 64, is_causal=causal)


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_padding_holding_nan(dtype, D, causal):
    """Key padding inside Sk (NaN there), a batch with no keys (its rows see nothing), lengths past
    Sk: finite gradients, zeros for padding keys and for the empty batch."""
    B, H, Sq, Sk = 4, 2, 150, 200
    q, k, v, dout, info = make_inputs(B, H, Sq, Sk, D, dtype)
    lengths = torch.tensor([Sk, 70, 0, Sk + 5], device="cuda")
    k[1, :, 70:] = float("nan")
    v[1, :, 70:] = float("nan")
    _, *refs = reference_grads(q, k.nan_to_num(0.0), v.nan_to_num(0.0), dout, is_causal=causal, key_lengths=lengths)
    peers = sdpa_grads(q, k.nan_to_num(0.0), v.nan_to_num(0.0), dout, is_causal=causal, key_lengths=lengths)
    dq, dk, dv = autograd_grads(q, k, v, dout, is_causal=causal, key_lengths=lengths)
    check_tc([dq, dk, dv], refs, peers, info)
    for name, g in (("dk of padding keys", dk[1, :, 70:]), ("dv of padding keys", dv[1, :, 70:]),
                    ("dq of a batch with no keys", dq[2]), ("dk of a batch with no keys", dk[2])):
        assert torch.equal(g, torch.zeros_like(g)), f"{name} must be zeros {info}"


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [0.05, -0.3])
def test_explicit_scale(dtype, scale):
    run_case(dtype, 2, 2, 200, 150, 64, is_causal=True, scale=scale)


@requires_hopper
def test_many_heads_and_batches():
    run_case(torch.float16, 3, 5, 130, 260, 128)


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("H,H_kv", [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_heads(dtype, D, H, H_kv, causal):
    """Grouped-query K/V (GQA, MQA at H_kv = 1) through autograd: dk and dv have k's shape, each
    the sum over the query heads that share it, as float64 autograd through the expanded reference
    has it; lengths that cut the last query and key blocks short, Sq != Sk, a batch's keys padded."""
    B, Sq, Sk = 2, 150, 333
    q, k, v, dout, info = grouped_inputs(B, H, H_kv, Sq, Sk, D, dtype)
    kw = {"is_causal": causal, "key_lengths": torch.tensor([Sk, 200], device="cuda")}
    _, *refs = reference_grads(q, k, v, dout, **kw)
    grads = autograd_grads(q, k, v, dout, **kw)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape, f"dk, dv shapes {info}"
    check_tc(grads, refs, expanded_sdpa_grads(q, k, v, dout, **kw), info)


@requires_hopper
@pytest.mark.parametrize("variant", hopper.BWD_VARIANTS)
def test_grouped_direct_call_matches_expanded_heads(variant):
    """The direct call on grouped K/V against the same call on K/V repeated per query head: dq to
    rounding, dk and dv equal to the expanded call's gradients summed over each group (to rounding:
    the sums run in another order)."""
    q, k, v, dout, info = grouped_inputs(2, 8, 2, 200, 260, 128, torch.bfloat16)
    out, lse = hopper.attention(q, k, v, is_causal=True, return_lse=True)
    grouped = hopper.attention_backward(q, k, v, out, lse, dout, is_causal=True, variant=variant)
    kx, vx = (t.repeat_interleave(4, dim=1) for t in (k, v))
    expanded = hopper.attention_backward(q, kx, vx, out, lse, dout, is_causal=True, variant=variant)
    summed = [g.float().unflatten(1, (2, 4)).sum(2) for g in expanded[1:]]
    assert torch.allclose(grouped[0].float(), expanded[0].float(), rtol=1e-2, atol=1e-3), f"dq {info}"
    for name, got, want in zip(("dk", "dv"), grouped[1:], summed):
        assert_close(got, want, dtype=torch.bfloat16, rel_tol=1e-2, what=name, seed_info=info)


@requires_hopper
def test_large_magnitude_inputs_never_nan():
    q, k, v, dout, info = make_inputs(2, 2, 300, 300, 64, torch.bfloat16)
    q, k = q * 30, k * 30
    grads = autograd_grads(q, k, v, dout, is_causal=True)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient {info}"


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gradient_through_lse(dtype):
    """A loss that uses lse too: d lse_i / d S_ij = P_ij, folded into D_i."""
    q, k, v, dout, info = make_inputs(2, 2, 65, 90, 64, dtype)
    dlse = randn(2, 2, 65, dtype=torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = hopper.attention(*leaves, is_causal=True, return_lse=True)
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()

    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    bias = reference.attention_bias(2, 2, 65, 90, None, True, None, None, q.device)
    scores = (q64 @ k64.transpose(-1, -2)) / math.sqrt(64) + bias
    out64 = torch.softmax(scores, dim=-1) @ v64
    ((out64 * dout.double()).sum() + (torch.logsumexp(scores, dim=-1) * dlse.double()).sum()).backward()
    tol = {torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]  # the mma.sync backward's test's
    for name, got, want in zip(("dq", "dk", "dv"), (t.grad for t in leaves), (q64.grad, k64.grad, v64.grad)):
        assert_close(got, want, dtype=dtype, rel_tol=tol, what=name, seed_info=info)


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_direct_call_matches_autograd(dtype):
    """attention_backward on the forward's out and lse gives autograd's gradients: dK and dV bit for
    bit, dQ to rounding (its atomics add in any order)."""
    q, k, v, dout, info = make_inputs(2, 3, 257, 190, 128, dtype)
    out, lse = hopper.attention(q, k, v, is_causal=True, return_lse=True)
    direct = hopper.attention_backward(q, k, v, out, lse, dout, is_causal=True)
    dq, dk, dv = autograd_grads(q, k, v, dout, is_causal=True)
    assert torch.equal(direct[1], dk) and torch.equal(direct[2], dv), f"dk, dv differ from autograd's {info}"
    assert torch.allclose(direct[0].float(), dq.float(), rtol=1e-2, atol=1e-3), f"dq {info}"


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("variant", hopper.BWD_VARIANTS)
def test_every_variant(dtype, causal, D, variant):
    """Each way of sharing dQ between the warpgroups (BWD_VARIANTS) through the direct call, on
    lengths that cut the last query and key blocks short and pad a batch's keys."""
    B, H, Sq, Sk = 2, 2, 200, 333
    q, k, v, dout, info = make_inputs(B, H, Sq, Sk, D, dtype)
    lengths = torch.tensor([Sk, 150], device="cuda")
    kw = {"is_causal": causal, "key_lengths": lengths}
    out, lse = hopper.attention(q, k, v, return_lse=True, **kw)
    grads = hopper.attention_backward(q, k, v, out, lse, dout, variant=variant, **kw)
    _, *refs = reference_grads(q, k, v, dout, **kw)
    check_tc(grads, refs, sdpa_grads(q, k, v, dout, **kw), f"{info} variant {variant}")


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
def test_views_of_a_packed_projection_are_read_in_place(dtype, D):
    """A transformer's layout: q, k, v views of one [B, S, 3, H, D] projection, O (the forward
    writes it so) and dO views of [B, S, H, D] memory. The op takes them as they are (it rejects
    nothing, copies nothing) and gives the gradients of contiguous copies: dK and dV bit for bit,
    dQ to rounding; through autograd, the projection's gradient matches the reference's."""
    B, H, S = 2, 3, 200
    seed = new_seed()
    qkv = randn(B, S, 3, H, D, dtype=dtype, seed=seed)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    dout = randn(B, S, H, D, dtype=dtype, seed=seed + 1).transpose(1, 2)
    info = f"(seed {seed}, B={B} H={H} S={S} D={D} {dtype})"
    out, lse = hopper.attention(q, k, v, is_causal=True, return_lse=True)
    assert out.stride(1) < out.stride(2), f"O is not in [B, S, H, D] memory: strides {out.stride()}"
    in_place = hopper.load().attention_backward(q, k, v, out, lse, dout, None, True, None, None,
                                                hopper.BWD_DEFAULT_VARIANT)
    copies = hopper.attention_backward(*(x.contiguous() for x in (q, k, v, out)), lse, dout.contiguous(),
                                       is_causal=True)
    assert torch.equal(in_place[1], copies[1]) and torch.equal(in_place[2], copies[2]), f"dk, dv {info}"
    assert torch.allclose(in_place[0].float(), copies[0].float(), rtol=1e-2, atol=1e-3), f"dq {info}"
    leaf = qkv.detach().clone().requires_grad_()
    hopper.attention(*leaf.permute(2, 0, 3, 1, 4), is_causal=True).backward(dout)
    _, *refs = reference_grads(q, k, v, dout, is_causal=True)
    check_tc(leaf.grad.permute(2, 0, 3, 1, 4), refs, sdpa_grads(q, k, v, dout, is_causal=True), info)


@requires_hopper
def test_repeated_calls_agree():
    """The dQ atomics add in any order: two calls agree to rounding, not necessarily bit for bit;
    dK and dV have no atomics and agree exactly."""
    q, k, v, dout, info = make_inputs(2, 2, 500, 500, 64, torch.float16)
    out, lse = hopper.attention(q, k, v, return_lse=True)
    first = hopper.attention_backward(q, k, v, out, lse, dout)
    second = hopper.attention_backward(q, k, v, out, lse, dout)
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2]), info
    assert torch.allclose(first[0].float(), second[0].float(), rtol=1e-2, atol=1e-3), info


@requires_hopper
def test_compiled_training_step():
    """torch.compile(fullgraph=True) of forward + backward through the op and its fake."""
    q, k, v, dout, info = make_inputs(1, 2, 96, 96, 64, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def step(q_, k_, v_):
        return hopper.attention(q_, k_, v_, is_causal=True)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    step(*leaves).backward(dout)
    eager = autograd_grads(q, k, v, dout, is_causal=True)
    for name, got, want in zip(("dq", "dk", "dv"), (t.grad for t in leaves), eager):
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2), f"{name} {info}"


@requires_hopper
def test_bad_inputs_named():
    q, k, v, dout, _ = make_inputs(1, 2, 16, 24, 64, torch.float16)
    out, lse = hopper.attention(q, k, v, return_lse=True)
    q3 = torch.randn(1, 3, 16, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match=r"H=3 must be a multiple of k's KV heads H_kv=2"):
        hopper.attention(q3.requires_grad_(), k, v)
    with pytest.raises(ValueError, match=r"H=3 must be a multiple of k's KV heads H_kv=2"):
        hopper.attention_backward(q3, k, v, q3, lse, q3)
    with pytest.raises(ValueError, match=r"head dim D=96"):
        x = torch.randn(1, 2, 16, 96, device="cuda", dtype=torch.float16)
        hopper.attention_backward(x, x, x, x, lse, x)
    ops = hopper.load()
    with pytest.raises(ValueError, match=r"variant must be one of \(0, 1\)"):
        hopper.attention_backward(q, k, v, out, lse, dout, variant=2)
    with pytest.raises(RuntimeError, match="lse must have shape"):
        ops.attention_backward(q, k, v, out, lse[:, :1], dout, None, False, None, None, 0)
    with pytest.raises(RuntimeError, match="not supported by the Hopper backward"):
        x = torch.randn(1, 2, 16, 96, device="cuda", dtype=torch.float16)
        ops.attention_backward(x, x, x, x, lse, x, None, False, None, None, 0)
    with pytest.raises(RuntimeError, match=r"H=2 must be a multiple of k's KV heads H_kv=3"):
        k3 = torch.randn(1, 3, 24, 64, device="cuda", dtype=torch.float16)
        ops.attention_backward(q, k3, k3, out, lse, dout, None, False, None, None, 0)
    with pytest.raises(RuntimeError, match=r"variant must be 0 \(dQ by keys\) or 1"):
        ops.attention_backward(q, k, v, out, lse, dout, None, False, None, None, 2)
