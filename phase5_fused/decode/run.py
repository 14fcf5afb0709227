"""`python -m phase5_fused.decode.run [--quick] [--no-ncu]`: measure the decoding kernels, then render.

1. One decoding step in FP16 (Sq = 1 new token, H = 32 query heads, H_kv = 8 KV heads, D = 128) on
   a full cache of S in {4K, 32K, 128K} keys, batch B in {1, 16, 64} (points whose K and V pass
   MAX_KV_SHARE of the GPU's memory are skipped): phase5_decode on the contiguous cache (the
   default split kernel, on tensor cores, merging its splits itself), phase5_decode_merge_kernel
   where the step has several splits (the same split kernel followed by the merge kernel:
   fused_merge=False),
   phase5_decode_cuda_cores (the CUDA-core split kernel), phase5_decode_paged on the same
   values in shuffled pages of PAGE_SIZE keys, torch SDPA's flash and cuDNN backends with
   enable_gqa=True on the contiguous cache, and torch_naive (a grouped matmul, softmax, matmul that
   reads K and V once). A backend that refuses enable_gqa is recorded under "skipped", with why,
   and timed on K and V copied per query head instead (rows marked kv_expanded).
   The rows on the contiguous cache are timed in turns (utils.bench.time_in_turns: each round takes
   one sample of each), the paged row and the split-count sweep on their own after them.
   At B = 1, each kernel of one step of phase5_decode, sdpa_flash and sdpa_cudnn timed by
   torch.profiler (the mean over PROFILED_CALLS calls back to back; rows with op "kernel").
   At the points SPLIT_POINTS, phase5_decode at each split count of SPLIT_COUNTS (rows with op
   "splits"; `chosen` marks the heuristic's count).
2. One prefill beside it, for the Roofline: sdpa_flash on B = 1, S = 4096, the same heads, causal.
3. results/metrics.json, then the tables that manifest.json declares (utils.render).

Bandwidth counts the bytes a decoding step must read: gbps = 2 * B * H_kv * S * D * 2 bytes (K and
V, FP16) / time (q and the output, B * H * D elements each, are under 0.1% of it). FLOPs =
4 * B * H * Sq * S * D. --no-ncu is accepted for the common command line (this lesson runs no ncu
step). Without a GPU it measures nothing and renders from the committed results. --quick: S in
{4K, 32K}, B in {1, 16}, written to results/quick/metrics.json, not rendered. Under 2 minutes on
an H100.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from phase5_fused import decode
from utils.kernel_bench import lesson_main, results_dir

HERE = Path(__file__).resolve().parent
H, H_KV, D, SQ = 32, 8, 128, 1
DTYPE = torch.float16
CACHE_LENS = (4096, 32768, 131072)
BATCHES = (1, 16, 64)
QUICK_CACHE_LENS, QUICK_BATCHES = (4096, 32768), (1, 16)
PAGE_SIZE = 64
# K + V of one point at most, as a share of the GPU's memory: while the paged copy is built, K's
# pages sit beside K and V (1.5 times their bytes), and the peers' workspaces come on top (34 GB
# at B = 64, 128K keys: 0.4 of an 80 GB H100's 85 GB).
MAX_KV_SHARE = 0.45
REFERENCE_LIMIT = 2**20  # B * H * S at most for the float64 reference (expanded K and V, ~1 GB each)
PREFILL_S = 4096
SDPA = ("sdpa_flash", "sdpa_cudnn")
PROFILED_BATCHES = (1,)  # where a step's time is also taken kernel by kernel (kernel_rows)
PROFILED_CALLS = 20
# The split-count sweep: phase5_decode at each count of SPLIT_COUNTS (those that leave a split at
# least MIN_KEYS_PER_SPLIT keys) at these points (S, B), beside the count the heuristic chooses.
SPLIT_POINTS = ((4096, 1), (4096, 16), (4096, 64), (32768, 1), (32768, 16), (131072, 1), (131072, 16))
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


# ------------------------------------------------------------------------------------------------
# Implementations: f(q, k, v, lengths) on the contiguous cache


def sdpa_gqa(name: str):
    """torch SDPA pinned to one backend, with enable_gqa=True: K and V stay [B, H_kv, S, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from utils.peers import SDPA_BACKENDS

    backend = getattr(SDPBackend, SDPA_BACKENDS[name])

    def run(q, k, v, lengths=None, is_causal=False):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)

    return run


