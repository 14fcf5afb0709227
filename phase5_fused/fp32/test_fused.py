"""Phase 5 FP32 fused kernels (every version in fp32.KERNELS) against utils.reference in float64.

GPU tests skip without a GPU; the CPU-tensor and argument errors run everywhere (CI). Each kernel
writes a freshly allocated output: the allocator is poisoned first (a NaN-filled block of the
output's size is freed right before the call, so the caching allocator hands it back), so an
element the kernel forgets to write stays NaN and fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phase5_fused import fp32
from utils import reference
from utils.build import REPO_ROOT
from utils.testing import (assert_close, random_additive_mask, random_bool_mask, random_qkv, randn,
                           requires_gpu)

KERNELS = fp32.KERNELS
NOT_FAST = tuple(kernel for kernel in KERNELS if kernel != "fast")  # the versions with VERSION_D only
# Head dims on the fast kernel's padded tiles, one or two per tile width: not a multiple of 16 (8, 40,
# 136, 200), a tile's width itself (256), widths with 64 and 32 rows per block.
PADDED_D = (8, 40, 136, 200, 256)


def _poison_allocator(*shape):
    """Free a NaN block of this shape so the next allocation of that size reuses it."""
    torch.full(shape, float("nan"), device="cuda")


def run(kernel, q, k, v, **kw):
    _poison_allocator(*q.shape)
    if kw.get("return_lse"):
        _poison_allocator(*q.shape[:3])
    return fp32.attention(q, k, v, kernel=kernel, **kw)


def check(kernel, q, k, v, rel_tol=None, **kw):
    """Run one kernel, compare out (and lse) with the float64 reference; returns out."""
    out, lse = run(kernel, q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True,
                                       **{n: x for n, x in kw.items() if n != "variant"})
    opts = {n: tuple(x.shape) if torch.is_tensor(x) else x for n, x in kw.items()}
    what = f"{kernel} q{tuple(q.shape)} k{tuple(k.shape)} {opts}"
    assert_close(out, ref, dtype=torch.float32, rel_tol=rel_tol, what=what)
    assert_close(lse, ref_lse, dtype=torch.float32, rel_tol=rel_tol, what=what + " lse")
    return out


# ------------------------------------------------------------------------------------------------
# Errors that need no GPU (run in CI too)


def test_cpu_tensor_is_rejected_naming_the_argument():
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        fp32.attention(q, q, q)


def test_unknown_kernel_is_rejected():
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match="kernel"):
        fp32.attention(q, q, q, kernel="quickest")


def test_variant_is_rejected_for_a_version_without_variants():
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match="variant"):
        fp32.attention(q, q, q, kernel="v2", variant=1)
    with pytest.raises(ValueError, match="variant"):
        fp32.attention(q, q, q, kernel="fastest", variant=1)


def test_bad_flags_are_rejected_naming_the_argument():
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(TypeError, match="is_causal"):
        fp32.attention(q, q, q, is_causal=1)
    with pytest.raises(ValueError, match="scale"):
        fp32.attention(q, q, q, scale=float("nan"))


def test_run_names_every_version_in_order():
    from phase5_fused.fp32 import run as benchmark

    assert tuple(benchmark.VERSIONS) == fp32.KERNELS


@pytest.mark.parametrize("D", [0, 4, 12, 100, 264])
def test_unsupported_head_dim_rejected_without_gpu(D):
    q = torch.randn(1, 1, 8, D)
    with pytest.raises(ValueError, match=rf"head dim D={D} \(q.shape\[-1\]\) is not supported by the fast kernel: "
                                         "use a multiple of 8 from 8 to 256"):
        fp32.attention(q, q, q)
    with pytest.raises(ValueError, match=rf"head dim D={D} .* not supported by the fast kernel"):
        fp32.attention(q, q, q, kernel="fastest")


@pytest.mark.parametrize("kernel", NOT_FAST)
@pytest.mark.parametrize("D", [8, 48, 256])
def test_fast_only_head_dim_rejected_by_the_other_versions_without_gpu(kernel, D):
    q = torch.randn(1, 1, 8, D)
    with pytest.raises(ValueError, match=rf"head dim D={D} \(q.shape\[-1\]\) is not supported by "
                                         rf"kernel='{kernel}': use one of \(32, 64, 80, 96, 128\)"):
        fp32.attention(q, q, q, kernel=kernel)


def test_head_dims_are_the_kernels():
    """VERSION_D, SUPPORTED_D, PADDED_TILE_D, PADDED_TILES and FAST_TILES name what fused.h and
    fused_fast.cu compile and check."""
    folder = Path(fp32.__file__).parent
    header = (folder / "fused.h").read_text()
    listed = re.search(r"kVersionD\[\] = \{([^}]*)\}", header).group(1)
    assert tuple(int(d) for d in listed.split(",")) == fp32.VERSION_D
    low, high, step = (int(re.search(rf"{name} = (\d+);", header).group(1))
                       for name in ("kMinHeadDim", "kMaxHeadDim", "kHeadDimStep"))
    assert fp32.SUPPORTED_D == tuple(range(low, high + 1, step))
    assert set(fp32.VERSION_D) <= set(fp32.SUPPORTED_D)
    source = (folder / "fused_fast.cu").read_text()
    padded = re.findall(r"launch_padded_config<(\d+), (\d+), (\d+), \d+>\(p, stream\)", source)
    assert tuple(int(width) for width, _, _ in padded) == fp32.PADDED_TILE_D
    assert {int(width): f"{br}x{bc}" for width, br, bc in padded} == fp32.PADDED_TILES
    assert all(d % 32 == 0 for d in fp32.PADDED_TILE_D) and fp32.PADDED_TILE_D[-1] == fp32.SUPPORTED_D[-1]
    own = {}
    for D, br, bc in re.findall(r"launch_config<(\d+), (\d+), (\d+), \d+>\(p, stream\)", source):
        own.setdefault(int(D), []).append(f"{br}x{bc}")
    assert {D: tuple(tiles) for D, tiles in own.items()} == fp32.FAST_TILES
    assert set(fp32.FAST_TILES) == set(fp32.VERSION_D) and set(fp32.FAST_VARIANTS) == set(fp32.SUPPORTED_D)


def test_import_builds_nothing():
    code = "import phase5_fused.fp32, torch; from utils.build import LOADED_OPS; assert not LOADED_OPS; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


# ------------------------------------------------------------------------------------------------
# Correctness on the grid


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("S", [1, 17, 127, 128, 1000, 4096])
def test_sequence_lengths(kernel, S):
    B, H = (1, 2) if S == 4096 else (2, 3)
    check(kernel, *random_qkv(B, H, S, S, 64))


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("D", fp32.VERSION_D)
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(kernel, D, causal):
    check(kernel, *random_qkv(2, 2, 200, 333, D), is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("D", fp32.SUPPORTED_D)
@pytest.mark.parametrize("Sq,Sk", [(77, 130), (1, 130)])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_every_head_dim(D, Sq, Sk, causal):
    """Every D of the fast kernel, its own instances and the padded ones: a query block and a key
    tile cut short, and a single query row."""
    check("fast", *random_qkv(2, 2, Sq, Sk, D), is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_variants(D, variant, causal):
    check("fast", *random_qkv(1, 3, 300, 257, D), is_causal=causal, variant=variant)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("Sq,Sk", [(17, 1000), (1000, 17), (1, 300), (300, 1), (128, 4096), (700, 130)])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention(kernel, Sq, Sk, causal):
    check(kernel, *random_qkv(2, 2, Sq, Sk, 64), is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("mask_shape", ["full", "per_head_bcast", "2d", "key_only"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks(kernel, kind, mask_shape, causal):
    B, H, Sq, Sk = 2, 3, 150, 190
    shape = {"full": (B, H, Sq, Sk), "per_head_bcast": (B, 1, Sq, Sk), "2d": (Sq, Sk),
             "key_only": (1, 1, 1, Sk)}[mask_shape]
    mask = random_bool_mask(shape) if kind == "bool" else random_additive_mask(shape)
    check(kernel, *random_qkv(B, H, Sq, Sk, 64), mask=mask, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_expanded_noncontiguous_mask(kernel):
    B, H, Sq, Sk = 2, 2, 70, 90
    mask = random_bool_mask((Sk, Sq)).t().expand(B, H, Sq, Sk)  # strides (0, 0, 1, Sq)
    check(kernel, *random_qkv(B, H, Sq, Sk, 32), mask=mask)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("causal", [False, True])
def test_key_lengths(kernel, dtype, causal):
    B, H, S = 4, 2, 300
    lengths = torch.tensor([300, 1, 157, 64], dtype=dtype, device="cuda")
    check(kernel, *random_qkv(B, H, S, S, 64), key_lengths=lengths, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_key_lengths_zero_and_beyond_sk(kernel):
    lengths = torch.tensor([0, 10_000], dtype=torch.int64, device="cuda")
    q, k, v = random_qkv(2, 2, 65, 130, 64)
    out = check(kernel, q, k, v, key_lengths=lengths)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("stride", [2, 3, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 80, 128])
def test_stride(kernel, stride, causal, D):
    check(kernel, *random_qkv(2, 2, 333, 517, D), stride=stride, is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_stride_with_mask_and_padding(kernel):
    B, H, Sq, Sk = 2, 2, 200, 300
    mask = random_additive_mask((B, 1, Sq, Sk))
    lengths = torch.tensor([250, 77], dtype=torch.int32, device="cuda")
    check(kernel, *random_qkv(B, H, Sq, Sk, 96), mask=mask, stride=3, key_lengths=lengths,
          is_causal=True)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_fully_masked_rows_give_zeros(kernel):
    B, H, Sq, Sk = 2, 2, 130, 150
    mask = random_bool_mask((B, H, Sq, Sk))
    mask[:, :, ::7] = False  # every 7th query row sees nothing
    q, k, v = random_qkv(B, H, Sq, Sk, 64)
    out, lse = run(kernel, q, k, v, mask=mask, return_lse=True)
    assert torch.equal(out[:, :, ::7], torch.zeros_like(out[:, :, ::7]))
    assert torch.isneginf(lse[:, :, ::7]).all()
    check(kernel, q, k, v, mask=mask)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_scale(kernel):
    check(kernel, *random_qkv(1, 2, 100, 120, 64), scale=0.37)


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_large_magnitude_inputs_never_nan(kernel, causal):
    q, k, v = random_qkv(1, 2, 256, 256, 64, scale=30.0)  # scores of order 1e3..1e4
    out = run(kernel, q, k, v, is_causal=causal)
    assert torch.isfinite(out).all()
    ref = reference.attention(q, k, v, is_causal=causal)
    # exp of differences of numbers ~1e4 rounded to FP32: a looser bound than 2e-5.
    assert_close(out, ref, dtype=torch.float32, rel_tol=1e-3, what=f"{kernel} large inputs")


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_noncontiguous_inputs(kernel):
    q, k, v = (randn(2, 130, 3, 64).transpose(1, 2) for _ in range(3))  # [B, S, H, D] storage
    assert not q.is_contiguous()
    check(kernel, q, k, v, is_causal=True)


@requires_gpu
def test_long_sequence_runs_without_s_by_s_buffer():
    """B=1, H=8, S=32768: the output is 64 MiB; an S x S buffer would be 32 GiB."""
    B, H, S, D = 1, 8, 32768, 64
    q, k, v = random_qkv(B, H, S, S, D)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fp32.attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= out.numel() * 4 + 2**20
    rows = torch.tensor([0, 1, 4095, 20000, S - 1], device="cuda")
    ref = reference.attention(q[:, :, rows], k, v, mask=(torch.arange(S, device="cuda") <= rows[:, None]))
    assert_close(out[:, :, rows], ref, dtype=torch.float32, what="S=32768 sampled rows")


# ------------------------------------------------------------------------------------------------
# Grouped-query attention and sliding windows (the fast kernel)

HEADS = [(8, 8), (8, 2), (8, 1)]  # (H, H_kv): multi-head, grouped-query, multi-query


@requires_gpu
@pytest.mark.parametrize("H,H_kv", HEADS)
@pytest.mark.parametrize("D", fp32.VERSION_D + PADDED_D)
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(H, H_kv, D, causal):
    """k, v with H_kv heads against the float64 reference, Sq != Sk."""
    check("fast", *random_qkv(2, H, 150, 333, D, H_kv=H_kv), is_causal=causal)


@requires_gpu
@pytest.mark.parametrize("H_kv", [2, 1])
@pytest.mark.parametrize("variant", [0, 1])
def test_gqa_reads_the_group_kv_head(H_kv, variant):
    """The grouped call computes exactly what the kernel computes on K, V expanded per query head
    (the same arithmetic, bit for bit): query head h reads KV head h // (H // H_kv)."""
    q, k, v = random_qkv(2, 8, 130, 257, 64, H_kv=H_kv)
    grouped = run("fast", q, k, v, is_causal=True, variant=variant)
    expanded = run("fast", q, k.repeat_interleave(8 // H_kv, 1), v.repeat_interleave(8 // H_kv, 1), is_causal=True,
                   variant=variant)
    assert torch.equal(grouped, expanded)


@requires_gpu
@pytest.mark.parametrize("window", [1, 17, 128, 1000])
@pytest.mark.parametrize("S", [1, 33, 200, 1031])
@pytest.mark.parametrize("H,H_kv", [(8, 8), (8, 2)])
def test_window(window, S, H, H_kv):
    check("fast", *random_qkv(1, H, S, S, 64, H_kv=H_kv), is_causal=True, window=window)


@requires_gpu
@pytest.mark.parametrize("D", fp32.VERSION_D + PADDED_D)
@pytest.mark.parametrize("Sq,Sk", [(300, 200), (150, 400), (1, 300), (257, 257)])
@pytest.mark.parametrize("window", [1, 63, 100])
def test_window_every_head_dim_and_cross_lengths(D, Sq, Sk, window):
    check("fast", *random_qkv(1, 4, Sq, Sk, D, H_kv=2), is_causal=True, window=window)


@requires_gpu
@pytest.mark.parametrize("D,variant", [(64, 0), (64, 1), (128, 0), (128, 1)])
def test_window_every_variant(D, variant):
    check("fast", *random_qkv(1, 4, 333, 333, D, H_kv=1), is_causal=True, window=70, variant=variant)


@requires_gpu
def test_window_with_mask_stride_and_key_lengths():
    """The window combines with the other rules: a mask, stride, key padding (and a row that
    sees nothing: row 0 with key_lengths 0, rows past a short batch's keys)."""
    B, H, H_kv, Sq, Sk = 3, 4, 2, 260, 300
    mask = random_additive_mask((B, 1, Sq, Sk))
    lengths = torch.tensor([Sk, 90, 0], dtype=torch.int64, device="cuda")
    for stride in (None, 3):
        out = check("fast", *random_qkv(B, H, Sq, Sk, 96, H_kv=H_kv), mask=mask, is_causal=True, window=50,
                    stride=stride, key_lengths=lengths)
        assert torch.equal(out[2], torch.zeros_like(out[2]))


@requires_gpu
@pytest.mark.parametrize("D", PADDED_D)
@pytest.mark.parametrize("stride", [None, 3])
def test_padded_head_dims_with_every_rule(D, stride):
    """Padded tiles under every rule at once: grouped heads, a window, an additive mask with a fully
    masked row, stride, key padding with a batch of no keys; and a boolean mask without a window."""
    B, H, H_kv, Sq, Sk = 3, 4, 2, 150, 190
    mask = random_additive_mask((B, 1, Sq, Sk))
    mask[:, :, 9] = float("-inf")
    lengths = torch.tensor([Sk, 77, 0], dtype=torch.int32, device="cuda")
    q, k, v = random_qkv(B, H, Sq, Sk, D, H_kv=H_kv)
    out = check("fast", q, k, v, mask=mask, is_causal=True, window=45, stride=stride, key_lengths=lengths)
    assert torch.equal(out[:, :, 9], torch.zeros_like(out[:, :, 9])) and torch.equal(out[2], torch.zeros_like(out[2]))
    check("fast", q, k, v, mask=random_bool_mask((B, H, Sq, Sk)), stride=stride, key_lengths=lengths)


@requires_gpu
def test_window_rows_past_their_keys_are_zero():
    """Sq > Sk, top-left causal with a window: row i >= Sk + window - 1 sees no key and gives zeros."""
    q, k, v = random_qkv(1, 2, 300, 100, 64)
    out = check("fast", q, k, v, is_causal=True, window=40)
    assert torch.equal(out[:, :, 139:], torch.zeros_like(out[:, :, 139:]))


FASTEST_CASES = [  # (B, H, H_kv, Sq, Sk, D), arguments, the version that "fastest" runs (fused.h)
    ((1, 2, 2, 70, 90, 64), {}, "tf32x3"),
    ((2, 2, 2, 70, 90, 128), {"is_causal": True}, "tf32x3"),
    ((1, 2, 2, 33, 130, 96), {"mask": "bool", "is_causal": True}, "tf32x3"),
    ((2, 2, 2, 70, 90, 32), {"key_lengths": True, "stride": 1}, "tf32x3"),
    ((1, 2, 2, 70, 90, 40), {}, "fast"),
    ((1, 2, 2, 70, 90, 64), {"stride": 2}, "fast"),
    ((1, 4, 2, 70, 90, 64), {}, "fast"),
    ((1, 2, 2, 70, 90, 128), {"is_causal": True, "window": 9}, "fast"),
]


@requires_gpu
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("case", FASTEST_CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(FASTEST_CASES)])
def test_fastest_runs_version_6_where_it_takes_the_inputs(case, grad):
    """kernel="fastest" is version 6, bit for bit, at D in VERSION_D with one K/V head per query head,
    no window and no stride; the fast kernel elsewhere. With and without a gradient to record (the
    op with and without an autograd formula); the output checked against float64 as well."""
    (B, H, H_kv, Sq, Sk, D), kwargs, kernel = case
    q, k, v = random_qkv(B, H, Sq, Sk, D, H_kv=H_kv)
    if kwargs.get("mask") == "bool":
        kwargs = {**kwargs, "mask": random_bool_mask((B, 1, Sq, Sk))}
    if kwargs.get("key_lengths"):
        kwargs = {**kwargs, "key_lengths": torch.tensor([Sk - 7, 5][:B], device="cuda")}
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    out = check("fastest", q, k, v, **kwargs)
    assert torch.equal(out, fp32.attention(q, k, v, kernel=kernel, **kwargs))
    assert torch.equal(out, run("fastest", q, k, v, **kwargs))  # no lse asked for: attention_fastest_out
    assert out.requires_grad == grad


