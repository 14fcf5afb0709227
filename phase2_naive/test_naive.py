"""Phase 2 correctness: each naive kernel and their composition against utils.reference (float64).

GPU tests skip without a GPU; the CPU-tensor errors are checked everywhere (no build needed).
"""

import math

import pytest
import torch

import phase2_naive as ph
from utils import reference
from utils.testing import (assert_close, poisoned_call, random_additive_mask, random_bool_mask,
                           random_qkv, randn, rel_error, requires_gpu, shape_ids, UNFUSED_SHAPES)

SHAPES = UNFUSED_SHAPES


# ------------------------------------------------------------------------------------------------
# Errors that need no GPU


def test_cpu_tensors_are_rejected_naming_the_argument():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        ph.attention(q, q, q)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        ph.matmul_qk(q, q)
    with pytest.raises(ValueError, match="s must be a CUDA tensor"):
        ph.softmax(q)
    with pytest.raises(ValueError, match="p must be a CUDA tensor"):
        ph.matmul_av(q, q)


# ------------------------------------------------------------------------------------------------
# Each kernel on its own


@requires_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_ids(SHAPES))
def test_matmul_qk(shape):
    B, H, Sq, Sk, D = shape
    q, k, _ = random_qkv(B, H, Sq, Sk, D)
    scale = 0.37
    s = poisoned_call(lambda: ph.matmul_qk(q, k, scale=scale), (B, H, Sq, Sk))
    ref = scale * (q.double() @ k.double().transpose(-1, -2))
    magnitude = scale * (q.double().abs() @ k.double().abs().transpose(-1, -2))
    assert_close(s, ref, what="matmul_qk", ref_scale=magnitude)
    # Default scale 1/sqrt(D).
    assert_close(ph.matmul_qk(q, k), ref / scale / math.sqrt(D), what="matmul_qk default scale",
                 ref_scale=magnitude / scale / math.sqrt(D))


@requires_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_ids(SHAPES))
@pytest.mark.parametrize("masking", ["none", "causal", "bool", "additive", "causal+bool"])
def test_softmax(shape, masking):
    B, H, Sq, Sk, _ = shape
    s = randn(B, H, Sq, Sk, scale=3.0)
    mask = _mask(masking, B, H, Sq, Sk)
    causal = masking.startswith("causal")
    p = poisoned_call(lambda: ph.softmax(s, mask=mask, is_causal=causal), (B, H, Sq, Sk))
    bias = reference.attention_bias(B, H, Sq, Sk, mask, causal, device=s.device)
    assert_close(p, reference.softmax(s.double() + bias), what=f"softmax ({masking})")


@requires_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_ids(SHAPES))
def test_matmul_av(shape):
    B, H, Sq, Sk, D = shape
    p = torch.softmax(randn(B, H, Sq, Sk, scale=2.0), dim=-1)
    v = randn(B, H, Sk, D)
    o = poisoned_call(lambda: ph.matmul_av(p, v), (B, H, Sq, D))
    assert_close(o, p.double() @ v.double(), what="matmul_av", ref_scale=p.double().abs() @ v.double().abs())


# ------------------------------------------------------------------------------------------------
# The composition


def _mask(kind: str, B, H, Sq, Sk):
    if kind.endswith("bool"):
        return random_bool_mask((B, 1, Sq, Sk))          # broadcast over heads
    if kind == "additive":
        return random_additive_mask((Sq, Sk))            # broadcast over batch and heads
    return None


@requires_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_ids(SHAPES))
@pytest.mark.parametrize("masking", ["none", "causal", "bool", "additive", "causal+bool"])
def test_attention(shape, masking):
    B, H, Sq, Sk, D = shape
    q, k, v = random_qkv(B, H, Sq, Sk, D)
    mask = _mask(masking, B, H, Sq, Sk)
    causal = masking.startswith("causal")
    out = poisoned_call(lambda: ph.attention(q, k, v, mask=mask, is_causal=causal), (B, H, Sq, Sk), (B, H, Sq, D))
    ref = reference.attention(q, k, v, mask=mask, is_causal=causal)
    assert_close(out, ref, what=f"attention ({masking})")


@requires_gpu
def test_attention_scale_mask_shapes_and_noncontiguous():
    B, H, Sq, Sk, D = 2, 3, 33, 45, 64
    q, k, v = random_qkv(B, H, Sq, Sk, D)
    for mask in (random_bool_mask((Sk,)), random_additive_mask((1, H, 1, Sk)),
                 random_bool_mask((B, H, Sq, Sk)), random_additive_mask((B, 1, Sq, 1)).double()):
        out = ph.attention(q, k, v, mask=mask, scale=0.2)
        assert_close(out, reference.attention(q, k, v, mask=mask, scale=0.2), what=f"mask {tuple(mask.shape)}")
    # Non-contiguous q (a transposed view) is made contiguous by the API.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    assert_close(ph.attention(qt, k, v), reference.attention(q, k, v), what="non-contiguous q")


@requires_gpu
def test_fully_masked_rows_give_zeros():
    B, H, Sq, Sk, D = 2, 2, 40, 33, 64
    q, k, v = random_qkv(B, H, Sq, Sk, D)
    mask = random_bool_mask((B, H, Sq, Sk))
    mask[:, :, ::3] = False                      # every third query row sees nothing
    additive = torch.zeros(B, H, Sq, Sk, device="cuda").masked_fill(~mask, float("-inf"))
    for m in (mask, additive):
        out = ph.attention(q, k, v, mask=m)
        assert torch.equal(out[:, :, ::3], torch.zeros_like(out[:, :, ::3]))
        assert_close(out, reference.attention(q, k, v, mask=m), what="fully masked rows")
        p = ph.softmax(randn(B, H, Sq, Sk), mask=m)
        assert torch.equal(p[:, :, ::3], torch.zeros_like(p[:, :, ::3]))


