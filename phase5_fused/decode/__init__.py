"""Phase 5, decoding: attention of a few new tokens against a long KV cache, split over the keys
(flash-decoding), with grouped-query attention and a paged cache (decode_split.cu, decode_split_tc.cu;
the merge of the splits in decode_merge.cuh, run by the split kernel itself or by decode_merge.cu).

    from phase5_fused import decode
    out = decode.attention(q, k_cache, v_cache, cache_lengths)                        # contiguous cache
    out = decode.attention(q, k_pages, v_pages, cache_lengths, page_table=page_table)  # paged cache

Shapes: q [B, H, Sq, D] with 1 <= Sq <= MAX_SQ; a contiguous cache k/v [B, H_kv, S_max, D], or a
paged one k/v [num_pages, H_kv, page_size, D] with page_table [B, max_pages] int32 (logical page p
of sequence b lives in physical page page_table[b, p]); cache_lengths [B] int32. H must be a
multiple of H_kv: query head h reads KV head h // (H // H_kv), and K/V are never copied per query
head. D in SUPPORTED_D; page_size in PAGE_SIZES; dtypes DTYPES (q, k and v alike).

Masking is bottom-right causal: sequence b holds L = cache_lengths[b] keys (0 .. L-1), and the Sq
queries are its LAST Sq tokens, so query i sees the keys j <= L - Sq + i. L >= Sq is required (the
new tokens' own keys are in the cache). With Sq = 1 the query sees the whole cache.

The values of cache_lengths and page_table live on the GPU; reading them here would wait for the
GPU on every step, so the fast path does not. A sequence whose length is outside [Sq, capacity] or
whose page-table entries (those its keys use) are outside [0, num_pages) gets NaN output rows (and
NaN lse) from the kernel, which never reads out of bounds; check_values=True (or
check_cache_values) checks them on the host first and raises ValueError naming the argument, a
debugging aid that costs a GPU sync.

Importing this module builds nothing; load() builds the extension on first use.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from utils.build import op_loader
from utils.checks import check_kv_heads, check_tensor, dim_in

NAME = "phase5_fused_decode"
SOURCES = ["decode_split.cu", "decode_split_tc.cu", "decode_merge.cu", "decode_ops.cpp"]
SUPPORTED_D = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PAGE_SIZES = (16, 32, 64, 128, 256)
MAX_SQ = 16
# The split kernels (README "Two split kernels"): on CUDA cores (every dtype and D) or on tensor
# cores (mma.sync; FP16/BF16 at D in TENSOR_CORE_D). kernel=None picks the tensor cores where they
# take the inputs.
KERNELS = ("cuda_cores", "tensor_cores")
TENSOR_CORE_D = (64, 128)
TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
# The most query rows (query heads of one KV head x new tokens) one block holds (decode.h kMaxRows).
MAX_ROWS_PER_BLOCK = 16
# Split heuristic (choose_num_splits): the fewest splits whose blocks fill the SMs' waves to at
# least WAVE_FILL on average, each split at least MIN_KEYS_PER_SPLIT keys.
WAVE_FILL = 0.95
# A paged cache fills PAGED_BLOCKS_PER_SM blocks per SM: each tile's copies wait on a page-table
# load first, and a lone block per SM cannot hide it (README "How many splits: measured").
PAGED_BLOCKS_PER_SM = 2
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 1024  # decode.h kMaxSplits
# The split kernels' cp.async ring of K and V tiles (README "More bytes in flight: a deeper ring";
# decode.h): the CUDA-core kernel has CUDA_CORE_STAGES stages; the tensor-core kernel is compiled
# with each count of TENSOR_CORE_STAGES and runs the deepest that the device's shared memory per
# block holds (choose_stages). A stage is TILE_BYTES of K and
# TILE_BYTES of V (decode_stream.cuh KvTile: swizzled rows on tensor cores, rows padded by 16 bytes
# on CUDA cores).
CUDA_CORE_STAGES = 2
TENSOR_CORE_STAGES = (2, 3)
TILE_BYTES = 16384


def _register_fakes() -> None:
    """Meta implementations, so torch.compile can trace the op without running it."""

    @torch.library.register_fake(f"{NAME}::attention")
    def _attention_fake(q, k_cache, v_cache, cache_lengths, page_table, scale, num_splits, rows_per_block,
                        tensor_cores, stages, fused_merge):
        B, H, Sq, _ = q.shape
        return torch.empty_like(q), q.new_empty((B, H, Sq), dtype=torch.float32)


load = op_loader(Path(__file__).parent, NAME, SOURCES, _register_fakes)


# ------------------------------------------------------------------------------------------------
# Launch geometry


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """The GPU's number of SMs (asked once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def smem_per_block(device_index: int) -> int:
    """The most shared memory one block may opt in to on the GPU, in bytes (asked once per device):
    227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86 and sm_89."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def tensor_core_smem_bytes(stages: int) -> int:
    """Shared memory of one block of the tensor-core split kernel with a ring of `stages` stages
    (decode_split_tc.cu TcTile::smem_bytes; its final merge of the warps reuses the same bytes):
    TILE_BYTES of K and TILE_BYTES of V per stage, swizzled rows without padding, whatever D and
    the dtype."""
    return 2 * stages * TILE_BYTES


@functools.lru_cache(maxsize=64)
def choose_stages(kernel: str, max_smem_per_block: int) -> int:
    """The ring's stages for `kernel` (one of KERNELS): CUDA_CORE_STAGES on CUDA cores; on tensor
    cores the most of TENSOR_CORE_STAGES whose tiles fit max_smem_per_block bytes (3 on every GPU
    with cp.async: 96 KB), whatever the grid (README "Swizzled tiles: every sector read once": with
    the tiles aligned, the third stage pays with one block per SM too)."""
    if kernel != "tensor_cores":
        return CUDA_CORE_STAGES
    fits = [s for s in TENSOR_CORE_STAGES if tensor_core_smem_bytes(s) <= max_smem_per_block]
    return max(fits, default=min(TENSOR_CORE_STAGES))


def rows_per_block(rows: int) -> int:
    """Rows per block for R = (H / H_kv) * Sq rows of one KV head: the fewest chunks of at most
    MAX_ROWS_PER_BLOCK rows, as even as possible (R = 24 gives two chunks of 12, not 16 + 8)."""
    chunks = math.ceil(rows / MAX_ROWS_PER_BLOCK)
    return math.ceil(rows / chunks)


@functools.lru_cache(maxsize=4096)
def choose_num_splits(blocks_per_split: int, capacity: int, sms: int, paged: bool = False) -> int:
    """How many ranges to cut each sequence's keys into.

    blocks_per_split: the blocks one split launches (B * H_kv * row chunks); capacity: the keys a
    sequence can hold (the lengths themselves are on the GPU); sms: the GPU's SM count.
    With s splits the grid has n = blocks_per_split * s blocks of equal work, and the busiest SM
    runs ceil(n / sms) of them: the step lasts as long as that SM, so the waves' average fill,
    n / (ceil(n / sms) * sms), is the share of the GPU the step uses. The answer is the fewest
    splits whose fill reaches WAVE_FILL (each split adds partials to merge: the README's splits
    table measured one wave of blocks as fast as several), none shorter than MIN_KEYS_PER_SPLIT
    keys of the capacity; where no count reaches it, the count of the best fill. A paged cache
    fills PAGED_BLOCKS_PER_SM blocks per SM instead of one (waves of that many times sms blocks).
    """
    most = max(1, min(capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
    slots = sms * (PAGED_BLOCKS_PER_SM if paged else 1)
    best, best_fill = 1, 0.0
    for splits in range(1, most + 1):
        blocks = blocks_per_split * splits
        fill = blocks / (math.ceil(blocks / slots) * slots)
        if fill >= WAVE_FILL:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
    return best


# ------------------------------------------------------------------------------------------------
# Validation


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_decode_inputs(q, k_cache, v_cache, cache_lengths, page_table=None, scale=None, num_splits=None,
                        kernel=None, stages=None):
    """Shapes, dtypes and arguments first (any device, so they are testable on a CPU), then devices.
    Returns (B, H, Sq, D, H_kv, capacity). Raises TypeError / ValueError naming the argument."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(x, name, dim=4)
        if x.dtype not in DTYPES:
            allowed = ", ".join(_dtype_name(d) for d in DTYPES)
            raise TypeError(f"{name} must have dtype {allowed}, got {_dtype_name(x.dtype)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"k_cache and v_cache must have q's dtype {_dtype_name(q.dtype)}, got "
                        f"{_dtype_name(k_cache.dtype)} and {_dtype_name(v_cache.dtype)}")
    B, H, Sq, D = q.shape
    if min(B, H, Sq, D) == 0:
        raise ValueError(f"q must not be empty, got shape {tuple(q.shape)}")
    if Sq > MAX_SQ:
        raise ValueError(f"q.shape[2] (Sq, new tokens per sequence) must be at most {MAX_SQ}, got {Sq}")
    if not dim_in(D, SUPPORTED_D):
        raise ValueError(f"head dim D={D} (q.shape[-1]) is not supported: use one of {SUPPORTED_D}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    _, H_kv, S, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache must have q's head dim D={D} in its last dimension, got {tuple(k_cache.shape)}")
    check_kv_heads(H, H_kv, "k_cache")
    if page_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache must be [B={B}, H_kv, S_max, D] (or paged, with page_table), "
                             f"got {tuple(k_cache.shape)}")
        capacity = S
    else:
        check_tensor(page_table, "page_table", dim=2)
        if page_table.dtype != torch.int32:
            raise TypeError(f"page_table must be int32, got {_dtype_name(page_table.dtype)}")
        if page_table.shape[0] != B:
            raise ValueError(f"page_table must be [B={B}, max_pages], got {tuple(page_table.shape)}")
        if not dim_in(S, PAGE_SIZES):
            raise ValueError(f"k_cache.shape[2] (page_size) must be one of {PAGE_SIZES}, got {S}")
        if k_cache.shape[0] == 0:
            raise ValueError("k_cache must hold at least one page")
        capacity = page_table.shape[1] * S
    if capacity == 0:
        raise ValueError("the cache must hold at least one key per sequence (S_max or max_pages is 0)")
    check_tensor(cache_lengths, "cache_lengths", dim=1)
    if cache_lengths.dtype != torch.int32:
        raise TypeError(f"cache_lengths must be int32, got {_dtype_name(cache_lengths.dtype)}")
    if cache_lengths.shape[0] != B:
        raise ValueError(f"cache_lengths must have B={B} entries, got {cache_lengths.shape[0]}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an integer in [1, {MAX_SPLITS}] or None, got {num_splits!r}")
    check_stages(stages, check_kernel(kernel, q.dtype, D))
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_lengths", cache_lengths)]
    if page_table is not None:
        named.append(("page_table", page_table))
    for name, x in named:
        if not x.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a KV cache is never copied)")
    return B, H, Sq, D, H_kv, capacity