@requires_gpu
def test_gqa_window_refused_by_other_versions():
    q, k, v = random_qkv(1, 4, 16, 24, 64, H_kv=2)
    for kernel in NOT_FAST:
        with pytest.raises(ValueError, match="fast kernel only"):
            fp32.attention(q, k, v, kernel=kernel)
        with pytest.raises(ValueError, match="fast kernel only"):
            fp32.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, window=4,
                           kernel=kernel)
    with torch.no_grad():
        check("fast", q, k, v, is_causal=True, window=4)


@requires_gpu
def test_gqa_window_op_checks():
    """The C++ op checks the head grouping and the window itself."""
    ops = fp32.load()
    q, k, v = random_qkv(1, 4, 16, 24, 64, H_kv=3)
    with pytest.raises(RuntimeError, match="KV heads H_kv=3"):
        ops.attention_fast(q, k, v, None, False, None, 1, None, False, 0)
    q, k, v = random_qkv(1, 4, 16, 24, 64, H_kv=2)
    with pytest.raises(RuntimeError, match="window"):
        ops.attention_fast(q, k, v, None, False, None, 1, None, False, 0, 4)  # window without causal
    with pytest.raises(RuntimeError, match="window"):
        ops.attention_fast(q, k, v, None, True, None, 1, None, False, 0, -1)
    with pytest.raises(RuntimeError, match="k must have q's batch and heads"):
        ops.attention_v2(q, k, v, None, False, None, 1, None, False)  # grouped heads: the fast kernel only


