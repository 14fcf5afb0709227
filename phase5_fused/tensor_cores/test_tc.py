"""Tests of the tensor-core fused attention (phase5_fused.tensor_cores): FP16 and BF16 against the float64
reference, within the dtype's tolerance (5e-3 FP16, 1e-2 BF16, relative norm) and no worse than
twice torch SDPA's error in the same dtype on the same inputs. Outputs are poisoned (NaN) first.
Head dims: HEAD_DIMS or MAIN_HEAD_DIMS in the grids (padded D < Dp and unpadded D = Dp among them),
EVERY_INSTANCE once for each compiled instance. The lesson's versions (tc.VERSIONS other than the
fast kernel) on their own grid, at the end. GPU tests skip without a GPU; the CPU-tensor and
unsupported-D errors are checked everywhere.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from phase5_fused import tensor_cores as tc
from utils import reference
from utils.testing import (assert_close, new_seed, poisoned_like, random_additive_mask, random_bool_mask,
                           randn, rel_error, requires_gpu)

DTYPES = (torch.float16, torch.bfloat16)
TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
# SDPA's error can be ~0 (S = 1: the output is v itself); below this the 2x rule is not applied.
SDPA_FLOOR = 1e-5
# A representative head dim for each tile head dim Dp (tc_attention.cu runs D on the tiles of the next
# multiple of 32): 8 (the smallest), 40, 80 (the common one) and 208 padded (D < Dp), the others not.
HEAD_DIMS = (8, 40, 64, 80, 96, 128, 160, 192, 208, 256)
# The larger grids: the headline sizes, the common padded one and the largest; OTHER_HEAD_DIMS the rest.
MAIN_HEAD_DIMS = (64, 80, 128, 256)
OTHER_HEAD_DIMS = tuple(d for d in HEAD_DIMS if d not in MAIN_HEAD_DIMS)
# One padded and one unpadded D per tile head dim Dp: together every compiled instance.
EVERY_INSTANCE = tuple(d for dp in tc.TILE_D for d in (dp - 16, dp))


def make_qkv(B, H, Sq, Sk, D, dtype, scale=1.0, H_kv=None):
    seed = new_seed()
    H_kv = H if H_kv is None else H_kv
    q = randn(B, H, Sq, D, dtype=dtype, scale=scale, seed=seed)
    k = randn(B, H_kv, Sk, D, dtype=dtype, scale=scale, seed=seed + 1)
    v = randn(B, H_kv, Sk, D, dtype=dtype, scale=scale, seed=seed + 2)
    return q, k, v, f"(seed {seed}, B={B} H={H} H_kv={H_kv} Sq={Sq} Sk={Sk} D={D} {dtype})"


def run_tc(q, k, v, **kwargs):
    out = poisoned_like(q)
    tc.attention(q, k, v, out=out, **kwargs)
    return out


def sdpa_error(q, k, v, ref, mask=None, is_causal=False, scale=None, key_lengths=None, window=None) -> float:
    """torch SDPA's relative error in q's dtype against the same float64 reference. Masks, padding
    and the window become one additive bias in q's dtype; grouped k, v are expanded per query head;
    fully masked rows (NaN in some backends) count as the zeros the reference defines."""
    B, H, Sq, _ = q.shape
    if k.shape[1] != H:
        k, v = (t.repeat_interleave(H // k.shape[1], dim=1) for t in (k, v))
    if mask is None and key_lengths is None and window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    else:
        bias = reference.attention_bias(B, H, Sq, k.shape[2], mask, is_causal, None, key_lengths, q.device,
                                        window=window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale)
    return rel_error(out.nan_to_num(0.0), ref)


def check(q, k, v, info, mask=None, is_causal=False, scale=None, key_lengths=None, window=None,
          version=tc.DEFAULT_VERSION) -> float:
    """Run the kernel (one of tc.VERSIONS) on poisoned output, compare with the reference and with SDPA's error."""
    out = run_tc(q, k, v, mask=mask, is_causal=is_causal, scale=scale, key_lengths=key_lengths, window=window,
                 version=version)
    ref = reference.attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, key_lengths=key_lengths,
                              window=window)
    err = assert_close(out, ref, dtype=q.dtype, rel_tol=TOL[q.dtype], seed_info=info)
    peer = sdpa_error(q, k, v, ref, mask, is_causal, scale, key_lengths, window)
    assert err <= 2 * peer + SDPA_FLOOR, f"rel error {err:.3e} is over twice SDPA's {peer:.3e} {info}"
    return err