def check_cache_values(cache_lengths, page_table, Sq: int, capacity: int, num_pages: int | None = None) -> None:
    """The debug check of the values (reads them on the host: a GPU sync). Every length must be in
    [Sq, capacity]; with a page table, every entry a sequence's keys use (pages 0 .. ceil(L /
    page_size) - 1) must be in [0, num_pages). Raises ValueError naming the argument."""
    lengths = cache_lengths.detach().to("cpu", torch.int64)
    low = lengths < Sq
    high = lengths > capacity
    if low.any() or high.any():
        b = int(torch.nonzero(low | high)[0])
        raise ValueError(f"cache_lengths[{b}] = {int(lengths[b])} is outside [Sq={Sq}, capacity={capacity}]: "
                         "the cache must hold the new tokens' keys and fit its length")
    if page_table is None:
        return
    table = page_table.detach().to("cpu", torch.int64)
    page_size = capacity // table.shape[1]
    used = torch.arange(table.shape[1]).view(1, -1) * page_size < lengths.view(-1, 1)
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, page = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"page_table[{b}, {page}] = {int(table[b, page])} is not a page of the cache "
                         f"(num_pages = {num_pages})")


# ------------------------------------------------------------------------------------------------
# The op


def choose_kernel(dtype: torch.dtype, D: int) -> str:
    """The split kernel kernel=None picks: the tensor cores where they take the inputs."""
    return "tensor_cores" if dtype in TENSOR_CORE_DTYPES and dim_in(D, TENSOR_CORE_D) else "cuda_cores"