@requires_gpu
def test_large_magnitude_inputs_never_nan():
    # Softmax of huge scores: exact inputs, so the tolerance stays tight.
    s = randn(2, 2, 64, 300, scale=1e4)
    p = ph.softmax(s, is_causal=True)
    assert torch.isfinite(p).all()
    assert_close(p, reference.softmax(s.double() + reference.attention_bias(2, 2, 64, 300, is_causal=True,
                                                                            device=s.device)), what="softmax 1e4")
    # Attention on inputs 10x the usual size: scores about 100, rounding of q.k in FP32 grows
    # with |q||k|, so the bound is looser (the kernel is not the cause: cuBLAS does the same).
    q, k, v = random_qkv(2, 2, 100, 130, 64, scale=10.0)
    out = ph.attention(q, k, v, is_causal=True)
    assert torch.isfinite(out).all()
    assert rel_error(out, reference.attention(q, k, v, is_causal=True)) < 1e-3


@requires_gpu
def test_poisoning_reaches_the_outputs():
    """The harness itself: a buffer allocated right after poisoned_call() freed one of its size is NaN."""
    shape = (1, 2, 37, 29)
    assert torch.isnan(poisoned_call(lambda: torch.empty(shape, device="cuda"), shape)).all()


@requires_gpu
def test_grid_limits_many_heads_and_long_sequences():
    # B*H above the 65535 grid-z limit and Sq/8 above the 65535 grid-y limit.
    q, k, v = random_qkv(1, 65537, 3, 2, 8)
    assert_close(ph.attention(q, k, v), reference.attention(q, k, v), what="B*H = 65537")
    q, k, v = random_qkv(1, 1, 600_001, 3, 8)
    assert_close(ph.attention(q, k, v, is_causal=True), reference.attention(q, k, v, is_causal=True),
                 what="Sq = 600001")


@requires_gpu
def test_score_buffer_past_2_pow_31_elements():
    B, H, S, D = 1, 2, 32_800, 32                 # B*H*S*S = 2.15e9 > 2^31
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    q, k, v = random_qkv(B, H, S, S, D)
    out = ph.attention(q, k, v)
    # The last rows of the last head live past element 2^31 of the score buffer.
    tail = reference.attention(q[:, :, -5:], k, v)
    assert_close(out[:, :, -5:], tail, what="rows past 2^31")
    del out
    torch.cuda.empty_cache()


@requires_gpu
def test_fake_implementations_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = ph.load()
    with FakeTensorMode():
        q = torch.empty(2, 3, 5, 16, device="cuda")
        k = torch.empty(2, 3, 7, 16, device="cuda")
        assert ops.matmul_qk(q, k, 0.25).shape == (2, 3, 5, 7)
        assert ops.softmax(torch.empty(2, 3, 5, 7, device="cuda"), None, True).shape == (2, 3, 5, 7)
        assert ops.matmul_av(torch.empty(2, 3, 5, 7, device="cuda"), k).shape == (2, 3, 5, 16)
        assert ops.attention(q, k, k, None, False, 0.25).shape == (2, 3, 5, 16)


# ------------------------------------------------------------------------------------------------
# Bad input: each error names the argument


@requires_gpu
def test_bad_inputs_name_the_argument():
    q, k, v = random_qkv(1, 2, 8, 8, 32)
    with pytest.raises(TypeError, match="q"):
        ph.attention(q.double(), k, v)
    with pytest.raises(TypeError, match="k"):
        ph.attention(q, k.half(), v)
    with pytest.raises(ValueError, match="k"):
        ph.attention(q, k[..., :16].contiguous(), v)
    with pytest.raises(ValueError, match="v"):
        ph.attention(q, k, v[:, :, :4].contiguous())
    with pytest.raises(ValueError, match="mask"):
        ph.attention(q, k, v, mask=torch.ones(3, 8, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="D=129"):
        big = randn(1, 1, 4, 129)
        ph.attention(big, big, big)
    with pytest.raises(ValueError, match="k"):
        ph.matmul_qk(q, k[:, :1].contiguous())
    with pytest.raises(TypeError, match="k"):
        ph.matmul_qk(q, k.double())
    with pytest.raises(ValueError, match="s"):
        ph.softmax(randn(2, 8, 8))
    with pytest.raises(ValueError, match="mask"):
        ph.softmax(randn(1, 2, 8, 8), mask=torch.ones(2, 2, 8, 8, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="v"):
        ph.matmul_av(randn(1, 2, 8, 8), randn(1, 2, 7, 32))
    with pytest.raises(TypeError, match="p"):
        ph.matmul_av(randn(1, 2, 8, 8).half(), v)
    # The C++ op checks again (direct callers of torch.ops get a message naming the argument).
    ops = ph.load()
    with pytest.raises(RuntimeError, match="k must have q's head dim"):
        ops.attention(q, k[..., :16].contiguous(), v[..., :16].contiguous(), None, False, 1.0)
    with pytest.raises(RuntimeError, match="v must be"):
        ops.matmul_av(randn(1, 2, 8, 8), randn(1, 2, 7, 32))
