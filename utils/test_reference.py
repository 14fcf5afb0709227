"""The float64 reference against torch's own math (CPU, float64): masks, causal, stride, Sq != Sk."""

import math

import pytest
import torch
import torch.nn.functional as F

from utils import reference


def qkv(B, H, Sq, Sk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Sq, D, generator=g, dtype=torch.float64),
            torch.randn(B, H, Sk, D, generator=g, dtype=torch.float64),
            torch.randn(B, H, Sk, D, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("Sq,Sk", [(1, 1), (17, 17), (5, 33), (33, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_math(Sq, Sk, causal):
    q, k, v = qkv(2, 3, Sq, Sk, 16)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = reference.attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_bool_and_additive_masks_match_sdpa():
    q, k, v = qkv(2, 2, 9, 13, 8)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(2, 1, 9, 13, generator=g) < 0.7
    keep[..., 0] = True  # every row keeps a key, so SDPA's output is defined
    torch.testing.assert_close(reference.attention(q, k, v, mask=keep),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    bias = torch.randn(9, 13, generator=g, dtype=torch.float64)
    torch.testing.assert_close(reference.attention(q, k, v, mask=bias),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


def test_scale_is_applied():
    q, k, v = qkv(1, 1, 4, 6, 8)
    torch.testing.assert_close(reference.attention(q, k, v, scale=0.3),
                               F.scaled_dot_product_attention(q, k, v, scale=0.3))


def test_fully_masked_rows_are_zero_and_lse_neg_inf():
    q, k, v = qkv(1, 2, 4, 6, 8)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[2] = False
    out, lse = reference.attention(q, k, v, mask=keep, return_lse=True)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.isneginf(lse[:, :, 2]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, [0, 1, 3]]).all()


@pytest.mark.parametrize("stride", [1, 2, 3, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_stride_equals_explicit_mask(stride, causal):
    q, k, v = qkv(1, 2, 20, 20, 8)
    i, j = torch.arange(20).view(-1, 1), torch.arange(20).view(1, -1)
    keep = (j % stride == 0) & ((j <= i) if causal else True)
    torch.testing.assert_close(reference.attention(q, k, v, stride=stride, is_causal=causal),
                               reference.attention(q, k, v, mask=keep))


def test_key_lengths_equal_padding_mask():
    q, k, v = qkv(3, 2, 7, 10, 8)
    lengths = torch.tensor([10, 4, 1])
    keep = (torch.arange(10).view(1, 1, 1, 10) < lengths.view(3, 1, 1, 1))
    torch.testing.assert_close(reference.attention(q, k, v, key_lengths=lengths),
                               reference.attention(q, k, v, mask=keep))


def test_lse_matches_logsumexp():
    q, k, v = qkv(1, 1, 5, 7, 4)
    _, lse = reference.attention(q, k, v, return_lse=True)
    expected = torch.logsumexp(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1)
    torch.testing.assert_close(lse, expected)


def test_stride_below_one_is_rejected():
    q, k, v = qkv(1, 1, 2, 2, 4)
    with pytest.raises(ValueError, match="stride"):
        reference.attention(q, k, v, stride=0)


@pytest.mark.parametrize("H_kv", [1, 2, 6])
def test_grouped_kv_heads_match_sdpa_and_the_expanded_heads(H_kv):
    """k, v with H_kv heads: query head h reads KV head h // (H // H_kv)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 9, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, H_kv, 13, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, H_kv, 13, 8, generator=g, dtype=torch.float64)
    out = reference.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               rtol=1e-12, atol=1e-12)
    for h in range(6):
        kv = h // (6 // H_kv)
        torch.testing.assert_close(out[:, h], reference.attention(q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1],
                                                                  is_causal=True)[:, 0], rtol=0, atol=0)


def test_grouped_kv_heads_must_divide_the_query_heads():
    q, k, v = qkv(1, 4, 3, 3, 8)
    with pytest.raises(ValueError, match=r"H=4 must be a multiple of k's KV heads H_kv=3 \(k.shape\[1\]\)"):
        reference.attention(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="k and v must be"):
        reference.attention(q, k[:, :2], v)


@pytest.mark.parametrize("window", [1, 2, 5, 40])
@pytest.mark.parametrize("Sq,Sk", [(20, 20), (7, 30), (30, 7)])
def test_window_equals_explicit_mask(window, Sq, Sk):
    """window w (with causal): query i sees keys i - w < j <= i, top-left aligned like causal."""
    q, k, v = qkv(1, 2, Sq, Sk, 8)
    i, j = torch.arange(Sq).view(-1, 1), torch.arange(Sk).view(1, -1)
    keep = (j <= i) & (j > i - window)
    out, lse = reference.attention(q, k, v, is_causal=True, window=window, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, mask=keep, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_window_is_checked():
    q, k, v = qkv(1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="window=3 needs is_causal=True"):
        reference.attention(q, k, v, window=3)
    for window in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an integer >= 1"):
            reference.attention(q, k, v, is_causal=True, window=window)


def test_attention_grads_of_grouped_heads_sum_over_the_group():
    """dk, dv of a shared KV head: the sum of the expanded heads' gradients (and dq the same)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64)
    dq, dk, dv = reference.attention_grads(q, k, v, dout, is_causal=True, window=3)
    eq, ek, ev = reference.attention_grads(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), dout,
                                           is_causal=True, window=3)
    assert dk.shape == k.shape and dv.shape == v.shape
    torch.testing.assert_close(dq, eq)
    torch.testing.assert_close(dk, ek.view(1, 2, 2, 7, 8).sum(2))
    torch.testing.assert_close(dv, ev.view(1, 2, 2, 7, 8).sum(2))


def test_softmax_of_masked_row_is_zero():
    s = torch.tensor([[1.0, 2.0], [float("-inf"), float("-inf")]])
    p = reference.softmax(s)
    torch.testing.assert_close(p[0], torch.softmax(s[0].double(), -1))
    assert torch.equal(p[1], torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_torch(approximate):
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    torch.testing.assert_close(reference.gelu(x, approximate), F.gelu(x, approximate=approximate))


def test_layer_norm_matches_torch_and_survives_offsets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 33, generator=g, dtype=torch.float64)
    w, b = torch.randn(33, generator=g, dtype=torch.float64), torch.randn(33, generator=g, dtype=torch.float64)
    torch.testing.assert_close(reference.layer_norm(x, w, b), F.layer_norm(x, (33,), w, b))
    shifted = reference.layer_norm(x + 1e4, w, b)
    torch.testing.assert_close(shifted, F.layer_norm(x, (33,), w, b), rtol=1e-8, atol=1e-8)


def test_layer_norm_with_residual_normalizes_the_sum():
    x, r = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(reference.layer_norm(x, residual=r), F.layer_norm(x + r, (8,)))


def test_mlp_matches_torch_modules():
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(16, 64).double(), torch.nn.Linear(64, 16).double()
    x, res = torch.randn(5, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    expected = fc2(F.gelu(fc1(x), approximate="tanh")) + res
    torch.testing.assert_close(reference.mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, residual=res),
                               expected.detach())


def paged_copy(cache, lengths, page_size, seed=0):
    """A contiguous cache [B, H_kv, S, D] scattered into shuffled pages [num_pages, H_kv, page_size, D]
    (two spare pages of NaN that no sequence uses) and its page table; unused entries are -1."""
    B, H_kv, S, D = cache.shape
    max_pages = -(-S // page_size)
    num_pages = B * max_pages + 2
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    pages = torch.full((num_pages, H_kv, page_size, D), float("nan"), dtype=cache.dtype)
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    padded = torch.nn.functional.pad(cache, (0, 0, 0, max_pages * page_size - S))
    for b in range(B):
        for p in range(-(-int(lengths[b]) // page_size)):
            physical = int(order[b * max_pages + p])
            table[b, p] = physical
            pages[physical] = padded[b, :, p * page_size:(p + 1) * page_size]
    return pages, table


def test_decode_attention_matches_a_loop_over_sequences_and_heads():
    """GQA heads and the bottom-right causal rule, against a plain per-(b, h, i) softmax."""
    B, H, H_kv, Sq, S, D = 3, 6, 2, 3, 11, 8
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, Sq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    lengths = torch.tensor([3, 7, 11], dtype=torch.int32)
    out, lse = reference.decode_attention(q, k, v, lengths, scale=0.3, return_lse=True)
    for b in range(B):
        for h in range(H):
            for i in range(Sq):
                last = int(lengths[b]) - Sq + i  # the last key query i sees
                kv = h // (H // H_kv)
                s = 0.3 * (k[b, kv, :last + 1] @ q[b, h, i])
                torch.testing.assert_close(out[b, h, i], torch.softmax(s, 0) @ v[b, kv, :last + 1], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(lse[b, h, i], torch.logsumexp(s, 0), rtol=1e-12, atol=1e-12)


def test_decode_attention_of_a_full_cache_is_sdpa_with_gqa():
    B, H, H_kv, S, D = 2, 8, 2, 9, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out = reference.decode_attention(q, k, v, torch.full((B,), S, dtype=torch.int32))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("page_size", [2, 4, 16])
def test_decode_attention_paged_equals_contiguous(page_size):
    """The same cache paged (shuffled pages, NaN in the unused ones) gives the same result."""
    B, H, H_kv, Sq, S, D = 3, 4, 4, 2, 13, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, H, Sq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    lengths = torch.tensor([2, 13, 6], dtype=torch.int32)
    k_pages, table = paged_copy(k, lengths, page_size)
    v_pages, _ = paged_copy(v, lengths, page_size)
    expected = reference.decode_attention(q, k, v, lengths)
    out = reference.decode_attention(q, k_pages, v_pages, lengths, page_table=table)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
