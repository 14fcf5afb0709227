"""Phase 4 correctness: the suite every three-kernel phase passes (utils/unfused_suite.py), and the
cases this phase's kernels add: the float4 and the scalar paths (D or Sk not a multiple of 4, a
misaligned view), tails (S not a multiple of 128), causal tile skipping, the warp, block and
streaming softmax for rows up to 40001, and index arithmetic past 2^31 under causal masking.

Every check uses fresh random inputs and compares with assert_close (FP32: 2e-5 relative norm plus
an elementwise bound). GPU tests skip without a GPU; the CPU-tensor errors are checked everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

import phase4_coalesced as p4
from utils import reference
from utils.testing import (assert_close, random_additive_mask, random_bool_mask, random_qkv, randn, rel_error,
                           requires_gpu)
from utils.unfused_suite import HEAD_DIMS, SEQ_LENS, UnfusedSuite


class TestCoalesced(UnfusedSuite):
    phase = p4
    op_args = {"matmul_qk": (False,), "matmul_av": (False,)}   # False: every tile, no causal skipping


def _check_attention(B, H, Sq, Sk, D, causal=False, mask=None, scale=None):
    q, k, v = random_qkv(B, H, Sq, Sk, D)
    out = p4.attention(q, k, v, mask=mask, is_causal=causal, scale=scale)
    ref = reference.attention(q, k, v, mask=mask, is_causal=causal, scale=scale)
    assert_close(out, ref, dtype=torch.float32,
                 what=f"attention B={B} H={H} Sq={Sq} Sk={Sk} D={D} causal={causal}")


# ------------------------------------------------------------------------------------------------
# The composition: float4 and scalar paths, tails, causal tile skipping


@requires_gpu
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("S", SEQ_LENS)
def test_attention_every_length_and_head_dim(S, D):
    _check_attention(2, 2, S, S, D, causal=False)
    _check_attention(1, 3, S, S, D, causal=True)


@requires_gpu
@pytest.mark.parametrize("Sq,Sk", [(17, 130), (1000, 127), (128, 1), (1, 1024), (300, 257)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_cross_lengths(Sq, Sk, causal):
    _check_attention(2, 3, Sq, Sk, 64, causal=causal)


@requires_gpu
@pytest.mark.parametrize("D", [1, 3, 5, 33, 127])
def test_attention_odd_head_dims_scalar_path(D):
    _check_attention(1, 2, 130, 131, D, causal=False)
    _check_attention(1, 2, 129, 132, D, causal=True, scale=0.3)


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_large_magnitude_inputs_stay_finite(causal):
    q, k, v = random_qkv(2, 2, 300, 300, 64, scale=50.0)
    out = p4.attention(q, k, v, is_causal=causal)
    assert torch.isfinite(out).all(), "large inputs gave NaN or inf"
    # Scores of about 1e4 carry FP32 rounding of about 1e-3, which the exponentials amplify:
    # compare loosely (the FP32 tolerance holds for inputs of ordinary size).
    assert rel_error(out, reference.attention(q, k, v, is_causal=causal)) < 1e-2


@requires_gpu
def test_misaligned_view_takes_scalar_path():
    """A contiguous view that starts 4 bytes into its storage cannot use float4: still correct."""
    B, H, S, D = 1, 2, 130, 64
    base = randn(B * H * S * D + 1)
    q = base[1:].view(B, H, S, D)
    k, v = randn(B, H, S, D), randn(B, H, S, D)
    assert_close(p4.attention(q, k, v), reference.attention(q, k, v))


@requires_gpu
def test_index_arithmetic_past_2_31_with_causal_skipping():
    """B*H*Sq*Sk > 2^31 with causal tile skipping: checked on a few rows of the first and last head
    (the float64 reference of all would not fit)."""
    B, H, S, D = 1, 9, 16384, 64
    assert B * H * S * S > 2**31
    try:
        q, k, v = random_qkv(B, H, S, S, D)
        out = p4.attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 9.7 GB score buffer")
    rows = torch.tensor([0, 1, 8191, S - 2, S - 1], device="cuda")
    for h in (0, H - 1):
        qh = q[:, h:h + 1, rows]
        scores = (qh.double() @ k[:, h:h + 1].double().transpose(-1, -2)) / math.sqrt(D)
        scores = scores.masked_fill(torch.arange(S, device="cuda") > rows.view(-1, 1), float("-inf"))
        ref = torch.softmax(scores, dim=-1) @ v[:, h:h + 1].double()
        assert_close(out[:, h:h + 1, rows], ref, dtype=torch.float32, what=f"head {h}")
    del q, k, v, out
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Each kernel on its own: float4 and scalar paths, and every softmax path


@requires_gpu
@pytest.mark.parametrize("Sq,Sk,D", [(1, 1, 1), (17, 17, 64), (127, 1000, 80), (1024, 130, 128),
                                     (200, 333, 3), (128, 129, 32)])
def test_matmul_qk_float4_and_scalar_paths(Sq, Sk, D):
    q, k, _ = random_qkv(2, 3, Sq, Sk, D)
    ref = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    magnitude = (q.double().abs() @ k.double().abs().transpose(-1, -2)) / math.sqrt(D)
    assert_close(p4.matmul_qk(q, k), ref, dtype=torch.float32, ref_scale=magnitude)
    assert_close(p4.matmul_qk(q, k, scale=2.5), ref * math.sqrt(D) * 2.5, dtype=torch.float32,
                 ref_scale=magnitude * math.sqrt(D) * 2.5)


@requires_gpu
@pytest.mark.parametrize("Sk", [1, 17, 127, 128, 1000, 1030, 2048, 5000, 9000, 20000, 40001])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_every_row_length(Sk, causal):
    B, H, Sq = 1, 2, 3 if Sk > 4096 else 37
    s = randn(B, H, Sq, Sk, scale=3.0)
    bias = reference.attention_bias(B, H, Sq, Sk, is_causal=causal, device="cuda")
    assert_close(p4.softmax(s, is_causal=causal), reference.softmax(s.double() + bias),
                 dtype=torch.float32, what=f"softmax Sk={Sk} causal={causal}")


@requires_gpu
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("Sk", [17, 1000, 3001])
def test_softmax_masks(kind, Sk):
    B, H, Sq = 2, 2, 19
    s = randn(B, H, Sq, Sk)
    mask = random_bool_mask((1, H, Sq, Sk)) if kind == "bool" else random_additive_mask((Sq, Sk))
    bias = reference.attention_bias(B, H, Sq, Sk, mask=mask, is_causal=True, device="cuda")
    assert_close(p4.softmax(s, mask=mask, is_causal=True), reference.softmax(s.double() + bias),
                 dtype=torch.float32)


@requires_gpu
@pytest.mark.parametrize("Sq,Sk,D", [(1, 1, 1), (17, 17, 64), (127, 1000, 80), (1024, 130, 128),
                                     (200, 333, 3), (300, 4, 64)])
def test_matmul_av_float4_and_scalar_paths(Sq, Sk, D):
    p = torch.softmax(randn(2, 3, Sq, Sk), dim=-1)
    _, _, v = random_qkv(2, 3, Sq, Sk, D)
    assert_close(p4.matmul_av(p, v), p.double() @ v.double(), dtype=torch.float32,
                 ref_scale=p.double().abs() @ v.double().abs())
