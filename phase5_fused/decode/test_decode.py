"""Tests of the decoding kernels (phase5_fused.decode) against the float64 reference
(utils.reference.decode_attention: pages gathered, GQA heads expanded, the bottom-right causal mask
of each sequence's length), within the dtype's tolerance (relative norm: 5e-3 FP16, 1e-2 BF16,
2e-5 FP32). Outputs come from an allocator poisoned with NaN first. GPU tests skip without a GPU;
the validation of shapes, dtypes and values is also tested on the CPU.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from phase5_fused import decode
from utils import reference
from utils.testing import (assert_close, new_seed, outputs_across_streams_and_graphs, poisoned_call, randn,
                           requires_gpu)

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2, torch.float32: 2e-5}
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def make_case(lengths, H, H_kv, Sq, D, dtype, page_size=None, device="cuda", spare=0, seed=None):
    """Fresh q and cache for the given per-sequence lengths; the cache holds max(lengths) + spare
    keys per sequence. Paged: pages shuffled, free pages and unused entries filled with NaN / -1.
    Returns (q, k, v, lengths, page_table, info)."""
    seed = new_seed() if seed is None else seed
    B = len(lengths)
    S = max(lengths) + spare
    q = randn(B, H, Sq, D, dtype=dtype, device=device, seed=seed)
    k = randn(B, H_kv, S, D, dtype=dtype, device=device, seed=seed + 1)
    v = randn(B, H_kv, S, D, dtype=dtype, device=device, seed=seed + 2)
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device)
    info = f"(seed {seed}, lengths={list(lengths)} H={H} H_kv={H_kv} Sq={Sq} D={D} {dtype} page_size={page_size})"
    if page_size is None:
        return q, k, v, lengths_t, None, info
    k_pages, table = to_pages(k, lengths, page_size, seed)
    v_pages, _ = to_pages(v, lengths, page_size, seed)
    return q, k_pages, v_pages, lengths_t, table, info


def to_pages(cache, lengths, page_size, seed):
    """cache [B, H_kv, S, D] scattered into shuffled pages [num_pages, H_kv, page_size, D] (plus
    two free pages), and the page table; NaN in every slot no sequence uses, -1 in unused entries."""
    B, H_kv, S, D = cache.shape
    max_pages = math.ceil(S / page_size)
    num_pages = B * max_pages + 2
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    pages = torch.full((num_pages, H_kv, page_size, D), float("nan"), dtype=cache.dtype, device=cache.device)
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    for b, L in enumerate(lengths):
        used = math.ceil(L / page_size)
        physical = order[b * max_pages: b * max_pages + used]
        table[b, :used] = physical.to(torch.int32)
        logical = torch.nn.functional.pad(cache[b, :, :L], (0, 0, 0, used * page_size - L), value=float("nan"))
        pages[physical.to(cache.device)] = logical.view(H_kv, used, page_size, D).transpose(0, 1)
    return pages, table.to(cache.device)


def run(q, k, v, lengths, table, **kwargs):
    """decode.attention on freshly poisoned memory: the caching allocator hands the op blocks just
    filled with NaN, so an output element (or workspace entry) the kernels forget stays NaN."""
    B, H, Sq, D = q.shape
    splits = kwargs.get("num_splits") or 64
    return poisoned_call(lambda: decode.attention(q, k, v, lengths, page_table=table, **kwargs),
                         (B, H, Sq, D), (B, H, Sq), (splits, B * H * Sq, D), (splits, B * H * Sq))


def check(q, k, v, lengths, table, info, scale=None, num_splits=None, kernel=None, stages=None, fused_merge=True):
    if kernel is not None and kernel != decode.choose_kernel(q.dtype, q.shape[-1]) and kernel != "cuda_cores":
        pytest.skip(f"no {kernel} kernel for {q.dtype} at D={q.shape[-1]}")
    out, lse = run(q, k, v, lengths, table, scale=scale, num_splits=num_splits, return_lse=True, kernel=kernel,
                   stages=stages, fused_merge=fused_merge)
    ref, ref_lse = reference.decode_attention(q, k, v, lengths, page_table=table, scale=scale, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    err = assert_close(out, ref, dtype=q.dtype, rel_tol=TOL[q.dtype], seed_info=info)
    assert_close(lse, ref_lse, dtype=torch.float32, rel_tol=1e-5, what="lse", seed_info=info)
    return err


# ------------------------------------------------------------------------------------------------
# Correctness


def test_python_facts_name_what_the_kernels_compile():
    """MAX_SPLITS, CUDA_CORE_STAGES, TENSOR_CORE_STAGES, TILE_BYTES and PAGE_SIZES, which the Python
    side plans with (splits, stages, shared memory, page sizes), are the numbers decode.h and
    decode_stream.cuh compile and check: read from the sources, so that CI (no GPU) sees a drift."""
    folder = Path(decode.__file__).parent
    header = (folder / "decode.h").read_text()
    assert int(re.search(r"constexpr int kMaxSplits = (\d+);", header).group(1)) == decode.MAX_SPLITS
    assert int(re.search(r"constexpr int kCudaCoreStages = (\d+);", header).group(1)) == decode.CUDA_CORE_STAGES
    stages = re.search(r"bool tensor_core_stages\(int64_t s\) \{ return ([^;]*);", header).group(1)
    assert tuple(int(x) for x in re.findall(r"s == (\d+)", stages)) == decode.TENSOR_CORE_STAGES
    pages = re.search(r"bool supported_page_size\(int64_t n\) \{ return ([^;]*);", header).group(1)
    assert tuple(int(x) for x in re.findall(r"n == (\d+)", pages)) == decode.PAGE_SIZES
    stream = (folder / "decode_stream.cuh").read_text()
    assert int(re.search(r"kBc = (\d+) / \(D \* sizeof\(T\)\);", stream).group(1)) == decode.TILE_BYTES


def test_split_kernels_start_their_tiles_on_a_128_byte_boundary():
    """The in-kernel merge (decode_merge.cuh) has static shared memory, which the compiler places
    before the dynamic region: declared __align__(16), the tiles started 16 bytes past a 128-byte
    boundary and cp.async fetched sectors from L2 twice (README "Swizzled tiles: every sector read
    once"). No GPU test sees it (the results are right, only slower), so the sources are read."""
    folder = Path(decode.__file__).parent
    assert "__shared__ int" in (folder / "decode_merge.cuh").read_text()
    for name in ("decode_split.cu", "decode_split_tc.cu"):
        source = (folder / name).read_text()
        declarations = re.findall(r"extern __shared__ (__align__\(\d+\) )?unsigned char smem\[\];", source)
        assert declarations == ["__align__(128) "], f"{name}: {declarations}"


@requires_gpu
@pytest.mark.parametrize("kernel", decode.KERNELS)
@pytest.mark.parametrize("layout", [None, 64], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("L", [1, 17, 1000, 4096, 32768])
@pytest.mark.parametrize("Sq", [1, 2, 16])
def test_lengths_and_new_tokens(Sq, L, layout, kernel):
    if L < Sq:
        pytest.skip("a cache shorter than the new tokens is invalid (tested in test_bad_lengths_give_nan)")
    B, H, H_kv = (1, 8, 2) if L >= 4096 else (2, 8, 2)
    check(*make_case([L] * B, H, H_kv, Sq, 128, torch.float16, layout), kernel=kernel)


@requires_gpu
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", decode.DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("D", decode.SUPPORTED_D)
@pytest.mark.parametrize("Sq", [1, 16])
@pytest.mark.parametrize("kernel", decode.KERNELS)
def test_head_dims_and_dtypes(kernel, Sq, D, dtype, layout):
    """Every compiled kernel (split kernel x dtype x D x layout), ragged lengths, forced splits and one split."""
    case = make_case([Sq, 700, 1000], 4, 1, Sq, D, dtype, layout)
    check(*case, kernel=kernel)
    check(*case, num_splits=1, kernel=kernel)
    check(*case, num_splits=5, kernel=kernel)


@requires_gpu
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", decode.TENSOR_CORE_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("D", decode.TENSOR_CORE_D)
@pytest.mark.parametrize("stages", decode.TENSOR_CORE_STAGES)
def test_tensor_core_ring_depths(stages, D, dtype, layout):
    """Every ring the tensor-core kernel is compiled with, whichever the GPU would choose: splits of
    many tiles (the ring wraps several times), of a few, of one, of none (more splits than tiles)."""
    smem = decode.tensor_core_smem_bytes(stages)
    if smem > decode.smem_per_block(torch.cuda.current_device()):
        pytest.skip(f"{stages} stages need {smem} bytes of shared memory per block, more than this GPU has")
    case = make_case([2000, 2, 130, 777], 8, 2, 2, D, dtype, layout)
    for num_splits in (1, 3, 40):
        check(*case, num_splits=num_splits, kernel="tensor_cores", stages=stages)


@requires_gpu
@pytest.mark.parametrize("page_size", decode.PAGE_SIZES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("Sq", [1, 2])
@pytest.mark.parametrize("kernel", decode.KERNELS)
def test_page_sizes_and_groups(kernel, Sq, group, page_size):
    check(*make_case([1000, 17, 300, 2], 2 * group, 2, Sq, 128, torch.bfloat16, page_size), kernel=kernel)


@requires_gpu
@pytest.mark.parametrize("H,H_kv,Sq", [(32, 1, 16), (6, 2, 16), (6, 3, 5), (12, 4, 3), (64, 8, 1)])
@pytest.mark.parametrize("kernel", decode.KERNELS)
def test_many_rows_per_kv_head(kernel, H, H_kv, Sq):
    """R = (H / H_kv) * Sq rows per KV head past one block (row chunks), uneven chunks, odd groups."""
    case = make_case([Sq + 40, 1500], H, H_kv, Sq, 64, torch.float16, None)
    check(*case, kernel=kernel)
    check(*case, num_splits=3, kernel=kernel)


@requires_gpu
@pytest.mark.parametrize("layout", [None, 16, 256], ids=["contiguous", "paged16", "paged256"])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 7, 64, 300])
def test_num_splits(num_splits, layout):
    """Forced split counts, more splits than tiles (empty splits) and the automatic choice agree."""
    check(*make_case([5000, 3, 640], 8, 2, 3, 128, torch.float16, layout, spare=100), num_splits=num_splits)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_ragged_batch_with_spare_capacity(dtype):
    """Very different lengths in one batch, a cache far longer than any of them, a custom scale."""
    lengths = [16, 17, 63, 64, 65, 1000, 4095, 4097]
    for layout in (None, 32):
        check(*make_case(lengths, 8, 4, 16, 64, dtype, layout, spare=3000), scale=0.3)


@requires_gpu
@pytest.mark.parametrize("kernel", decode.KERNELS)
def test_large_magnitude_scores(kernel):
    """Scores of several hundred: the online softmax and the merges must not overflow."""
    q, k, v, lengths, table, info = make_case([3000, 200], 4, 2, 2, 128, torch.float16, None)
    check(q * 8, k * 8, v, lengths, table, info, num_splits=6, kernel=kernel)


@requires_gpu
@pytest.mark.parametrize("kernel", decode.KERNELS)
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
def test_keys_past_the_length_are_never_used(layout, kernel):
    """NaN in the cache past each length (and in free pages) must not reach the output."""
    q, k, v, lengths, table, info = make_case([70, 1000], 8, 2, 4, 128, torch.float16, layout, spare=200)
    expected = run(q, k, v, lengths, table, num_splits=3, kernel=kernel)
    if table is None:
        k[0, :, 70:] = float("nan")
        v[0, :, 70:] = float("nan")
        k[1, :, 1000:] = float("inf")
        v[1, :, 1000:] = float("nan")
    # (paged: make_case already fills every unused slot and page with NaN)
    out = run(q, k, v, lengths, table, num_splits=3, kernel=kernel)
    assert torch.equal(out, expected), f"cache entries past the length reached the output {info}"
    assert not out.isnan().any(), info


@requires_gpu
@pytest.mark.parametrize("num_splits", [2, 7, 300])
@pytest.mark.parametrize("D", decode.SUPPORTED_D)
@pytest.mark.parametrize("kernel", decode.KERNELS)
def test_merge_kernel(kernel, D, num_splits):
    """fused_merge=False: the split kernel writes partials only and the merge kernel merges them
    (the other tests run the default, the split kernel's in-kernel merge)."""
    case = make_case([5000, 3, 640], 8, 2, 3, D, torch.float16, None)
    check(*case, num_splits=num_splits, kernel=kernel, fused_merge=False)


@requires_gpu
@pytest.mark.parametrize("kernel", decode.KERNELS)
def test_in_kernel_merge_counters_per_stream_and_in_graphs(kernel):
    """The in-kernel merge's counters are zeroed once per stream and left at zero by every call:
    calls on two streams in flight together, a call captured in a CUDA graph and replayed, and the
    calls after it all merge every row group (a counter left behind would skip a merge)."""
    q, k, v, lengths, table, info = make_case([3000, 2000, 700], 8, 2, 2, 128, torch.float16, None)
    expected = run(q, k, v, lengths, table, num_splits=9, kernel=kernel)
    results = outputs_across_streams_and_graphs(
        lambda: decode.attention(q, k, v, lengths, num_splits=9, kernel=kernel),
        after=lambda: run(q, k, v, lengths, table, num_splits=9, kernel=kernel))
    for name, out in results.items():
        assert torch.equal(out, expected), f"the {name} call differs from the first {info}"


@requires_gpu
def test_splits_are_deterministic_and_one_split_matches_many():
    q, k, v, lengths, table, info = make_case([3000, 2000], 8, 8, 1, 64, torch.float32, None)
    one = run(q, k, v, lengths, table, num_splits=1)
    assert torch.equal(one, run(q, k, v, lengths, table, num_splits=1)), info
    many = run(q, k, v, lengths, table, num_splits=9)
    assert torch.equal(many, run(q, k, v, lengths, table, num_splits=9)), info
    assert_close(many, one.double(), dtype=torch.float32, seed_info=info)


@requires_gpu
def test_cache_is_never_copied():
    """GQA reads K/V in place: the op's extra memory is far below one copy of the cache."""
    q, k, v, lengths, table, info = make_case([8192] * 4, 32, 4, 1, 128, torch.float16, None)
    decode.attention(q, k, v, lengths)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    decode.attention(q, k, v, lengths, num_splits=8)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < k.numel() * k.element_size() // 4, f"{extra} bytes allocated for a {k.numel() * 2}-byte cache"


@requires_gpu
def test_non_contiguous_q_and_default_device():
    q, k, v, lengths, table, info = make_case([300, 40], 8, 2, 3, 64, torch.float16, None)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    assert not q_t.is_contiguous()
    assert_close(decode.attention(q_t, k, v, lengths), reference.decode_attention(q, k, v, lengths),
                 dtype=torch.float16, rel_tol=TOL[torch.float16], seed_info=info)


@requires_gpu
@pytest.mark.parametrize("Sq", [1, 4])
def test_full_cache_matches_sdpa_with_gqa(Sq):
    """On a full cache the bottom-right rule is torch SDPA's with an explicit mask (and no mask at
    Sq = 1): the same answer as sdpa(enable_gqa=True), within the dtype's tolerance."""
    import torch.nn.functional as F

    q, k, v, lengths, table, info = make_case([777, 777], 16, 4, Sq, 128, torch.float16, None)
    visible = torch.ones(Sq, 777, dtype=torch.bool, device="cuda").tril(777 - Sq)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    ref = reference.decode_attention(q, k, v, lengths)
    assert_close(expected, ref, dtype=torch.float16, rel_tol=TOL[torch.float16], what="sdpa", seed_info=info)
    assert_close(decode.attention(q, k, v, lengths), ref, dtype=torch.float16, rel_tol=TOL[torch.float16],
                 seed_info=info)


@requires_gpu
def test_fake_tensor_shapes():
    """The registered fake implementation (for torch.compile) gives the output's and lse's shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = decode.load()
    with FakeTensorMode():
        q = torch.empty(2, 8, 3, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 2, 40, 64, dtype=torch.bfloat16, device="cuda")
        lengths = torch.empty(2, dtype=torch.int32, device="cuda")
        out, lse = ops.attention(q, k, k, lengths, None, 0.125, 2, 12, True, 3, True)
    assert out.shape == (2, 8, 3, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 8, 3) and lse.dtype == torch.float32


def test_import_builds_nothing():
    """Importing the module (and the phase package) must not build or load the extension."""
    import subprocess
    import sys

    from utils.build import REPO_ROOT

    proc = subprocess.run([sys.executable, "-c", "import phase5_fused.decode; from utils.build import LOADED_OPS; "
                           "assert not LOADED_OPS"], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Bad values on the device: NaN rows from the kernel, ValueError from the debug check


@requires_gpu
@pytest.mark.parametrize("kernel", decode.KERNELS)
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_bad_lengths_give_nan_rows_only_there(num_splits, layout, kernel):
    q, k, v, lengths, table, info = make_case([500, 500, 500], 4, 2, 4, 64, torch.float16, layout)
    capacity = k.shape[2] if table is None else table.shape[1] * k.shape[2]
    bad = torch.tensor([500, 3, capacity + 1], dtype=torch.int32, device="cuda")  # ok, < Sq, > capacity
    out, lse = decode.attention(q, k, v, bad, page_table=table, num_splits=num_splits, return_lse=True,
                                kernel=kernel)
    assert out[1:].isnan().all() and lse[1:].isnan().all(), f"bad lengths must give NaN rows {info}"
    ref = reference.decode_attention(q[:1], k if table is not None else k[:1], v if table is not None else v[:1],
                                     bad[:1], page_table=None if table is None else table[:1])
    assert_close(out[:1], ref, dtype=torch.float16, rel_tol=TOL[torch.float16], seed_info=info)
    with pytest.raises(ValueError, match=r"cache_lengths\[1\] = 3"):
        decode.attention(q, k, v, bad, page_table=table, check_values=True)
    with pytest.raises(ValueError, match="cache_lengths"):
        decode.attention(q, k, v, bad.clamp(min=4), page_table=table, check_values=True)


@requires_gpu
@pytest.mark.parametrize("kernel", decode.KERNELS)
@pytest.mark.parametrize("num_splits", [1, 6])
@pytest.mark.parametrize("entry", [-1, 10**6])
def test_bad_page_entries_give_nan_rows_only_there(entry, num_splits, kernel):
    q, k, v, lengths, table, info = make_case([1000, 1000], 4, 2, 1, 64, torch.float16, 16, spare=200)
    table[1, 40] = entry  # a page sequence 1 uses
    table[0, math.ceil(1000 / 16):] = 10**6  # entries past sequence 0's pages: never read, harmless
    out = decode.attention(q, k, v, lengths, page_table=table, num_splits=num_splits, kernel=kernel)
    assert out[1].isnan().all(), f"a bad page must make its sequence's rows NaN {info}"
    assert not out[0].isnan().any(), info
    with pytest.raises(ValueError, match=r"page_table\[1, 40\]"):
        decode.attention(q, k, v, lengths, page_table=table, check_values=True)


# ------------------------------------------------------------------------------------------------
# Bad input: each error names the argument


def cpu_case(B=2, H=8, H_kv=2, Sq=1, S=64, D=64, dtype=torch.float16):
    q = torch.randn(B, H, Sq, D).to(dtype)
    k = torch.randn(B, H_kv, S, D).to(dtype)
    return q, k, k.clone(), torch.full((B,), S, dtype=torch.int32)


def paged_cpu_case(page_size=16, pages=8, B=2):
    q, _, _, lengths = cpu_case(B=B)
    k = torch.randn(pages, 2, page_size, 64).to(torch.float16)
    table = torch.zeros(B, 4, dtype=torch.int32)
    return q, k, k.clone(), lengths.clamp(max=4 * page_size), table


BAD_INPUTS = {
    "heads not a multiple": (lambda q, k, v, n: (q[:, :5], k, v, n), {}, ValueError, "multiple"),
    "Sq > 16": (lambda q, k, v, n: (q.expand(-1, -1, 17, -1), k, v, n), {}, ValueError, "Sq"),
    "D unsupported": (lambda q, k, v, n: (q[..., :32], k[..., :32], v[..., :32], n), {}, ValueError, "head dim"),
    "q dtype": (lambda q, k, v, n: (q.double(), k, v, n), {}, TypeError, "q must have dtype"),
    "k dtype differs": (lambda q, k, v, n: (q, k.float(), v, n), {}, TypeError, "k_cache and v_cache"),
    "k_cache 3-D": (lambda q, k, v, n: (q, k[0], v, n), {}, ValueError, "k_cache must be 4-D"),
    "v_cache shape": (lambda q, k, v, n: (q, k, v[:, :, :10], n), {}, ValueError, "v_cache"),
    "k_cache head dim": (lambda q, k, v, n: (q, torch.cat([k, k], -1), torch.cat([v, v], -1), n), {}, ValueError,
                         "head dim"),
    "k_cache batch": (lambda q, k, v, n: (q, k[:1], v[:1], n), {}, ValueError, "k_cache must be"),
    "lengths dtype": (lambda q, k, v, n: (q, k, v, n.long()), {}, TypeError, "cache_lengths must be int32"),
    "lengths shape": (lambda q, k, v, n: (q, k, v, n[:1]), {}, ValueError, "cache_lengths"),
    "lengths not a tensor": (lambda q, k, v, n: (q, k, v, [64, 64]), {}, TypeError, "cache_lengths"),
    "scale": (lambda q, k, v, n: (q, k, v, n), {"scale": float("nan")}, ValueError, "scale"),
    "num_splits": (lambda q, k, v, n: (q, k, v, n), {"num_splits": 0}, ValueError, "num_splits"),
    "kernel name": (lambda q, k, v, n: (q, k, v, n), {"kernel": "wgmma"}, ValueError, "kernel must be one of"),
    "kernel for FP32": (lambda q, k, v, n: (q.float(), k.float(), v.float(), n), {"kernel": "tensor_cores"},
                        ValueError, "kernel='tensor_cores' takes"),
    "stages": (lambda q, k, v, n: (q, k, v, n), {"stages": 4}, ValueError, "stages must be one of"),
    "stages not an int": (lambda q, k, v, n: (q, k, v, n), {"stages": 3.0}, ValueError, "stages must be one of"),
    "fused_merge not a bool": (lambda q, k, v, n: (q, k, v, n), {"fused_merge": 1}, ValueError, "fused_merge must be"),
    "stages for CUDA cores": (lambda q, k, v, n: (q, k, v, n), {"stages": 3, "kernel": "cuda_cores"}, ValueError,
                              "stages must be one of .* cuda_cores"),
    "on the CPU": (lambda q, k, v, n: (q, k, v, n), {}, ValueError, "must be a CUDA tensor"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_are_rejected_on_the_cpu(name):
    """Every structural check runs before the device checks, so the CPU sees each message."""
    transform, kwargs, error, message = BAD_INPUTS[name]
    with pytest.raises(error, match=message):
        decode.attention(*transform(*cpu_case()), **kwargs)


@pytest.mark.parametrize("change,message", [
    (lambda q, k, v, n, t: (q, k[:, :, :10], v[:, :, :10], n, t), "page_size"),
    (lambda q, k, v, n, t: (q, k, v, n, t.long()), "page_table must be int32"),
    (lambda q, k, v, n, t: (q, k, v, n, t[:1]), "page_table must be"),
    (lambda q, k, v, n, t: (q, k, v, n, t[0]), "page_table must be 2-D"),
    (lambda q, k, v, n, t: (q, k[:0], v[:0], n, t), "at least one page"),
])
def test_bad_paged_inputs_are_rejected_on_the_cpu(change, message):
    q, k, v, n, t = change(*paged_cpu_case())
    with pytest.raises((ValueError, TypeError), match=message):
        decode.attention(q, k, v, n, page_table=t)


def test_value_checks_on_the_cpu():
    """check_cache_values reads the values (lengths in [Sq, capacity], used page entries in range)."""
    lengths = torch.tensor([16, 40, 64], dtype=torch.int32)
    decode.check_cache_values(lengths, None, Sq=16, capacity=64)
    with pytest.raises(ValueError, match=r"cache_lengths\[0\] = 16 .*Sq=17"):
        decode.check_cache_values(lengths, None, Sq=17, capacity=64)
    with pytest.raises(ValueError, match=r"cache_lengths\[2\] = 64 .*capacity=63"):
        decode.check_cache_values(lengths, None, Sq=1, capacity=63)
    table = torch.tensor([[0, -1, -1, -1], [1, 2, 3, -1], [4, 5, 6, 7]], dtype=torch.int32)
    decode.check_cache_values(lengths, table, Sq=1, capacity=64, num_pages=8)  # -1 only past the used pages
    with pytest.raises(ValueError, match=r"page_table\[2, 3\] = 7"):
        decode.check_cache_values(lengths, table, Sq=1, capacity=64, num_pages=7)
    table[1, 2] = -1
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] = -1"):
        decode.check_cache_values(lengths, table, Sq=1, capacity=64, num_pages=8)


def test_kernel_choice():
    """kernel=None takes the tensor cores exactly where they take the inputs."""
    for dtype in decode.DTYPES:
        for D in decode.SUPPORTED_D:
            tc = dtype in decode.TENSOR_CORE_DTYPES and D in decode.TENSOR_CORE_D
            assert decode.choose_kernel(dtype, D) == ("tensor_cores" if tc else "cuda_cores")
    assert set(decode.TENSOR_CORE_D) <= set(decode.SUPPORTED_D)


def test_split_heuristic():
    """The fewest splits whose blocks fill the waves to WAVE_FILL, never splits shorter than
    MIN_KEYS_PER_SPLIT of the capacity (the counts the splits table measured fastest on 132 SMs)."""
    sms = 132
    assert decode.choose_num_splits(16 * 8, 32768, sms) == 1             # 128 blocks: one wave already
    assert decode.choose_num_splits(64 * 8, 4096, sms) == 1              # 512 blocks: 4 waves, 97% full
    assert decode.choose_num_splits(8, 131072, sms) == 16                # 128 blocks, not 136 (17)
    assert decode.choose_num_splits(8, 4096, sms) == 16
    assert decode.choose_num_splits(8, 2048, sms) == 8                   # capped by the keys: 8 x 256
    assert decode.choose_num_splits(3 * 8, 131072, sms) == 11            # 264 blocks, two full waves
    assert decode.choose_num_splits(8, 17, sms) == 1                     # too few keys to split
    assert decode.choose_num_splits(16 * 8, 32768, sms, paged=True) == 2  # paged: two blocks per SM
    assert decode.choose_num_splits(8, 131072, sms, paged=True) == 32     # 256 blocks, two on most SMs
    assert decode.choose_num_splits(64 * 8, 4096, sms, paged=True) == 1
    for blocks in (1, 7, 100, 300):
        for capacity in (1, 300, 5000, 10**6):
            n = decode.choose_num_splits(blocks, capacity, sms)
            assert 1 <= n <= decode.MAX_SPLITS
            assert n == 1 or capacity // n >= decode.MIN_KEYS_PER_SPLIT


def test_benchmark_pages_hold_the_cache():
    """run.py's paged copy (built one tensor at a time, one sequence at a time) holds the contiguous
    cache: every physical page used once, and the reference reads the same attention from both."""
    from phase5_fused.decode import run as bench

    B, H_kv, S, D, page_size = 3, 2, 96, 8, 16
    q = randn(B, 4, 2, D, dtype=torch.float64, device="cpu", seed=1)
    k = randn(B, H_kv, S, D, dtype=torch.float64, device="cpu", seed=2)
    v = randn(B, H_kv, S, D, dtype=torch.float64, device="cpu", seed=3)
    table = bench.page_order(B, S, page_size, seed=4)
    assert table.dtype == torch.int32 and table.shape == (B, S // page_size)
    assert sorted(table.flatten().tolist()) == list(range(B * S // page_size))
    assert not torch.equal(table.flatten(), torch.arange(B * S // page_size, dtype=torch.int32))  # shuffled
    lengths = torch.tensor([S, 40, 1], dtype=torch.int32)
    paged = reference.decode_attention(q, bench.to_pages(k, table), bench.to_pages(v, table), lengths,
                                       page_table=table)
    assert torch.equal(paged, reference.decode_attention(q, k, v, lengths))


# The most shared memory per block (opted in) and per SM, in bytes, and what each block of an SM
# reserves besides its own (sm_90: 1 KB).
SMEM = {"sm_90": (227 * 1024, 228 * 1024), "sm_80": (163 * 1024, 164 * 1024), "sm_86": (99 * 1024, 100 * 1024)}
RESERVED_PER_BLOCK = 1024


def test_stage_choice():
    """The ring of the tensor-core kernel: the deepest of TENSOR_CORE_STAGES that the device's
    shared memory per block holds (3 on sm_80, sm_86 / sm_89 and sm_90), 2 where 3 do not fit;
    CUDA cores keep 2."""
    # 16 KB of K and of V per stage, swizzled rows without padding: 32 KB whatever D and the dtype.
    assert decode.tensor_core_smem_bytes(2) == 64 * 1024
    assert decode.tensor_core_smem_bytes(3) == 96 * 1024
    for arch in SMEM:
        assert decode.choose_stages("tensor_cores", SMEM[arch][0]) == max(decode.TENSOR_CORE_STAGES) == 3
        assert decode.choose_stages("cuda_cores", SMEM[arch][0]) == decode.CUDA_CORE_STAGES == 2
    assert decode.choose_stages("tensor_cores", 64 * 1024) == 2  # three stages do not fit
    assert decode.choose_stages("tensor_cores", 0) == min(decode.TENSOR_CORE_STAGES)
    # The deepest ring still leaves sm_90 two blocks per SM (a fourth stage would not).
    assert SMEM["sm_90"][1] // (decode.tensor_core_smem_bytes(3) + RESERVED_PER_BLOCK) == 2
    assert SMEM["sm_90"][1] // (decode.tensor_core_smem_bytes(4) + RESERVED_PER_BLOCK) == 1


def test_rows_per_block_chunks_evenly():
    assert decode.rows_per_block(1) == 1
    assert decode.rows_per_block(16) == 16
    assert decode.rows_per_block(24) == 12
    assert decode.rows_per_block(512) == 16
    for rows in range(1, 300):
        r = decode.rows_per_block(rows)
        chunks = math.ceil(rows / r)
        assert r <= decode.MAX_ROWS_PER_BLOCK and chunks == math.ceil(rows / decode.MAX_ROWS_PER_BLOCK)


@requires_gpu
@pytest.mark.parametrize("case,message", [
    ("q on cpu", "q must be a CUDA tensor"),
    ("k_cache on cpu", "k_cache must be a CUDA tensor"),
    ("lengths on cpu", "cache_lengths must be a CUDA tensor"),
    ("table on cpu", "page_table must be a CUDA tensor"),
    ("k_cache strided", "k_cache must be contiguous"),
])
def test_bad_devices_and_layouts(case, message):
    q, k, v, lengths, table, _ = make_case([100, 100], 4, 2, 1, 64, torch.float16, 16)
    if case == "q on cpu":
        q = q.cpu()
    elif case == "k_cache on cpu":
        k = k.cpu()
    elif case == "lengths on cpu":
        lengths = lengths.cpu()
    elif case == "table on cpu":
        table = table.cpu()
    else:
        k = k.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match=message):
        decode.attention(q, k, v, lengths, page_table=table)


@requires_gpu
@pytest.mark.parametrize("args,message", [
    ({"Sq": 17}, "Sq"),
    ({"H": 6}, "multiple"),
    ({"page_size": 48}, "page_size"),
    ({"num_splits": 0}, "num_splits"),
    ({"rows_per_block": 17}, "rows_per_block"),
    ({"lengths_dtype": torch.int64}, "cache_lengths must be int32"),
    ({"tensor_cores": True, "dtype": torch.float32}, "tensor-core kernel takes"),
    ({"tensor_cores": True, "stages": 4}, "stages"),
    ({"stages": 3}, "stages"),
])
def test_the_op_checks_again(args, message):
    """The C++ op repeats the checks (TORCH_CHECK) for callers that skip the Python API."""
    H, Sq, page_size = args.get("H", 8), args.get("Sq", 1), args.get("page_size", 16)
    dtype = args.get("dtype", torch.float16)
    q = torch.randn(2, H, Sq, 64, device="cuda", dtype=dtype)
    k = torch.randn(8, 4, page_size, 64, device="cuda", dtype=dtype)
    table = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    lengths = torch.full((2,), 32, dtype=args.get("lengths_dtype", torch.int32), device="cuda")
    with pytest.raises(RuntimeError, match=message):
        decode.load().attention(q, k, k, lengths, table, 0.125, args.get("num_splits", 1),
                                args.get("rows_per_block", 8), args.get("tensor_cores", False),
                                args.get("stages", 2), True)
