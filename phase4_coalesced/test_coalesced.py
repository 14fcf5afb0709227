"""Phase 4 correctness: each kernel and the composition against utils.reference in float64.

Every check uses fresh random inputs and compares with assert_close (FP32: 2e-5 relative norm
plus an elementwise bound); the kernels write into fresh buffers, so the float4 and the scalar
paths (D or Sk not a multiple of 4), the tails (S not a multiple of 128) and causal tile skipping
are all exercised. GPU tests skip without a GPU; the CPU-tensor error test runs everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

import phase4_coalesced as p4
from utils import reference
from utils.testing import (assert_close, poison_, random_additive_mask, random_bool_mask, random_qkv,
                           randn, rel_error, requires_gpu)

SEQ_LENS = (1, 17, 127, 128, 1000, 1024)
HEAD_DIMS = (32, 64, 80, 128)


def _check_attention(B, H, Sq, Sk, D, causal=False, mask=None, scale=None):
    q, k, v = random_qkv(B, H, Sq, Sk, D)
    out = p4.attention(q, k, v, mask=mask, is_causal=causal, scale=scale)
    ref = reference.attention(q, k, v, mask=mask, is_causal=causal, scale=scale)
    assert_close(out, ref, dtype=torch.float32,
                 what=f"attention B={B} H={H} Sq={Sq} Sk={Sk} D={D} causal={causal}")


# ------------------------------------------------------------------------------------------------
# The composition


@requires_gpu
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("S", SEQ_LENS)
def test_attention_matches_reference(S, D):
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
@pytest.mark.parametrize("mask_shape", ["full", "query_key", "batch_broadcast", "key_only"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_masks(mask_shape, kind, causal):
    B, H, Sq, Sk, D = 2, 3, 127, 200, 64
    shape = {"full": (B, H, Sq, Sk), "query_key": (Sq, Sk), "batch_broadcast": (1, H, Sq, Sk),
             "key_only": (B, 1, 1, Sk)}[mask_shape]
    mask = random_bool_mask(shape) if kind == "bool" else random_additive_mask(shape)
    _check_attention(B, H, Sq, Sk, D, causal=causal, mask=mask)


@requires_gpu
@pytest.mark.parametrize("Sk", [17, 128, 1000])
def test_fully_masked_rows_give_zeros(Sk):
    B, H, Sq, D = 2, 2, 33, 64
    q, k, v = random_qkv(B, H, Sq, Sk, D)
    mask = random_bool_mask((B, H, Sq, Sk))
    mask[:, :, ::3] = False  # every third query sees nothing
    out = p4.attention(q, k, v, mask=mask)
    assert torch.equal(out[:, :, ::3], torch.zeros_like(out[:, :, ::3]))
    assert_close(out, reference.attention(q, k, v, mask=mask))
    additive = torch.zeros(B, H, Sq, Sk, device="cuda")
    additive[:, :, 1] = float("-inf")
    out = p4.attention(q, k, v, mask=additive, is_causal=True)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert_close(out, reference.attention(q, k, v, mask=additive, is_causal=True))


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_large_magnitude_inputs_stay_finite(causal):
    q, k, v = random_qkv(2, 2, 300, 300, 64, scale=50.0)
    out = p4.attention(q, k, v, is_causal=causal)
    assert torch.isfinite(out).all(), "large inputs gave NaN or inf"
    # Scores of about 1e4 carry FP32 rounding of about 1e-3, which the exponentials amplify:
    # compare loosely (the FP32 tolerance holds for inputs of ordinary size above).
    assert rel_error(out, reference.attention(q, k, v, is_causal=causal)) < 1e-2


@requires_gpu
def test_non_contiguous_inputs_work():
    # [B, S, H, D] tensors seen as [B, H, S, D] by transposing: not contiguous.
    q, k, v = (randn(2, 64, 3, 32).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    assert_close(p4.attention(q, k, v), reference.attention(q, k, v))


@requires_gpu
def test_misaligned_view_takes_scalar_path():
    """A contiguous view that starts 4 bytes into its storage cannot use float4: still correct."""
    B, H, S, D = 1, 2, 130, 64
    base = randn(B * H * S * D + 1)
    q = base[1:].view(B, H, S, D)
    k, v = randn(B, H, S, D), randn(B, H, S, D)
    assert_close(p4.attention(q, k, v), reference.attention(q, k, v))


@requires_gpu
def test_index_arithmetic_past_2_31():
    """B*H*Sq*Sk > 2^31: checked on a few rows (the float64 reference of all would not fit)."""
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
# Each kernel on its own


@requires_gpu
@pytest.mark.parametrize("Sq,Sk,D", [(1, 1, 1), (17, 17, 64), (127, 1000, 80), (1024, 130, 128),
                                     (200, 333, 3), (128, 129, 32)])
def test_matmul_qk(Sq, Sk, D):
    q, k, _ = random_qkv(2, 3, Sq, Sk, D)
    ref = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    magnitude = (q.double().abs() @ k.double().abs().transpose(-1, -2)) / math.sqrt(D)
    assert_close(p4.matmul_qk(q, k), ref, dtype=torch.float32, ref_scale=magnitude)
    assert_close(p4.matmul_qk(q, k, scale=2.5), ref * math.sqrt(D) * 2.5, dtype=torch.float32,
                 ref_scale=magnitude * math.sqrt(D) * 2.5)


@requires_gpu
@pytest.mark.parametrize("Sk", [1, 17, 127, 128, 1000, 1030, 2048, 5000, 9000, 20000, 40001])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax(Sk, causal):
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
def test_matmul_av(Sq, Sk, D):
    p = torch.softmax(randn(2, 3, Sq, Sk), dim=-1)
    _, _, v = random_qkv(2, 3, Sq, Sk, D)
    assert_close(p4.matmul_av(p, v), p.double() @ v.double(), dtype=torch.float32,
                 ref_scale=p.double().abs() @ v.double().abs())


@requires_gpu
def test_kernels_compose_like_attention():
    q, k, v = random_qkv(2, 2, 130, 257, 64)
    mask = random_bool_mask((130, 257))
    out = p4.matmul_av(p4.softmax(p4.matmul_qk(q, k), mask=mask), v)
    assert_close(out, reference.attention(q, k, v, mask=mask))


@requires_gpu
def test_outputs_are_fresh_buffers():
    """The ops allocate their outputs; poisoning an earlier result must not leak into the next."""
    q, k, v = random_qkv(1, 2, 64, 64, 64)
    first = p4.attention(q, k, v)
    poison_(first)
    assert_close(p4.attention(q, k, v), reference.attention(q, k, v))


# ------------------------------------------------------------------------------------------------
# Bad input


def test_cpu_tensor_is_rejected_naming_the_argument():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        p4.attention(q, q, q)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        p4.matmul_qk(q, q)
    with pytest.raises(ValueError, match="s must be a CUDA tensor"):
        p4.softmax(q)
    with pytest.raises(ValueError, match="p must be a CUDA tensor"):
        p4.matmul_av(q, q)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_wrong_dtype_is_rejected(dtype):
    q, k, v = (t.to(dtype) for t in random_qkv(1, 1, 8, 8, 16))
    with pytest.raises(TypeError, match="q must have dtype float32"):
        p4.attention(q, k, v)
    with pytest.raises(TypeError, match="s must have dtype float32"):
        p4.softmax(q)
    with pytest.raises(TypeError, match="p must have dtype float32"):
        p4.matmul_av(q, v)


@requires_gpu
def test_mismatched_shapes_are_rejected():
    q, k, v = random_qkv(2, 2, 8, 8, 16)
    with pytest.raises(ValueError, match="k must be"):
        p4.attention(q, k[:, :, :, :8], v)
    with pytest.raises(ValueError, match="k must be"):
        p4.attention(q, k[:1], v)
    with pytest.raises(ValueError, match="v must have k's shape"):
        p4.attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="k must be"):
        p4.matmul_qk(q, k[..., :8])
    with pytest.raises(ValueError, match="v must be"):
        p4.matmul_av(torch.rand(2, 2, 8, 5, device="cuda"), v)
    with pytest.raises(ValueError, match="q must be 4-D"):
        p4.attention(q[0], k, v)


@requires_gpu
def test_wrong_mask_shape_is_rejected():
    q, k, v = random_qkv(2, 2, 8, 12, 16)
    with pytest.raises(ValueError, match="mask of shape"):
        p4.attention(q, k, v, mask=torch.ones(8, 8, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="mask of shape"):
        p4.softmax(randn(2, 2, 8, 12), mask=torch.ones(3, 1, 1, 12, dtype=torch.bool, device="cuda"))


@requires_gpu
@pytest.mark.parametrize("D", [129, 256])
def test_unsupported_head_dim_is_rejected(D):
    q, k, v = random_qkv(1, 1, 8, 8, D)
    with pytest.raises(ValueError, match=f"head dim D={D}"):
        p4.attention(q, k, v)
    with pytest.raises(ValueError, match=f"head dim D={D}"):
        p4.matmul_qk(q, k)
    with pytest.raises(ValueError, match=f"head dim D={D}"):
        p4.matmul_av(torch.rand(1, 1, 8, 8, device="cuda"), v)


@requires_gpu
def test_op_level_checks_name_the_argument():
    """The C++ ops check again (for callers that bypass the Python API)."""
    ops = p4.load()
    q, k, v = random_qkv(1, 1, 8, 8, 16)
    with pytest.raises(RuntimeError, match="k must be"):
        ops.matmul_qk(q, k[..., :8].contiguous(), 1.0, False)
    with pytest.raises(RuntimeError, match="head dim D=200"):
        ops.matmul_av(torch.rand(1, 1, 8, 8, device="cuda"), torch.rand(1, 1, 8, 200, device="cuda"), False)
    with pytest.raises(RuntimeError, match="s must be float32"):
        ops.softmax(q.double(), None, False)