# ------------------------------------------------------------------------------------------------
# Correctness


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", MAIN_HEAD_DIMS)
@pytest.mark.parametrize("S", [1, 17, 128, 1000, 4096])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_square_grid(S, D, dtype, causal):
    B, H = (1, 2) if S >= 4096 else (2, 3)
    q, k, v, info = make_qkv(B, H, S, S, D, dtype)
    check(q, k, v, info, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("Sq,Sk", [(1, 300), (300, 1), (77, 1000), (1000, 77), (130, 64), (64, 130)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cross_lengths(Sq, Sk, D, causal):
    q, k, v, info = make_qkv(2, 2, Sq, Sk, D, torch.float16)
    check(q, k, v, info, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("D", OTHER_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_other_head_dims_bf16(D, causal):
    q, k, v, info = make_qkv(2, 2, 200, 321, D, torch.bfloat16)
    check(q, k, v, info, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", MAIN_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_padding(D, dtype, causal):
    Sq, Sk = 200, 300
    q, k, v, info = make_qkv(5, 2, Sq, Sk, D, dtype)
    # no key, one key, a tail inside a block, exactly a block edge, longer than Sk (= all keys)
    lengths = torch.tensor([0, 1, 131, 192, Sk + 10], device="cuda", dtype=torch.int64)
    check(q, k, v, info, is_causal=causal, key_lengths=lengths)
    out = run_tc(q, k, v, is_causal=causal, key_lengths=lengths.to(torch.int32))
    assert torch.equal(out[0], torch.zeros_like(out[0])), f"batch with no keys must be zeros {info}"


@requires_gpu
def test_key_padding_ignores_padded_values():
    """Padded keys and values are never used: NaN there must not reach the output."""
    q, k, v, info = make_qkv(2, 2, 90, 150, 64, torch.float16)
    lengths = torch.tensor([70, 150], device="cuda", dtype=torch.int32)
    expected = run_tc(q, k, v, key_lengths=lengths)
    k[0, :, 70:] = float("nan")
    v[0, :, 70:] = float("nan")
    out = run_tc(q, k, v, key_lengths=lengths)
    assert torch.equal(out, expected), f"padding leaked into the output {info}"


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", MAIN_HEAD_DIMS)
@pytest.mark.parametrize("kind", ["bool", "bool_broadcast", "additive", "additive_broadcast"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_masks(kind, D, dtype, causal):
    B, H, Sq, Sk = 2, 3, 150, 333
    q, k, v, info = make_qkv(B, H, Sq, Sk, D, dtype)
    shape = {"bool": (B, H, Sq, Sk), "bool_broadcast": (Sq, Sk), "additive": (B, H, Sq, Sk),
             "additive_broadcast": (B, 1, Sq, Sk)}[kind]
    if kind.startswith("bool"):
        mask = random_bool_mask(shape)
        mask[..., 5, :] = False  # a fully masked row
    else:
        mask = random_additive_mask(shape)
        mask[..., 7, :] = float("-inf")
    lengths = torch.tensor([Sk, 200], device="cuda")
    check(q, k, v, info, mask=mask, is_causal=causal, key_lengths=lengths)
    out = run_tc(q, k, v, mask=mask, is_causal=causal, key_lengths=lengths)
    row = 5 if kind.startswith("bool") else 7
    assert torch.equal(out[..., row, :], torch.zeros_like(out[..., row, :])), f"masked row not zeros {info}"


@requires_gpu
@pytest.mark.parametrize("D", OTHER_HEAD_DIMS)
def test_mask_other_head_dims(D):
    q, k, v, info = make_qkv(2, 2, 70, 90, D, torch.float16)
    check(q, k, v, info, mask=random_bool_mask((2, 2, 70, 90)), is_causal=True)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", EVERY_INSTANCE)
def test_every_instance(D, dtype):
    """Each compiled instance once (dtype, tile head dim, padded or not, mask, window): causal with key
    padding, a mask with a fully masked row, and a window over grouped heads with and without a mask;
    Sq, Sk in no tile's multiple."""
    B, H, Sq, Sk = 3, 4, 150, 333
    q, k, v, info = make_qkv(B, H, Sq, Sk, D, dtype, H_kv=2)
    k_full, v_full = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    lengths = torch.tensor([Sk, 140, 0], device="cuda")
    mask = random_bool_mask((B, 1, Sq, Sk))
    mask[..., 5, :] = False
    check(q, k_full, v_full, info, is_causal=True, key_lengths=lengths)
    check(q, k_full, v_full, info, mask=mask, key_lengths=lengths)
    check(q, k, v, info, is_causal=True, window=70)
    check(q, k, v, info, mask=mask, is_causal=True, key_lengths=lengths, window=70)


def inside_nan_tail(x: torch.Tensor, tail: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """x's values as a contiguous view at the start of a buffer whose last `tail` elements are NaN:
    (the view, the tail)."""
    buffer = torch.full((x.numel() + tail,), float("nan"), dtype=x.dtype, device=x.device)
    view = buffer[: x.numel()].view_as(x).copy_(x)
    return view, buffer[x.numel():]


@requires_gpu
@pytest.mark.parametrize("D", [8, 80, 208, 248])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_columns_stay_inside_the_rows(D, causal):
    """A padded D (< Dp) reads and writes only its D columns: NaN right after the last row of q, k
    and v (where a read of columns D..Dp-1 would land) cannot reach the output, and the NaN after the
    output's last row stays untouched."""
    q, k, v, info = make_qkv(1, 1, 37, 45, D, torch.float16)
    (q_in, _), (k_in, _), (v_in, _) = (inside_nan_tail(t) for t in (q, k, v))
    out, out_tail = inside_nan_tail(poisoned_like(q))
    tc.attention(q_in, k_in, v_in, is_causal=causal, out=out)
    ref = reference.attention(q, k, v, is_causal=causal)
    assert_close(out, ref, dtype=q.dtype, rel_tol=TOL[q.dtype], seed_info=info)
    assert torch.isnan(out_tail).all(), f"the kernel wrote past the output's last row {info}"


@requires_gpu
@pytest.mark.parametrize("dtype,magnitude", [(torch.float16, 100.0), (torch.bfloat16, 1000.0)],
                         ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", MAIN_HEAD_DIMS)
def test_large_magnitude(dtype, magnitude, D):
    q, k, v, info = make_qkv(2, 2, 300, 300, D, dtype, scale=magnitude)
    out = run_tc(q, k, v, is_causal=True)
    assert torch.isfinite(out).all(), f"inf/NaN for inputs of magnitude {magnitude} {info}"
    ref = reference.attention(q, k, v, is_causal=True)
    assert_close(out, ref, dtype=dtype, rel_tol=TOL[dtype], seed_info=info)


@requires_gpu
@pytest.mark.parametrize("growth", ["rising", "falling"])
@pytest.mark.parametrize("D", (64, 128))
def test_running_max_rising_and_falling_across_key_blocks(growth, D):
    """Lazy rescaling: keys scaled by a ramp, so each row's scores grow from block to block by
    more than the kernel's threshold (the max is raised, O rescaled, again and again) or shrink
    (the first block's max is kept to the end)."""
    q, k, v, info = make_qkv(2, 3, 130, 700, D, torch.float16)
    ramp = torch.linspace(0.1, 40.0, k.shape[2], device=k.device, dtype=torch.float32)  # a block: ~13 log2 units
    ramp = ramp if growth == "rising" else ramp.flip(0)
    k = (k.float() * ramp[:, None]).to(k.dtype)
    for causal in (False, True):
        check(q, k, v, info + f" {growth} causal={causal}", is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("scale", [0.05, 1.0, -0.3, 0.0, 1e-50])
@pytest.mark.parametrize("D", [64, 128])
def test_explicit_scale(scale, D):
    """The fast path takes the row max of unscaled scores, which needs c = scale log2 e > 0: the host
    turns a negative scale into -q, and one that is zero in FP32 (0.0, 1e-50) into a zero q."""
    q, k, v, info = make_qkv(2, 2, 129, 257, D, torch.float16)
    check(q, k, v, info, scale=scale)
    check(q, k, v, info + " causal", scale=scale, is_causal=True)


@requires_gpu
def test_negative_scale_with_mask():
    """The mask instance scales before the max; with a negative scale it gets -q too."""
    q, k, v, info = make_qkv(2, 2, 129, 257, 64, torch.bfloat16)
    check(q, k, v, info, mask=random_additive_mask((2, 1, 129, 257)), scale=-0.3)


@requires_gpu
def test_many_heads_and_batches():
    q, k, v, info = make_qkv(48, 40, 17, 33, 64, torch.bfloat16)
    check(q, k, v, info, is_causal=True)


@requires_gpu
def test_non_contiguous_and_misaligned_inputs():
    B, H, S, D = 2, 3, 100, 64
    q, k, v, info = make_qkv(B, H, S, S, D, torch.float16)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, S, D] view of a [B, S, H, D] tensor
    assert not q_t.is_contiguous()
    flat = torch.empty(k.numel() + 1, dtype=k.dtype, device="cuda")
    k_off = flat[1:].view_as(k).copy_(k)  # 2 bytes past a 16-byte boundary
    assert k_off.data_ptr() % 16 != 0
    out = tc.attention(q_t, k_off, v)
    ref = reference.attention(q, k, v)
    assert_close(out, ref, dtype=torch.float16, rel_tol=TOL[torch.float16], seed_info=info)


@requires_gpu
def test_repeated_calls_agree():
    """No state leaks between calls (and no race): the same inputs give the same bits."""
    q, k, v, info = make_qkv(2, 4, 1000, 1000, 128, torch.float16)
    first = run_tc(q, k, v, is_causal=True)
    for _ in range(3):
        assert torch.equal(run_tc(q, k, v, is_causal=True), first), info


@requires_gpu
def test_fake_tensor_shapes():
    """The registered fake implementations (for torch.compile) give q's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = tc.load()
    with FakeTensorMode():
        q = torch.empty(2, 3, 17, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 3, 40, 64, dtype=torch.bfloat16, device="cuda")
        out = ops.attention(q, k, k, None, True, 0.125, None)
        out_version = ops.attention_version(q, k, k, True, 0.125, 4)  # the lesson's versions' op
    assert out.shape == out_version.shape == (2, 3, 17, 64) and out.dtype == out_version.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# Grouped-query attention and sliding windows

HEADS = [(8, 8), (8, 2), (8, 1)]  # (H, H_kv): multi-head, grouped-query, multi-query


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("H,H_kv", HEADS)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(H, H_kv, D, dtype, causal):
    """k, v with H_kv heads against the float64 reference, Sq != Sk."""
    q, k, v, info = make_qkv(2, H, 150, 333, D, dtype, H_kv=H_kv)
    check(q, k, v, info, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("H_kv", [2, 1])
@pytest.mark.parametrize("D", MAIN_HEAD_DIMS)
def test_gqa_reads_the_group_kv_head(H_kv, D):
    """The grouped call computes exactly what the kernel computes on K, V expanded per query head
    (the same arithmetic, bit for bit): query head h reads KV head h // (H // H_kv)."""
    q, k, v, info = make_qkv(2, 8, 130, 257, D, torch.float16, H_kv=H_kv)
    expanded = run_tc(q, k.repeat_interleave(8 // H_kv, 1), v.repeat_interleave(8 // H_kv, 1), is_causal=True)
    assert torch.equal(run_tc(q, k, v, is_causal=True), expanded), info


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("window", [1, 17, 128, 1000])
@pytest.mark.parametrize("S", [1, 33, 200, 1031])
@pytest.mark.parametrize("H,H_kv", [(8, 8), (8, 2)])
def test_window(window, S, H, H_kv, dtype):
    q, k, v, info = make_qkv(1, H, S, S, 128, dtype, H_kv=H_kv)
    check(q, k, v, info, is_causal=True, window=window)


@requires_gpu
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("Sq,Sk", [(300, 200), (150, 400), (1, 300), (257, 257)])
@pytest.mark.parametrize("window", [1, 63, 100])
def test_window_every_head_dim_and_cross_lengths(D, Sq, Sk, window):
    q, k, v, info = make_qkv(1, 4, Sq, Sk, D, torch.float16, H_kv=2)
    check(q, k, v, info, is_causal=True, window=window)


@requires_gpu
@pytest.mark.parametrize("D", MAIN_HEAD_DIMS)
def test_window_with_mask_and_key_lengths(D):
    """The window combines with a mask and key padding (a batch with no key gives zeros)."""
    B, H, Sq, Sk = 3, 4, 260, 300
    q, k, v, info = make_qkv(B, H, Sq, Sk, D, torch.bfloat16, H_kv=1)
    mask = random_bool_mask((B, 1, Sq, Sk))
    lengths = torch.tensor([Sk, 90, 0], device="cuda")
    check(q, k, v, info, mask=mask, is_causal=True, key_lengths=lengths, window=50)
    check(q, k, v, info, is_causal=True, key_lengths=lengths, window=50)
    out = run_tc(q, k, v, mask=mask, is_causal=True, key_lengths=lengths, window=50)
    assert torch.equal(out[2], torch.zeros_like(out[2])), info


@requires_gpu
def test_window_rows_past_their_keys_are_zero():
    """Sq > Sk, top-left causal with a window: row i >= Sk + window - 1 sees no key and gives zeros."""
    q, k, v, info = make_qkv(1, 2, 300, 100, 64, torch.float16)
    check(q, k, v, info, is_causal=True, window=40)
    out = run_tc(q, k, v, is_causal=True, window=40)
    assert torch.equal(out[:, :, 139:], torch.zeros_like(out[:, :, 139:])), info


@requires_gpu
@pytest.mark.parametrize("D", MAIN_HEAD_DIMS)
def test_gqa_window_lse(D):
    q, k, v, info = make_qkv(2, 4, 200, 200, D, torch.float16, H_kv=2)
    out, lse = tc.attention(q, k, v, is_causal=True, window=33, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, is_causal=True, window=33, return_lse=True)
    assert_close(out, ref, dtype=q.dtype, rel_tol=TOL[q.dtype], seed_info=info)
    err = (lse.double() - ref_lse).abs().max().item()
    assert err <= 1e-4 * max(1.0, ref_lse.abs().max().item()), f"lse max abs error {err:.3e} {info}"


@requires_gpu
def test_grouped_heads_and_window_record_a_gradient():
    q, k, v, info = make_qkv(1, 4, 16, 24, 64, torch.float16, H_kv=2)
    assert tc.attention(q.requires_grad_(), k, v, is_causal=True, window=4).requires_grad
    with torch.no_grad():
        check(q, k, v, info, is_causal=True, window=4)


@requires_gpu
def test_gqa_window_op_checks():
    """The C++ op checks the head grouping and the window itself."""
    ops = tc.load()
    q, k, v, _ = make_qkv(1, 4, 16, 24, 64, torch.float16, H_kv=3)
    with pytest.raises(RuntimeError, match="KV heads H_kv=3"):
        ops.attention(q, k, v, None, False, 0.125, None)
    q, k, v, _ = make_qkv(1, 4, 16, 24, 64, torch.float16, H_kv=2)
    with pytest.raises(RuntimeError, match="window"):
        ops.attention(q, k, v, None, False, 0.125, None, 4)  # window without causal
    with pytest.raises(RuntimeError, match="window"):
        ops.attention_lse(q, k, v, None, True, 0.125, None, -1)


@requires_gpu
def test_gqa_window_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = tc.load()
    with FakeTensorMode():
        q = torch.empty(2, 8, 17, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(2, 2, 40, 64, dtype=torch.float16, device="cuda")
        out, lse = ops.attention_lse(q, k, k, None, True, 0.125, None, 16)
    assert out.shape == q.shape and lse.shape == (2, 8, 17)


def test_gqa_window_bad_arguments_rejected_without_gpu():
    q = torch.randn(1, 8, 4, 64, dtype=torch.float16)
    k = torch.randn(1, 3, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"multiple of k's KV heads H_kv=3 \(k.shape\[1\]\)"):
        tc.attention(q, k, k)
    for window in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="window must be an integer >= 1"):
            tc.attention(q, q, q, is_causal=True, window=window)
    with pytest.raises(ValueError, match="window=8 needs is_causal=True"):
        tc.attention(q, q, q, window=8)


# ------------------------------------------------------------------------------------------------
# Bad input: clear errors that name the argument


def test_cpu_tensor_rejected_without_gpu():
    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        tc.attention(q, q, q)


@pytest.mark.parametrize("D", [4, 12, 100, 264])
def test_unsupported_head_dim_rejected_without_gpu(D):
    q = torch.randn(1, 1, 8, D, dtype=torch.float16)
    with pytest.raises(ValueError, match=rf"head dim D={D} \(q.shape\[-1\]\) is not supported: use a multiple of "
                                         "8 from 8 to 256"):
        tc.attention(q, q, q)


def test_tile_head_dims_are_the_launchers():
    """TILE_D is the list of Dp tc_attention.cu launches, and SUPPORTED_D is what they cover."""
    source = (Path(tc.__file__).parent / "tc_attention.cu").read_text()
    assert tuple(int(d) for d in re.findall(r"launch_for_padding<(\d+)>\(p, D", source)) == tc.TILE_D
    assert tc.SUPPORTED_D == tuple(d for d in range(1, tc.TILE_D[-1] + 1) if d % 8 == 0)


def test_bad_flags_rejected_without_gpu():
    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="is_causal"):
        tc.attention(q, q, q, is_causal="yes")
    with pytest.raises(ValueError, match="scale"):
        tc.attention(q, q, q, scale=math.inf)


def test_import_builds_nothing():
    """Importing the module (and the phase package) must not build or load the extension."""
    import subprocess
    import sys

    from utils.build import REPO_ROOT

    proc = subprocess.run([sys.executable, "-c", "import phase5_fused.tensor_cores; from utils.build import LOADED_OPS; assert not LOADED_OPS"],
                          cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@requires_gpu
def test_bad_inputs_named():
    q, k, v, _ = make_qkv(1, 2, 16, 24, 64, torch.float16)
    with pytest.raises(TypeError, match="q must have dtype float16, bfloat16, got float32"):
        tc.attention(q.float(), k.float(), v.float())
    with pytest.raises(TypeError, match="q, k, v must share a dtype"):
        tc.attention(q, k.to(torch.bfloat16), v)
    with pytest.raises(ValueError, match=r"D=12 \(q.shape\[-1\]\)"):
        x = torch.randn(1, 2, 16, 12, device="cuda", dtype=torch.float16)
        tc.attention(x, x, x)
    with pytest.raises(ValueError, match="k must be"):
        tc.attention(q, k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match="v must have k's shape"):
        tc.attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="mask"):
        tc.attention(q, k, v, mask=torch.ones(3, 16, 24, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="key_lengths"):
        tc.attention(q, k, v, key_lengths=torch.tensor([1, 2], device="cuda"))
    with pytest.raises(TypeError, match="key_lengths"):
        tc.attention(q, k, v, key_lengths=torch.tensor([1.0], device="cuda"))
    with pytest.raises(TypeError, match="out"):
        tc.attention(q, k, v, out=torch.empty_like(q, dtype=torch.float32))
    with pytest.raises(ValueError, match="scale"):
        tc.attention(q, k, v, scale=math.inf)


@requires_gpu
def test_op_checks_name_the_argument():
    """The C++ op validates again (for callers that bypass the Python API)."""
    ops = tc.load()
    q, k, v, _ = make_qkv(1, 2, 16, 24, 64, torch.float16)
    with pytest.raises(RuntimeError, match="q must be float16 or bfloat16"):
        ops.attention(q.float(), k.float(), v.float(), None, False, 0.125, None)
    for D in (12, 264):
        x = torch.randn(1, 2, 16, D, device="cuda", dtype=torch.float16)
        with pytest.raises(RuntimeError, match=rf"head dim D={D} \(q.size\(3\)\) is not supported: use a multiple "
                                               "of 8 from 8 to 256"):
            ops.attention(x, x, x, None, False, 0.125, None)
    with pytest.raises(RuntimeError, match="q must be contiguous"):
        ops.attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, None, False, 0.125, None)
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    with pytest.raises(RuntimeError, match="q must start at a 16-byte aligned address"):
        ops.attention(flat[1:].view_as(q), k, v, None, False, 0.125, None)
    with pytest.raises(RuntimeError, match="key_lengths must be \\[B\\]"):
        ops.attention(q, k, v, None, False, 0.125, torch.tensor([1, 2], device="cuda"))


# ------------------------------------------------------------------------------------------------
# The row logsumexp (return_lse=True, op attention_lse): what the backward pass recomputes P from


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse(D, dtype, causal):
    """lse against torch.logsumexp of the float64 scores; -inf exactly where a row sees no key."""
    B, H, Sq, Sk = 3, 2, 150, 333
    q, k, v, info = make_qkv(B, H, Sq, Sk, D, dtype)
    mask = random_bool_mask((B, 1, Sq, Sk))
    mask[..., 5, :] = False
    lengths = torch.tensor([Sk, 200, 0], device="cuda")
    out, lse = tc.attention(q, k, v, mask=mask, is_causal=causal, key_lengths=lengths, return_lse=True)
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    scores = scores + reference.attention_bias(B, H, Sq, Sk, mask, causal, None, lengths, q.device)
    ref = torch.logsumexp(scores, dim=-1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), f"-inf rows differ {info}"
    finite = torch.isfinite(ref)
    err = (lse.double() - ref)[finite].abs().max().item()
    assert err <= 1e-4 * max(1.0, ref[finite].abs().max().item()), f"lse max abs error {err:.3e} {info}"
    # The same kernel computes out with or without lse.
    assert torch.equal(out, tc.attention(q, k, v, mask=mask, is_causal=causal, key_lengths=lengths)), info


@requires_gpu
def test_lse_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = tc.load()
    with FakeTensorMode():
        q = torch.empty(2, 3, 17, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(2, 3, 40, 64, dtype=torch.float16, device="cuda")
        out, lse = ops.attention_lse(q, k, k, None, True, 0.125, None)
    assert out.shape == q.shape and lse.shape == (2, 3, 17) and lse.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# The lesson's versions (tc.VERSIONS, README "Versions"): the headline problem only, every compiled
# instance (version x dtype x D) causal and not, at sizes that are no multiple of a tile, S = 1,
# Sq < Sk and Sq > Sk.

LESSON_VERSIONS = tuple(name for name in tc.VERSIONS if name != tc.DEFAULT_VERSION)
VERSION_SHAPES = [(2, 3, 1, 1), (2, 3, 77, 200), (2, 3, 300, 129), (2, 3, 256, 256)]


@requires_gpu
@pytest.mark.parametrize("B,H,Sq,Sk", VERSION_SHAPES, ids=[f"Sq{s[2]}_Sk{s[3]}" for s in VERSION_SHAPES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", tc.VERSION_D)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("version", LESSON_VERSIONS)
def test_version(version, dtype, D, causal, B, H, Sq, Sk):
    q, k, v, info = make_qkv(B, H, Sq, Sk, D, dtype)
    check(q, k, v, info, is_causal=causal, version=version)


@requires_gpu
@pytest.mark.parametrize("version", LESSON_VERSIONS)
def test_version_scale_and_magnitude(version):
    """An explicit (negative) scale, and FP16 inputs of magnitude 100: finite, within tolerance."""
    q, k, v, info = make_qkv(2, 2, 129, 257, 64, torch.float16)
    check(q, k, v, info, scale=-0.3, version=version)
    q, k, v, info = make_qkv(2, 2, 300, 300, 128, torch.float16, scale=100.0)
    out = run_tc(q, k, v, is_causal=True, version=version)
    assert torch.isfinite(out).all(), f"inf/NaN for inputs of magnitude 100 {info}"
    assert_close(out, reference.attention(q, k, v, is_causal=True), dtype=q.dtype, rel_tol=TOL[q.dtype],
                 seed_info=info)


@requires_gpu
@pytest.mark.parametrize("D", tc.VERSION_D)
@pytest.mark.parametrize("version", LESSON_VERSIONS)
def test_version_reads_and_writes_only_its_rows(version, D):
    """NaN right after the last row of q, k and v cannot reach the output (no read past them), and the
    NaN after the output's last row stays (rows past Sq are never stored)."""
    q, k, v, info = make_qkv(1, 1, 37, 45, D, torch.float16)
    (q_in, _), (k_in, _), (v_in, _) = (inside_nan_tail(t) for t in (q, k, v))
    out, out_tail = inside_nan_tail(poisoned_like(q))
    tc.attention(q_in, k_in, v_in, is_causal=True, out=out, version=version)
    assert_close(out, reference.attention(q, k, v, is_causal=True), dtype=q.dtype, rel_tol=TOL[q.dtype],
                 seed_info=info)
    assert torch.isnan(out_tail).all(), f"the kernel wrote past the output's last row {info}"


@requires_gpu
def test_versions_refuse_grad_by_name():
    q, k, v, info = make_qkv(1, 2, 16, 24, 64, torch.float16)
    for name in ("q", "k", "v"):
        inputs = {"q": q, "k": k, "v": v}
        inputs[name] = inputs[name].clone().requires_grad_()
        with pytest.raises(ValueError, match=rf"{name} requires grad, but version='v2_ldmatrix' is forward only"):
            tc.attention(**inputs, version="v2_ldmatrix")
    with torch.no_grad():
        check(q.requires_grad_(), k, v, info, version="v2_ldmatrix")


@requires_gpu
def test_version_op_checks_name_the_argument():
    """The C++ op validates again (for callers that bypass the Python API)."""
    ops = tc.load()
    q, k, v, _ = make_qkv(1, 2, 16, 24, 64, torch.float16)
    for number in (0, len(LESSON_VERSIONS) + 1):
        with pytest.raises(RuntimeError, match=f"version must be 1 to {len(LESSON_VERSIONS)}"):
            ops.attention_version(q, k, v, False, 0.125, number)
    x = torch.randn(1, 2, 16, 96, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"head dim D=96 \(q.size\(3\)\) is not supported by version 3"):
        ops.attention_version(x, x, x, False, 0.125, 3)
    with pytest.raises(RuntimeError, match="k must have q's batch and heads"):
        ops.attention_version(q, k[:, :1], v[:, :1], False, 0.125, 1)
    with pytest.raises(RuntimeError, match="out must have q's shape"):
        ops.attention_version_out(q, k, v, False, 0.125, 1, torch.empty_like(k))


def test_version_names_rejected_without_gpu():
    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"version must be one of \('v1_mma', .*'fast'\), got 'v9'"):
        tc.attention(q, q, q, version="v9")


@pytest.mark.parametrize("version", LESSON_VERSIONS)
def test_version_unsupported_arguments_rejected_without_gpu(version):
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    for D in (32, 80, 96, 256):
        x = torch.randn(1, 1, 8, D, dtype=torch.float16)
        with pytest.raises(ValueError, match=rf"head dim D={D} \(q.shape\[-1\]\) is not supported by "
                                             rf"version='{version}': use one of \(64, 128\)"):
            tc.attention(x, x, x, version=version)
    unsupported = {"mask": {"mask": torch.ones(8, 8, dtype=torch.bool)},
                   "key_lengths": {"key_lengths": torch.tensor([8])},
                   "window": {"is_causal": True, "window": 4}, "return_lse": {"return_lse": True}}
    for name, kwargs in unsupported.items():
        with pytest.raises(ValueError, match=rf"{name} is not supported by version='{version}': only the fast kernel"):
            tc.attention(q, q, q, version=version, **kwargs)
    with pytest.raises(ValueError, match=r"k must be \[B=1, H=2, Sk, D=64\]"):  # no grouped heads
        tc.attention(q, q[:, :1], q[:, :1], version=version)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        tc.attention(q, q, q, version=version)


def test_versions_are_the_sources_and_launchers():
    """tc.VERSIONS names, in order, the sources tc_<name>.cu of versions 1-6 (all in SOURCES) and the
    launchers of tc_versions.h, then the fast kernel; the default is the fast kernel."""
    import inspect

    here = Path(tc.__file__).parent
    header = (here / "tc_versions.h").read_text()
    launchers = re.search(r"kVersionLaunchers\[\] = \{([^}]*)\}", header).group(1)
    assert [name.strip() for name in launchers.split(",")] == [f"launch_tc_{v}" for v in LESSON_VERSIONS]
    assert all(f"tc_{v}.cu" in tc.SOURCES and (here / f"tc_{v}.cu").exists() for v in LESSON_VERSIONS)
    assert tc.VERSIONS[-1] == tc.DEFAULT_VERSION == "fast"
    assert inspect.signature(tc.attention).parameters["version"].default == "fast"