def test_gqa_window_bad_arguments_rejected_without_gpu():
    q = torch.randn(1, 8, 4, 64)
    k = torch.randn(1, 3, 4, 64)
    with pytest.raises(ValueError, match=r"multiple of k's KV heads H_kv=3 \(k.shape\[1\]\)"):
        fp32.attention(q, k, k)
    for window in (0, -2, 1.5, True, "8"):
        with pytest.raises(ValueError, match="window must be an integer >= 1"):
            fp32.attention(q, q, q, is_causal=True, window=window)
    with pytest.raises(ValueError, match="window=8 needs is_causal=True"):
        fp32.attention(q, q, q, window=8)


# ------------------------------------------------------------------------------------------------
# Bad inputs: errors name the argument


@requires_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_inputs(kernel):
    q, k, v = random_qkv(1, 2, 16, 24, 64)
    attn = fp32.attention
    with pytest.raises(TypeError, match="q"):
        attn(q.double(), k, v, kernel=kernel)
    with pytest.raises(TypeError, match="q"):
        attn(q.half(), k.half(), v.half(), kernel=kernel)
    with pytest.raises(ValueError, match="k"):
        attn(q, k[:, :1], v, kernel=kernel)
    with pytest.raises(ValueError, match="v"):
        attn(q, k, v[:, :, :5], kernel=kernel)
    with pytest.raises(ValueError, match="q"):
        attn(q[:, :, :, :2], k[:, :, :, :2], v[:, :, :, :2], kernel=kernel)
    with pytest.raises(ValueError, match="D=12"):
        attn(*random_qkv(1, 1, 8, 8, 12), kernel=kernel)
    if kernel != "fast":
        with pytest.raises(ValueError, match=f"D=48 .* kernel='{kernel}'"):
            attn(*random_qkv(1, 1, 8, 8, 48), kernel=kernel)
    with pytest.raises(ValueError, match="mask"):
        attn(q, k, v, mask=torch.ones(16, 23, dtype=torch.bool, device="cuda"), kernel=kernel)
    with pytest.raises(TypeError, match="mask"):
        attn(q, k, v, mask=torch.ones(16, 24, dtype=torch.int32, device="cuda"), kernel=kernel)
    with pytest.raises(ValueError, match="stride"):
        attn(q, k, v, stride=0, kernel=kernel)
    with pytest.raises(ValueError, match="key_lengths"):
        attn(q, k, v, key_lengths=torch.ones(3, dtype=torch.int32, device="cuda"), kernel=kernel)
    with pytest.raises(TypeError, match="key_lengths"):
        attn(q, k, v, key_lengths=torch.ones(1, device="cuda"), kernel=kernel)
    with pytest.raises(ValueError, match="k"):
        attn(q, k.cpu(), v, kernel=kernel)