def torch_naive(q, k, v, lengths=None):
    """Scores, softmax and output as three kernels, the G query heads of a KV head as one matrix
    (q viewed [B, H_kv, G * Sq, D]), so K and V are read once, as in the kernel."""
    B, Hq, Sq, Dh = q.shape
    H_kv = k.shape[1]
    qg = q.reshape(B, H_kv, (Hq // H_kv) * Sq, Dh)
    s = torch.matmul(qg, k.transpose(-1, -2)) * (Dh ** -0.5)
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v).reshape(B, Hq, Sq, Dh)


def ours(q, k, v, lengths):
    return decode.attention(q, k, v, lengths)


def ours_merge_kernel(q, k, v, lengths):
    return decode.attention(q, k, v, lengths, fused_merge=False)


def ours_cuda_cores(q, k, v, lengths):
    return decode.attention(q, k, v, lengths, kernel="cuda_cores")


def page_order(B: int, S: int, page_size: int, seed: int) -> torch.Tensor:
    """The page table [B, S / page_size] (int32, on the CPU) of a full cache cut into pages and
    shuffled: logical page p of sequence b is physical page table[b, p]."""
    pages = B * (S // page_size)
    return torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).view(B, -1).to(torch.int32)


def to_pages(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One contiguous cache [B, H_kv, S, D] (K or V) as the pages [B * S / page_size, H_kv,
    page_size, D] that `table` (page_order's) names, written one sequence at a time: beside x, the
    pages and one sequence's worth of temporaries at most."""
    B, H_kv, S, Dh = x.shape
    per_seq = table.shape[1]
    page_size = S // per_seq
    pages = torch.empty(B * per_seq, H_kv, page_size, Dh, dtype=x.dtype, device=x.device)
    physical = table.to(device=x.device, dtype=torch.int64)
    for b in range(B):
        pages[physical[b]] = x[b].view(H_kv, per_seq, page_size, Dh).transpose(0, 1)
    return pages


# ------------------------------------------------------------------------------------------------
# Benchmark


def kv_bytes(B: int, S: int) -> float:
    """The bytes a decoding step must read: K and V, [B, H_kv, S, D] each, FP16."""
    return 2.0 * B * H_KV * S * D * 2


def decode_row(impl, ms, B, S, call=None, ref=None, **extra) -> dict:
    """One row of the sweep: `impl` took `ms` on the point (B, S); the error of call() against `ref`."""
    from utils import roofline
    from utils.testing import rel_error

    nbytes = kv_bytes(B, S)
    flops = roofline.attention_flops(B, H, SQ, S, D)
    row = {"impl": impl, "op": "decode", "B": B, "H": H, "H_kv": H_KV, "Sq": SQ, "Sk": S, "D": D,
           "dtype": "float16", "causal": False, "ms": ms, "gbps": roofline.gbps(nbytes, ms),
           "tflops": roofline.tflops(flops, ms), "flop_per_byte": flops / nbytes, **extra}
    if ref is not None:
        row["rel_err"] = rel_error(call(), ref)
    print(f"    {impl:<20} B={B:<3} S={S:<6} {ms * 1e3:9.1f} us  {row['gbps']:7.0f} GB/s", flush=True)
    return row


def timed_row(impl, fn, args, B, S, ref=None, **extra) -> dict:
    """decode_row of fn(*args), timed on its own."""
    from utils.bench import time_cuda

    call = lambda: fn(*args)  # noqa: E731
    return decode_row(impl, time_cuda(call), B, S, call, ref, **extra)


def kernel_rows(impl, fn, args, B, S) -> list[dict]:
    """The GPU time of each kernel one call launches (torch.profiler, the mean over PROFILED_CALLS
    calls back to back, after a warm-up call): where the time of a step goes, kernel by kernel."""
    from utils.bench import kernel_times

    fn(*args)
    _, times = kernel_times(lambda: fn(*args), PROFILED_CALLS)
    for name, us in times.items():
        print(f"    {impl:<20} B={B:<3} S={S:<6} {us:9.1f} us  {name[:60]}", flush=True)
    return [{"impl": impl, "op": "kernel", "B": B, "Sk": S, "kernel": name, "ms": us / 1e3}
            for name, us in sorted(times.items(), key=lambda item: -item[1])]


def benchmark(cache_lens, batches) -> tuple[list[dict], dict]:
    from utils import reference
    from utils.bench import sweep, time_in_turns

    skipped: dict = {}
    gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    configs = [{"S": S, "B": B} for S in cache_lens for B in batches if kv_bytes(B, S) <= MAX_KV_SHARE * gpu_bytes]
    for S in cache_lens:
        for B in batches:
            if kv_bytes(B, S) > MAX_KV_SHARE * gpu_bytes:
                skipped[f"B={B} S={S}"] = (f"K and V take {kv_bytes(B, S) / 1e9:.0f} GB "
                                           f"(> {MAX_KV_SHARE:.0%} of the GPU's {gpu_bytes / 1e9:.0f} GB)")

    def run_config(c):
        S, B = c["S"], c["B"]
        gen = torch.Generator(device="cuda").manual_seed(S + B)
        q = torch.randn(B, H, SQ, D, device="cuda", dtype=DTYPE, generator=gen)
        k = torch.randn(B, H_KV, S, D, device="cuda", dtype=DTYPE, generator=gen)
        v = torch.randn(B, H_KV, S, D, device="cuda", dtype=DTYPE, generator=gen)
        lengths = torch.full((B,), S, dtype=torch.int32, device="cuda")
        ref = reference.decode_attention(q, k, v, lengths) if B * H * S <= REFERENCE_LIMIT else None
        blocks = B * H_KV * math.ceil(H // H_KV * SQ / decode.rows_per_block(H // H_KV * SQ))
        sms = decode.sm_count(torch.cuda.current_device())
        splits = decode.choose_num_splits(blocks, S, sms)
        paged_splits = decode.choose_num_splits(blocks, S, sms, paged=True)
        # The implementations on the contiguous cache, timed in turns (one sample of each per round):
        # name -> (fn, args, extra row fields).
        kv_args = (q, k, v, lengths)
        contiguous = {"phase5_decode": (ours, kv_args, {"num_splits": splits}),
                      "phase5_decode_cuda_cores": (ours_cuda_cores, kv_args, {"num_splits": splits})}
        if splits > 1:
            contiguous["phase5_decode_merge_kernel"] = (ours_merge_kernel, kv_args, {"num_splits": splits})
        contiguous["torch_naive"] = (torch_naive, kv_args, {})
        for name in SDPA:
            fn = sdpa_gqa(name)
            try:
                fn(q, k, v)
                contiguous[name] = (fn, kv_args, {})
                continue
            except RuntimeError as exc:
                skipped[f"{name} B={B} S={S}"] = str(exc).splitlines()[0][:200]
                print(f"    {name}: enable_gqa refused ({skipped[f'{name} B={B} S={S}']})", flush=True)
            # The backend refused enable_gqa: time it on K and V copied per query head (made outside
            # the timing; the step then reads H / H_kv times the bytes), marked kv_expanded.
            try:
                k_e, v_e = (x.repeat_interleave(H // H_KV, dim=1) for x in (k, v))
                contiguous[name] = (fn, (q, k_e, v_e, lengths), {"kv_expanded": True})
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                skipped[f"{name} expanded B={B} S={S}"] = str(exc).splitlines()[0][:200]
            k_e = v_e = None
        calls = {name: lambda fn=fn, args=args: fn(*args) for name, (fn, args, _) in contiguous.items()}
        times = time_in_turns(calls)
        rows = [decode_row(name, times[name], B, S, calls[name], ref, **extra)
                for name, (_, _, extra) in contiguous.items()]
        profiled = [(name, contiguous[name][0]) for name in ("phase5_decode", "phase5_decode_merge_kernel", *SDPA)
                    if name in contiguous and not contiguous[name][2].get("kv_expanded")]
        contiguous = calls = None
        torch.cuda.empty_cache()
        del ref
        if B in PROFILED_BATCHES:
            for impl, impl_fn in profiled:
                rows += kernel_rows(impl, impl_fn, kv_args, B, S)
        if (S, B) in SPLIT_POINTS:
            rows += split_rows(kv_args, B, S, splits)
        # The paged copy, one tensor at a time: K's pages beside K and V, then K freed before V's.
        table = page_order(B, S, PAGE_SIZE, seed=S + B).cuda()
        del kv_args
        k_pages = to_pages(k, table)
        del k
        torch.cuda.empty_cache()
        v_pages = to_pages(v, table)
        del v
        torch.cuda.empty_cache()
        paged = lambda q_, k_, v_, n_: decode.attention(q_, k_, v_, n_, page_table=table)  # noqa: E731
        rows.append(timed_row("phase5_decode_paged", paged, (q, k_pages, v_pages, lengths), B, S,
                              num_splits=paged_splits, page_size=PAGE_SIZE))
        del q, k_pages, v_pages, table
        torch.cuda.empty_cache()
        return rows

    return sweep(configs, run_config, "decode"), skipped


def split_rows(args, B, S, chosen: int) -> list[dict]:
    """phase5_decode at every split count of SPLIT_COUNTS a split of MIN_KEYS_PER_SPLIT keys allows
    (op "splits"): the measurement the split heuristic is judged by (`chosen`: its count here)."""
    counts = [n for n in SPLIT_COUNTS if n <= max(1, S // decode.MIN_KEYS_PER_SPLIT)]
    return [timed_row("phase5_decode", lambda *a, n=n: decode.attention(*a, num_splits=n), args, B, S,
                      op="splits", num_splits=n, chosen=n == chosen) for n in counts]


def prefill_row() -> dict:
    """sdpa_flash on a causal prefill of PREFILL_S tokens (B = 1, the same heads): the compute-bound
    end of the same attention, for the Roofline table. Bytes: q, k, v and out once each."""
    from utils import roofline
    from utils.bench import time_cuda

    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, H, PREFILL_S, D, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(1, H_KV, PREFILL_S, D, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(1, H_KV, PREFILL_S, D, device="cuda", dtype=DTYPE, generator=gen)
    fn = sdpa_gqa("sdpa_flash")
    ms = time_cuda(lambda: fn(q, k, v, is_causal=True))
    flops = roofline.attention_flops(1, H, PREFILL_S, PREFILL_S, D, causal=True)
    nbytes = 2.0 * (2 * H * PREFILL_S * D + 2 * H_KV * PREFILL_S * D)
    print(f"    prefill sdpa_flash S={PREFILL_S}: {ms:.3f} ms", flush=True)
    return {"impl": "sdpa_flash", "op": "prefill", "B": 1, "H": H, "H_kv": H_KV, "Sq": PREFILL_S, "Sk": PREFILL_S,
            "D": D, "dtype": "float16", "causal": True, "ms": ms, "gbps": roofline.gbps(nbytes, ms),
            "tflops": roofline.tflops(flops, ms), "flop_per_byte": flops / nbytes}


# ------------------------------------------------------------------------------------------------


def measure(args) -> Path:
    """The benchmark and the prefill point, written to the results file (returned)."""
    from utils.results import write_results
    from utils.roofline import get_ceilings

    ceilings = {k: v for k, v in get_ceilings().items() if k != "env"}
    decode.load()
    rows, skipped = benchmark(QUICK_CACHE_LENS if args.quick else CACHE_LENS, QUICK_BATCHES if args.quick else BATCHES)
    try:
        rows.append(prefill_row())
    except RuntimeError as exc:
        skipped["prefill sdpa_flash"] = str(exc).splitlines()[0][:200]
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, ceilings, skipped=skipped)


def profile_target(names: str) -> None:
    """One headline call (B = 16, S = 32K) of our kernel, for an ncu run by hand."""
    q = torch.randn(16, H, SQ, D, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(16, H_KV, 32768, D, device="cuda", dtype=DTYPE) for _ in range(2))
    decode.attention(q, k, v, torch.full((16,), 32768, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 5 decoding benchmark, then its tables", measure, profile_target)


if __name__ == "__main__":
    sys.exit(main())