def check_kernel(kernel, dtype: torch.dtype, D: int) -> str:
    """kernel (one of KERNELS, or None for choose_kernel), checked against the inputs."""
    if kernel is None:
        return choose_kernel(dtype, D)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    if kernel == "tensor_cores" and choose_kernel(dtype, D) != kernel:
        raise ValueError(f"kernel='tensor_cores' takes {'/'.join(_dtype_name(d) for d in TENSOR_CORE_DTYPES)} with "
                         f"D in {TENSOR_CORE_D}, got {_dtype_name(dtype)} and D={D}")
    return kernel


def check_stages(stages, kernel: str) -> None:
    """stages (None, or a ring the kernel is compiled with), checked against the kernel."""
    if stages is None:
        return
    allowed = TENSOR_CORE_STAGES if kernel == "tensor_cores" else (CUDA_CORE_STAGES,)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages not in allowed:
        raise ValueError(f"stages must be one of {allowed} for the {kernel} kernel, or None, got {stages!r}")


def attention(q, k_cache, v_cache, cache_lengths, page_table=None, scale: float | None = None,
              num_splits: int | None = None, return_lse: bool = False, check_values: bool = False,
              kernel: str | None = None, stages: int | None = None, fused_merge: bool = True):
    """softmax(scale q k^T, bottom-right causal) v over each sequence's cached keys.

    q [B, H, Sq, D] (copied if not contiguous); k_cache, v_cache contiguous [B, H_kv, S_max, D], or
    paged [num_pages, H_kv, page_size, D] with page_table [B, max_pages] int32; cache_lengths [B]
    int32, each in [Sq, capacity]. Query i of sequence b sees keys j <= cache_lengths[b] - Sq + i.
    scale: defaults to 1 / sqrt(D). num_splits: key ranges per sequence (None: chosen from the SM
    count and the shape, choose_num_splits). return_lse: also return the rows' natural logsumexp
    [B, H, Sq] (float32). check_values: check cache_lengths and page_table on the host first (a GPU
    sync; without it a bad value gives NaN rows, see the module docstring). kernel: the split
    kernel, one of KERNELS (None: choose_kernel). stages: the split kernel's ring of K/V tiles, one
    of TENSOR_CORE_STAGES on tensor cores, CUDA_CORE_STAGES on CUDA cores (None: choose_stages,
    the deepest the GPU's shared memory per block holds). fused_merge: with several splits, the split
    kernel's blocks merge them (the last block of each row group, README "The merge inside the
    split kernel"); False launches the merge kernel after the split kernel instead.
    Returns out [B, H, Sq, D] in q's dtype (and lse).
    """
    if not isinstance(fused_merge, bool):
        raise ValueError(f"fused_merge must be True or False, got {fused_merge!r}")
    B, H, Sq, D, H_kv, capacity = check_decode_inputs(q, k_cache, v_cache, cache_lengths, page_table, scale,
                                                      num_splits, kernel, stages)
    kernel = kernel or choose_kernel(q.dtype, D)  # (check_decode_inputs checked a named one)
    if check_values:
        check_cache_values(cache_lengths, page_table, Sq, capacity, k_cache.shape[0])
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    rows = (H // H_kv) * Sq
    block_rows = rows_per_block(rows)
    device = None
    if num_splits is None or stages is None:
        device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    blocks = B * H_kv * math.ceil(rows / block_rows)  # per split
    if num_splits is None:
        num_splits = choose_num_splits(blocks, capacity, sm_count(device), page_table is not None)
    if stages is None:
        stages = choose_stages(kernel, smem_per_block(device))
    out, lse = load().attention(q.contiguous(), k_cache, v_cache, cache_lengths, page_table, float(scale),
                                num_splits, block_rows, kernel == "tensor_cores", stages, fused_merge)
    return (out, lse) if return_lse else out