@requires_gpu
@pytest.mark.parametrize("D", [80, 40])
def test_bad_variant(D):
    q, k, v = random_qkv(1, 1, 8, 8, D)
    with pytest.raises(ValueError, match="variant"):
        fp32.attention(q, k, v, variant=1)
    with pytest.raises(RuntimeError, match=f"variant must be in \\[0, 1\\) for D={D}"):
        fp32.load().attention_fast(q, k, v, None, False, None, 1, None, False, 1)


@requires_gpu
def test_op_checks_arguments_too():
    """The C++ op validates on its own (a caller may skip the Python API)."""
    ops = fp32.load()
    q48 = random_qkv(1, 1, 8, 8, 48)
    q64 = random_qkv(1, 1, 8, 8, 64)
    for kernel in KERNELS:
        op = getattr(ops, f"attention_{kernel}")
        variant = (0,) if kernel == "fast" else ()
        for D in (12, 264):
            with pytest.raises(RuntimeError, match=f"D={D} is not supported"):
                op(*random_qkv(1, 1, 8, 8, D), None, False, None, 1, None, False, *variant)
        if kernel != "fast":
            with pytest.raises(RuntimeError, match="D=48 is not supported by the versions other than the fast kernel"):
                op(*q48, None, False, None, 1, None, False)
        with pytest.raises(RuntimeError, match="stride"):
            op(*q64, None, False, None, 0, None, False, *variant)


@requires_gpu
def test_compiles_under_torch_compile():
    q, k, v = random_qkv(1, 2, 64, 64, 64)
    fn = torch.compile(lambda a, b, c: fp32.attention(a, b, c, is_causal=True), fullgraph=True)
    assert_close(fn(q, k, v), reference.attention(q, k, v, is_causal=True), dtype=torch.float32)
