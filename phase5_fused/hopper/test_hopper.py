"""Tests of the Hopper attention kernels (phase5_fused.hopper): every version, FP16 and BF16, against
the float64 reference within the dtype's tolerance (5e-3 FP16, 1e-2 BF16, relative norm) and no
worse than twice torch SDPA's error on the same inputs; lse against the float64 logsumexp. The
op's outputs land in freed NaN-filled memory first (an element the kernel forgets stays NaN).
GPU tests skip without a GPU, and on a GPU that is not sm_90 (the kernels are sm_90a only); the
validation that needs no GPU runs everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from phase5_fused import hopper
from utils import reference
from utils.testing import assert_close, new_seed, outputs_across_streams_and_graphs, randn, rel_error, requires_gpu

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# SDPA's error can be ~0 (S = 1: the output is v itself); below this the 2x rule is not applied.
SDPA_FLOOR = 1e-5
LSE_TOL = 1e-4  # relative norm, FP32 statistics


def _hopper_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != hopper.HOPPER:
        return f"needs a Hopper GPU (sm_90): this GPU is sm_{major}{minor} (TMA and wgmma are sm_90a only)"
    return None


requires_hopper = pytest.mark.skipif(_hopper_reason() is not None, reason=_hopper_reason() or "")


def make_qkv(B, H, Sq, Sk, D, dtype, scale=1.0, H_kv=None):
    """q [B, H, Sq, D], k and v [B, H_kv, Sk, D] (H_kv defaults to H)."""
    seed = new_seed()
    H_kv = H if H_kv is None else H_kv
    q = randn(B, H, Sq, D, dtype=dtype, scale=scale, seed=seed)
    k = randn(B, H_kv, Sk, D, dtype=dtype, scale=scale, seed=seed + 1)
    v = randn(B, H_kv, Sk, D, dtype=dtype, scale=scale, seed=seed + 2)
    return q, k, v, f"(seed {seed}, B={B} H={H} H_kv={H_kv} Sq={Sq} Sk={Sk} D={D} {dtype})"


def run(q, k, v, **kwargs):
    """The op, its outputs allocated where NaN bytes (0xFF: NaN in FP16, BF16 and FP32) were just freed."""
    B, H, Sq, D = q.shape
    sizes = [q.numel() * q.element_size(), B * H * Sq * 4]
    buffers = [torch.full((n,), 255, dtype=torch.uint8, device="cuda") for n in sizes]
    del buffers
    return hopper.attention(q, k, v, **kwargs)


def sdpa_error(q, k, v, ref, is_causal=False, scale=None, key_lengths=None) -> float:
    """torch SDPA's relative error in q's dtype against the same float64 reference (padding as an
    additive bias; fully masked rows, NaN in some backends, count as the reference's zeros). Grouped
    K/V are expanded per query head for it."""
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    if key_lengths is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    else:
        B, H, Sq, _ = q.shape
        bias = reference.attention_bias(B, H, Sq, k.shape[2], None, is_causal, None, key_lengths, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale)
    return rel_error(out.nan_to_num(0.0), ref)


def check(q, k, v, info, version=hopper.DEFAULT_VERSION, is_causal=False, scale=None, key_lengths=None):
    """Run one version with lse, compare out and lse with the float64 reference and with SDPA."""
    out, lse = run(q, k, v, is_causal=is_causal, scale=scale, key_lengths=key_lengths, return_lse=True,
                   version=version)
    ref, ref_lse = reference.attention(q, k, v, is_causal=is_causal, scale=scale, key_lengths=key_lengths,
                                       return_lse=True)
    info = f"{version} {info}"
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3], info
    err = assert_close(out, ref, dtype=q.dtype, rel_tol=TOL[q.dtype], seed_info=info)
    assert_close(lse, ref_lse, dtype=torch.float32, rel_tol=LSE_TOL, what="lse", seed_info=info)
    peer = sdpa_error(q, k, v, ref, is_causal, scale, key_lengths)
    assert err <= 2 * peer + SDPA_FLOOR, f"rel error {err:.3e} is over twice SDPA's {peer:.3e} {info}"
    return err


def check_grouped(q, k, v, info, version, causal, key_lengths):
    """check() on grouped K/V, and the bits of the same call on K/V expanded per query head."""
    check(q, k, v, info, version, is_causal=causal, key_lengths=key_lengths)
    grouped = run(q, k, v, is_causal=causal, version=version)
    expanded = run(q, *(x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v)), is_causal=causal,
                   version=version)
    assert torch.equal(grouped, expanded), f"grouped K/V differ from expanded K/V {info}"


# ------------------------------------------------------------------------------------------------
# Correctness


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("dtype", hopper.DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("S", [1, 17, 127, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_square_grid(S, D, dtype, causal, version):
    q, k, v, info = make_qkv(2, 3, S, S, D, dtype)
    check(q, k, v, info, version, is_causal=causal)


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence(D, causal, version):
    """S = 4096: 32 key blocks through the 2-stage ring (every stage reused 16 times)."""
    dtype = torch.bfloat16 if D == 64 else torch.float16
    q, k, v, info = make_qkv(1, 2, 4096, 4096, D, dtype)
    check(q, k, v, info, version, is_causal=causal)


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("Sq,Sk", [(1, 300), (300, 1), (77, 1000), (1000, 77), (130, 64), (64, 130), (200, 129)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cross_lengths(Sq, Sk, D, causal, version):
    q, k, v, info = make_qkv(2, 2, Sq, Sk, D, torch.float16)
    check(q, k, v, info, version, is_causal=causal)


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("dtype", hopper.DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_padding(D, dtype, causal, version):
    Sq, Sk = 200, 300
    q, k, v, info = make_qkv(7, 2, Sq, Sk, D, dtype)
    # no key, one key, a tail inside a block, exactly a block edge (128, 256), longer than Sk (= all
    # keys), a tail in the third block (a stage's second fill: the padded block's parity is 1)
    lengths = torch.tensor([0, 1, 131, 128, 256, Sk + 10, 290], device="cuda", dtype=torch.int64)
    check(q, k, v, info, version, is_causal=causal, key_lengths=lengths)
    out, lse = run(q, k, v, is_causal=causal, key_lengths=lengths.to(torch.int32), return_lse=True, version=version)
    assert torch.equal(out[0], torch.zeros_like(out[0])), f"batch with no keys must be zeros {info}"
    assert torch.isneginf(lse[0]).all(), f"batch with no keys must have lse = -inf {info}"
    assert torch.isfinite(lse[1:]).all(), f"rows with a visible key must have a finite lse {info}"


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
def test_key_padding_ignores_padded_values(D, version):
    """Padded keys and values are read by TMA but never used: NaN there must not reach the output."""
    q, k, v, info = make_qkv(2, 2, 90, 300, D, torch.float16)
    lengths = torch.tensor([70, 200], device="cuda", dtype=torch.int32)
    expected = run(q, k, v, key_lengths=lengths, version=version)
    k[0, :, 70:] = float("nan")
    v[0, :, 70:] = float("nan")
    k[1, :, 200:] = float("inf")
    v[1, :, 200:] = float("nan")
    out = run(q, k, v, key_lengths=lengths, version=version)
    assert torch.equal(out, expected), f"padding leaked into the output {version} {info}"


@requires_hopper
@pytest.mark.parametrize("dtype", hopper.DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("D,H", [(64, 25), (128, 17)])
def test_split_tail_after_whole_tiles(D, H, dtype):
    """v7 with whole tiles and a split tail in one grid. On a 132-SM H100 at B=1, D=64 has 150 tiles
    of 192 rows (132 whole, the other 18 in 7 pieces each) and D=128 136 tiles of 128 rows (4 in 8
    pieces); at B=3 key padding leaves some pieces with no key block, and one batch with no key."""
    q, k, v, info = make_qkv(3, H, 1000, 1000, D, dtype)
    lengths = torch.tensor([1000, 0, 390], device="cuda", dtype=torch.int32)
    check(q[:1], k[:1], v[:1], info, "v7_split_tail")
    check(q, k, v, info, "v7_split_tail", key_lengths=lengths)


@requires_hopper
@pytest.mark.parametrize("dtype", hopper.DTYPES, ids=DTYPE_IDS.get)
def test_stream_k_tail_after_whole_rounds(dtype):
    """v8 at D=128 with whole rounds and a Stream-K tail in one grid. On a 132-SM H100 at B=1, H=29,
    S=1000 there are 232 tiles of 8 key blocks: one whole round, and 100 tiles cut into 132 shares of
    6 blocks (pieces of two tiles per share at most); at B=3, H=10 key padding of 390 keys leaves
    the pieces past a tile's fourth block without a block, and one batch has no key."""
    q, k, v, info = make_qkv(1, 29, 1000, 1000, 128, dtype)
    check(q, k, v, info, "v8_stream_k")
    q, k, v, info = make_qkv(3, 10, 1000, 1000, 128, dtype)
    lengths = torch.tensor([1000, 0, 390], device="cuda", dtype=torch.int32)
    check(q, k, v, info, "v8_stream_k", key_lengths=lengths)


# Calls of the versions that cut tiles along the keys, at shapes where they cut on a 132-SM H100:
# v7's at both D; v8's at D = 128 (at D = 64 it runs v7).
CUT_CASES = [("v7_split_tail", 64, 2, 3), ("v7_split_tail", 128, 2, 3), ("v8_stream_k", 128, 1, 29)]


@requires_hopper
@pytest.mark.parametrize("version,D,B,H", CUT_CASES)
def test_split_tail_is_deterministic(version, D, B, H):
    """The pieces of a tile finish in any order, and the one that finishes last merges: the merge
    runs in piece order, so repeated calls give the same bits."""
    q, k, v, info = make_qkv(B, H, 1000, 1000, D, torch.float16)
    first, first_lse = run(q, k, v, return_lse=True, version=version)
    for _ in range(5):
        out, lse = run(q, k, v, return_lse=True, version=version)
        assert torch.equal(out, first) and torch.equal(lse, first_lse), f"{version} differs between calls {info}"


@requires_hopper
@pytest.mark.parametrize("version,D,B,H", CUT_CASES)
def test_split_tail_counters_per_stream_and_in_graphs(version, D, B, H):
    """The arrival counters are zeroed once per stream and left at zero by every call: calls on two
    streams in flight together, a call captured in a CUDA graph and replayed, and the calls after
    it all merge every cut tile (a counter left behind would skip a merge: NaN rows)."""
    q, k, v, info = make_qkv(B, H, 1000, 1000, D, torch.float16)
    expected = run(q, k, v, version=version)
    results = outputs_across_streams_and_graphs(lambda: hopper.attention(q, k, v, version=version),
                                                after=lambda: run(q, k, v, version=version))
    for name, out in results.items():
        assert torch.equal(out, expected), f"{version} on the {name} differs from the first call {info}"


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("dtype,magnitude", [(torch.float16, 100.0), (torch.bfloat16, 1000.0)],
                         ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
def test_large_magnitude(dtype, magnitude, D, version):
    """Logits in the thousands (FP16) to millions (BF16): the running max keeps exp2 finite."""
    q, k, v, info = make_qkv(2, 2, 300, 300, D, dtype, scale=magnitude)
    out, lse = run(q, k, v, is_causal=True, return_lse=True, version=version)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"inf/NaN at magnitude {magnitude} {info}"
    ref, ref_lse = reference.attention(q, k, v, is_causal=True, return_lse=True)
    assert_close(out, ref, dtype=dtype, rel_tol=TOL[dtype], seed_info=info)
    assert_close(lse, ref_lse, dtype=torch.float32, rel_tol=LSE_TOL, what="lse", seed_info=info)


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("H,H_kv", [(8, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_heads(causal, H, H_kv, D, version):
    """K/V with H_kv heads (query head h reads h // (H // H_kv)): against float64, with key padding,
    and bit for bit the same kernel on K/V expanded per query head."""
    q, k, v, info = make_qkv(2, H, 300, 333, D, torch.bfloat16, H_kv=H_kv)
    check_grouped(q, k, v, info, version, causal, torch.tensor([333, 140], device="cuda"))


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("B,H,H_kv", [(6, 16, 16), (5, 16, 8)])
def test_causal_schedule_in_sections(B, H, H_kv, D, version):
    """Causal calls with more K/V heads than the persistent grid's CTAs share (B H_kv over a quarter
    of the SMs): v6's schedule takes the (head, batch) pairs in sections (three and two on an H100,
    the directions alternating). Every tile is computed once, with key padding, and grouped K/V give
    the bits of K/V expanded per query head (a different split into sections)."""
    q, k, v, info = make_qkv(B, H, 1000, 1000, D, torch.float16, H_kv=H_kv)
    check_grouped(q, k, v, info, version, True, torch.tensor([1000, 517, 64, 999, 300, 1][:B], device="cuda"))


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
# The kernels fold c = scale log2 e > 0 into the exponent; a negative scale, zero, and one that is
# zero in FP32 take the host's other routes (hopper_ops.cpp), causal too (masked scores are -inf).
@pytest.mark.parametrize("scale", [0.05, 1.0, -0.3, 0.0, 1e-300])
@pytest.mark.parametrize("is_causal", [False, True])
def test_explicit_scale(scale, is_causal, version):
    q, k, v, info = make_qkv(2, 2, 129, 257, 64, torch.float16)
    check(q, k, v, info, version, is_causal=is_causal, scale=scale)


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
def test_many_heads_and_batches(version):
    q, k, v, info = make_qkv(48, 40, 17, 33, 64, torch.bfloat16)
    check(q, k, v, info, version, is_causal=True)


@requires_hopper
def test_versions_agree():
    """Every version computes the same function (up to FP32 summation order)."""
    q, k, v, info = make_qkv(2, 3, 700, 900, 128, torch.bfloat16)
    outs = [run(q, k, v, is_causal=True, version=name).float() for name in hopper.VERSIONS]
    for name, out in zip(hopper.VERSIONS[1:], outs[1:]):
        assert rel_error(out, outs[0]) < 2e-3, f"{name} differs from {hopper.VERSIONS[0]} {info}"


@requires_hopper
def test_output_without_lse():
    q, k, v, info = make_qkv(2, 2, 100, 150, 64, torch.float16)
    out = run(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    assert_close(out, reference.attention(q, k, v), dtype=torch.float16, rel_tol=TOL[torch.float16], seed_info=info)


@requires_hopper
def test_non_contiguous_and_misaligned_inputs():
    B, H, S, D = 2, 3, 100, 64
    q, k, v, info = make_qkv(B, H, S, S, D, torch.float16)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, S, D] view of a [B, S, H, D] tensor
    assert not q_t.is_contiguous()
    flat = torch.empty(k.numel() + 1, dtype=k.dtype, device="cuda")
    k_off = flat[1:].view_as(k).copy_(k)  # 2 bytes past a 16-byte boundary
    assert k_off.data_ptr() % 16 != 0
    v_odd = torch.empty(B, H, S, D + 4, dtype=v.dtype, device="cuda")[..., :D].copy_(v)  # rows 136 bytes apart
    assert v_odd.stride(2) * v_odd.element_size() % 16 != 0
    out = hopper.attention(q_t, k_off, v_odd)
    assert_close(out, reference.attention(q, k, v), dtype=torch.float16, rel_tol=TOL[torch.float16], seed_info=info)


def packed_qkv(B, S, H, H_kv, D, dtype):
    """q [B, H, S, D] and k, v [B, H_kv, S, D] as views of one [B, S, (H + 2 H_kv) * D] projection
    output (a model's fused qkv linear)."""
    qkv = randn(B, S, (H + 2 * H_kv) * D, dtype=dtype)
    q = qkv[..., :H * D].view(B, S, H, D).transpose(1, 2)
    k = qkv[..., H * D:(H + H_kv) * D].view(B, S, H_kv, D).transpose(1, 2)
    v = qkv[..., (H + H_kv) * D:].view(B, S, H_kv, D).transpose(1, 2)
    return q, k, v


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
@pytest.mark.parametrize("D", hopper.SUPPORTED_D)
@pytest.mark.parametrize("H_kv", [4, 2])
def test_views_of_a_packed_projection_are_read_in_place(version, D, H_kv):
    """q, k, v as strided views of one qkv projection ([B, S, H, D] memory, heads interleaved, S no
    multiple of the tiles): the TMA maps carry the strides, so no copy is made, and o comes back in
    the same [B, S, H, D] layout, so merging the heads is a view."""
    B, S, H = 2, 333, 4
    q, k, v = packed_qkv(B, S, H, H_kv, D, torch.float16)
    assert all(hopper._tma_readable(x) is x for x in (q, k, v))
    lengths = torch.tensor([S, 200], device="cuda", dtype=torch.int32)
    for causal in (False, True):
        out, lse = hopper.attention(q, k, v, is_causal=causal, key_lengths=lengths, return_lse=True, version=version)
        ref, ref_lse = reference.attention(q, k, v, is_causal=causal, key_lengths=lengths, return_lse=True)
        what = f"{version} D={D} H_kv={H_kv} causal={causal}"
        assert_close(out, ref, dtype=torch.float16, rel_tol=TOL[torch.float16], what=what)
        assert_close(lse, ref_lse, dtype=torch.float32, rel_tol=1e-4, what=f"lse {what}")
        assert out.shape == (B, H, S, D) and out.stride() == (S * H * D, D, H * D, 1), out.stride()
        assert out.transpose(1, 2).reshape(B, S, H * D).data_ptr() == out.data_ptr()  # merge_heads: a view


@requires_hopper
def test_output_layout_follows_q():
    """o is contiguous [B, H, S, D] for a q in that layout, and [B, S, H, D] memory for a q whose
    heads are interleaved within a position; k and v's layouts do not matter."""
    q, k, v, info = make_qkv(2, 3, 50, 70, 64, torch.float16)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert hopper.attention(q, k_t, v).is_contiguous()
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = hopper.attention(q_t, k, v)
    assert out.transpose(1, 2).is_contiguous() and not out.is_contiguous()
    assert_close(out, reference.attention(q, k, v), dtype=torch.float16, rel_tol=TOL[torch.float16], seed_info=info)


@requires_hopper
@pytest.mark.parametrize("version", hopper.VERSIONS)
def test_repeated_calls_agree(version):
    """No state leaks between calls (and no race): the same inputs give the same bits."""
    q, k, v, info = make_qkv(2, 4, 1000, 1000, 128, torch.float16)
    first = run(q, k, v, is_causal=True, version=version)
    for _ in range(3):
        assert torch.equal(run(q, k, v, is_causal=True, version=version), first), info


@requires_hopper
def test_fake_tensor_shapes():
    """The registered fake implementation (for torch.compile) gives q's shape and dtype, FP32 lse,
    and the op's output layout: contiguous for a [B, H, S, D] q, [B, S, H, D] memory for a q whose
    heads are interleaved (the strides the real op returns)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = hopper.load()
    layouts = {"BHSD": lambda x: x, "BSHD": lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)}
    for name, layout in layouts.items():
        real_q = layout(torch.randn(2, 3, 17, 64, dtype=torch.bfloat16, device="cuda"))
        real_k = torch.randn(2, 3, 40, 64, dtype=torch.bfloat16, device="cuda")
        real_out, _ = ops.attention(real_q, real_k, real_k, True, 0.125, None, True, 2)
        for op in (ops.attention, ops.attention_inference):
            with FakeTensorMode():
                q = layout(torch.empty(2, 3, 17, 64, dtype=torch.bfloat16, device="cuda"))
                k = torch.empty(2, 3, 40, 64, dtype=torch.bfloat16, device="cuda")
                out, lse = op(q, k, k, True, 0.125, None, True, 2)
            assert out.shape == (2, 3, 17, 64) and out.dtype == torch.bfloat16
            assert out.stride() == real_out.stride(), (name, out.stride(), real_out.stride())
            assert lse.shape == (2, 3, 17) and lse.dtype == torch.float32


@requires_hopper
def test_calls_that_record_no_gradient_take_the_op_without_autograd(monkeypatch):
    """attention_inference is attention without the autograd formula: the same output and lse bit for
    bit; the API calls it unless autograd records the call, and the differentiable op then."""
    from types import SimpleNamespace

    from utils.build import LOADED_OPS

    ops = hopper.load()
    q, k, v, _ = make_qkv(2, 2, 100, 150, 64, torch.float16)
    for causal in (False, True):
        out, lse = ops.attention(q, k, v, causal, 0.125, None, True, len(hopper.VERSIONS))
        out_inference, lse_inference = ops.attention_inference(q, k, v, causal, 0.125, None, True, len(hopper.VERSIONS))
        assert torch.equal(out, out_inference) and torch.equal(lse, lse_inference)
    called = []

    def recording(name):
        def op(*args):
            called.append(name)
            return getattr(ops, name)(*args)
        return op

    monkeypatch.setitem(LOADED_OPS, hopper.NAME, SimpleNamespace(
        attention=recording("attention"), attention_inference=recording("attention_inference"),
        attention_backward=ops.attention_backward))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    hopper.attention(q, k, v)
    with torch.no_grad():
        hopper.attention(*leaves)
    assert called == ["attention_inference"] * 2
    hopper.attention(*leaves).sum().backward()
    assert called[2:] == ["attention"] and all(t.grad is not None for t in leaves)


@requires_hopper
def test_torch_compile_fullgraph():
    q, k, v, info = make_qkv(2, 2, 130, 200, 64, torch.float16)

    def fn(q, k, v):
        out, lse = hopper.attention(q, k, v, is_causal=True, return_lse=True)
        return out * 2, lse

    compiled = torch.compile(fn, fullgraph=True)
    out, lse = compiled(q, k, v)
    eager_out, eager_lse = fn(q, k, v)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse), info


# ------------------------------------------------------------------------------------------------
# Bad input: clear errors that name the argument


def test_mask_rejected_without_gpu():
    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="mask is not supported"):
        hopper.attention(q, q, q, mask=torch.ones(8, 8, dtype=torch.bool))


def test_cpu_tensor_rejected_without_gpu():
    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        hopper.attention(q, q, q)


def test_bad_arguments_rejected_without_gpu():
    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="is_causal"):
        hopper.attention(q, q, q, is_causal="yes")
    with pytest.raises(ValueError, match="scale"):
        hopper.attention(q, q, q, scale=math.inf)
    with pytest.raises(ValueError, match="version must be one of"):
        hopper.attention(q, q, q, version="v9")
    with pytest.raises(TypeError, match="return_lse"):
        hopper.attention(q, q, q, return_lse=1)
    with pytest.raises(ValueError, match="k must be"):
        hopper.attention(q, q[:, :, :, :32], q)
    with pytest.raises(ValueError, match="v must have k's shape"):
        hopper.attention(q, q, q[:, :, :5])
    with pytest.raises(TypeError, match="q, k, v must share a dtype"):
        hopper.attention(q, q.to(torch.bfloat16), q)


def test_constants_are_the_kernels():
    """SUPPORTED_D, DTYPES and VERSIONS are the ones the C++ side compiles (hopper_attention.h, the
    version files): read, not imported, so this runs without a GPU."""
    from pathlib import Path

    here = Path(hopper.__file__).parent
    header = (here / "hopper_attention.h").read_text()
    assert "d == 64 || d == 128" in header and hopper.SUPPORTED_D == (64, 128)
    for number, name in enumerate(hopper.VERSIONS, 1):
        assert f"hopper_{name}.cu" in hopper.SOURCES and (here / f"hopper_{name}.cu").exists()
        assert f"launch_v{number}" in (here / f"hopper_{name}.cu").read_text()
    assert hopper.DEFAULT_VERSION in hopper.VERSIONS
    assert f"kBwdDefaultVariant = {hopper.BWD_DEFAULT_VARIANT};" in header
    assert hopper.BWD_DEFAULT_VARIANT in hopper.BWD_VARIANTS
    assert any("compute_90a" in flag and "sm_90a" in flag for flag in hopper.CUDA_FLAGS)


def test_ncu_records_are_labelled_by_launch_order():
    """run.label_records: our kernels by launch position (the last version's call running the
    kernel of the one before it, as v6 runs v5's), the other kernels of a D's cuDNN call by its longest one."""
    from phase5_fused.hopper import run

    numbers = [*range(1, len(hopper.VERSIONS)), len(hopper.VERSIONS) - 1]
    names = [f"void hopper::(anonymous namespace)::hopper_v{n}_kernel<__half, {{D}}>(hopper::Params)" for n in numbers]
    records = []
    for D in run.PROFILE_D:
        records += [{"kernel": name.format(D=D), "time_ns": 10} for name in names]
        records += [{"kernel": "cudnn_helper", "time_ns": 1}, {"kernel": "cudnn_sdpa_fprop", "time_ns": 20}]
    labelled = run.label_records(records)
    expected = {f"{run.impl_name(v)}_D{D}" for v in hopper.VERSIONS for D in run.PROFILE_D}
    expected |= {f"{run.CUDNN}_D{D}" for D in run.PROFILE_D}
    assert set(labelled) == expected
    assert all(labelled[f"{run.CUDNN}_D{D}"]["kernel"] == "cudnn_sdpa_fprop" for D in run.PROFILE_D)
    last = labelled[f"{run.impl_name(hopper.VERSIONS[-1])}_D{run.PROFILE_D[-1]}"]["kernel"]
    assert last == names[-1].format(D=run.PROFILE_D[-1])


def test_import_builds_nothing():
    """Importing the module (and the phase package) must not build or load the extension."""
    import subprocess
    import sys

    from utils.build import REPO_ROOT

    proc = subprocess.run([sys.executable, "-c", "import phase5_fused.hopper; from utils.build import LOADED_OPS; assert not LOADED_OPS"],
                          cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@requires_gpu
@pytest.mark.skipif(_hopper_reason() is None, reason="this GPU is a Hopper (sm_90): nothing to refuse")
def test_other_gpus_refused_before_launch():
    q, k, v, _ = make_qkv(1, 1, 16, 16, 64, torch.float16)
    with pytest.raises(RuntimeError, match=r"needs a Hopper GPU \(sm_90\)"):
        hopper.attention(q, k, v)


@requires_hopper
def test_bad_inputs_named():
    q, k, v, _ = make_qkv(1, 2, 16, 24, 64, torch.float16)
    with pytest.raises(TypeError, match="q must have dtype float16, bfloat16, got float32"):
        hopper.attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match=r"D=96 \(q.shape\[-1\]\)"):
        x = torch.randn(1, 2, 16, 96, device="cuda", dtype=torch.float16)
        hopper.attention(x, x, x)
    with pytest.raises(ValueError, match=r"H=2 must be a multiple of k's KV heads H_kv=3"):
        hopper.attention(q, k.repeat(1, 2, 1, 1)[:, :3], v.repeat(1, 2, 1, 1)[:, :3])
    with pytest.raises(ValueError, match="mask is not supported"):
        hopper.attention(q, k, v, mask=torch.ones(16, 24, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="key_lengths"):
        hopper.attention(q, k, v, key_lengths=torch.tensor([1, 2], device="cuda"))
    with pytest.raises(TypeError, match="key_lengths"):
        hopper.attention(q, k, v, key_lengths=torch.tensor([1.0], device="cuda"))


@requires_hopper
def test_op_checks_name_the_argument():
    """The C++ op validates again (for callers that bypass the Python API)."""
    ops = hopper.load()
    q, k, v, _ = make_qkv(1, 2, 16, 24, 64, torch.float16)
    with pytest.raises(RuntimeError, match="q must be float16 or bfloat16"):
        ops.attention(q.float(), k.float(), v.float(), False, 0.125, None, False, 2)
    with pytest.raises(RuntimeError, match="D=96"):
        x = torch.randn(1, 2, 16, 96, device="cuda", dtype=torch.float16)
        ops.attention(x, x, x, False, 0.125, None, False, 2)
    past_last = len(hopper.VERSIONS) + 1
    with pytest.raises(RuntimeError, match=f"version must be 1 to {len(hopper.VERSIONS)}, got {past_last}"):
        ops.attention(q, k, v, False, 0.125, None, False, past_last)
    with pytest.raises(RuntimeError, match="q's last dim \\(D\\) must be contiguous"):
        ops.attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, False, 0.125, None, False, 2)
    odd_rows = torch.empty(1, 2, 24, 68, dtype=k.dtype, device="cuda")[..., :64]
    with pytest.raises(RuntimeError, match="k's strides must be positive multiples of 16 bytes"):
        ops.attention(q, odd_rows, v, False, 0.125, None, False, 2)
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ops.attention(flat[1:].view_as(q), k, v, False, 0.125, None, False, 2)
    with pytest.raises(RuntimeError, match="key_lengths must be \\[B\\]"):
        ops.attention(q, k, v, False, 0.125, torch.tensor([1, 2], device="cuda"), False, 2)
