"""The attention benchmark every phase's run.py shares: same inputs for every implementation,
peers in the same run and timed in turns with it, rows in the results schema (utils/plots.py
draws them).

An implementation is a callable f(q, k, v, is_causal) -> out on CUDA float tensors.
"""

from __future__ import annotations

from typing import Callable

import torch

from utils import reference, roofline
from utils.bench import peak_extra_mb, sweep, time_cuda, time_in_turns
from utils.testing import random_qkv, rel_error

# Above this many float64 score elements the accuracy check is skipped (reference memory).
REFERENCE_LIMIT = 2**31


def attention_row(impl: str, fn: Callable, q, k, v, causal: bool, ref=None, op: str = "attention",
                  stride: int = 1, **timing) -> dict:
    """Time fn(q, k, v, causal) and describe it as a results row (TFLOP/s and GB/s from
    utils.roofline's attention formulas; extra_mb = peak memory beyond the inputs). timing: keyword
    arguments of utils.bench.time_cuda (warmup, reps, max_seconds)."""
    ms = time_cuda(lambda: fn(q, k, v, causal), **timing)
    return timed_row(impl, fn, q, k, v, causal, ms, ref, op, stride)


def timed_row(impl: str, fn: Callable, q, k, v, causal: bool, ms: float, ref=None, op: str = "attention",
              stride: int = 1) -> dict:
    """The results row of fn(q, k, v, causal), whose median time ms was measured by the caller."""
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    flops = roofline.attention_flops(B, H, Sq, Sk, D, causal, stride)
    nbytes = roofline.attention_bytes(B, H, Sq, Sk, D, q.element_size(), H_kv=k.shape[1])
    row = {"impl": impl, "op": op, "B": B, "H": H, "Sq": Sq, "Sk": Sk, "D": D,
           "dtype": str(q.dtype).replace("torch.", ""), "causal": causal, "ms": ms,
           "tflops": roofline.tflops(flops, ms), "gbps": roofline.gbps(nbytes, ms),
           "extra_mb": peak_extra_mb(lambda: fn(q, k, v, causal))}
    if stride != 1:
        row["stride"] = stride
    if ref is not None:
        row["rel_err"] = rel_error(fn(q, k, v, causal), ref)
    return row


def skip_note(impl: str, q, exc: Exception) -> None:
    """The printed note of an implementation left out of a config: out of memory, or the inputs
    rejected (an unsupported D, say)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
        print(f"    {impl}: out of memory at S={q.shape[2]}, skipped", flush=True)
    else:
        print(f"    {impl}: skipped at S={q.shape[2]} ({str(exc).splitlines()[0][:100]})", flush=True)


SKIPPED = (torch.cuda.OutOfMemoryError, RuntimeError, ValueError, TypeError)


def try_attention_row(impl: str, fn: Callable, q, k, v, causal: bool, ref=None, **kwargs) -> dict | None:
    """attention_row, or None with a printed note when the implementation runs out of memory or
    rejects the inputs (an unsupported D, say)."""
    try:
        return attention_row(impl, fn, q, k, v, causal, ref, **kwargs)
    except SKIPPED as exc:
        skip_note(impl, q, exc)
    return None


def try_attention_rows(impls: dict[str, Callable], q, k, v, causal: bool, ref=None, op: str = "attention",
                       **timing) -> dict[str, dict]:
    """The rows of every implementation on the same inputs, timed in turns (utils.bench.time_in_turns:
    one sample of each per round), by name in the dict's order. An implementation whose first call
    runs out of memory or rejects the inputs is left out with a printed note, before any timing.
    timing: keyword arguments of time_in_turns (warmup, reps, max_seconds)."""
    runs = {}
    for impl, fn in impls.items():
        try:
            fn(q, k, v, causal)
        except SKIPPED as exc:
            skip_note(impl, q, exc)
            continue
        runs[impl] = lambda fn=fn: fn(q, k, v, causal)
    ms = time_in_turns(runs, **timing)
    return {impl: timed_row(impl, impls[impl], q, k, v, causal, ms[impl], ref, op) for impl in runs}


def grouped_rows(impls: dict[str, Callable], q, kv: dict[int, tuple], causal: bool, **timing) -> list[dict]:
    """Grouped-query rows (op attention_gqa, field H_kv): every implementation on q over the k, v of
    each H_kv (kv: H_kv -> (k, v)), every pair timed in the same turns (time_in_turns), so that the
    same kernel's times at different H_kv, the ratio "no loss from sharing" asks for, come from the
    same rounds. A pair whose first call runs out of memory or is rejected is left out with a note."""
    runs = {}
    for impl, fn in impls.items():
        for H_kv, (k, v) in kv.items():
            try:
                fn(q, k, v, causal)
            except SKIPPED as exc:
                skip_note(f"{impl} (H_kv={H_kv})", q, exc)
                continue
            runs[impl, H_kv] = lambda fn=fn, k=k, v=v: fn(q, k, v, causal)
    ms = time_in_turns(runs, **timing)
    rows = []
    for (impl, H_kv), median in ms.items():
        k, v = kv[H_kv]
        rows.append({**timed_row(impl, impls[impl], q, k, v, causal, median, op="attention_gqa"), "H_kv": H_kv})
    return rows


def grouped_query_rows(impls: dict[str, Callable], shape: dict, dtype, seed: int, quick: bool = False,
                       **timing) -> list[dict]:
    """grouped_rows at shape (B, H query heads, the H_kv values compared, S, D), non-causal then
    causal, each on fresh CUDA inputs drawn from seed + causal (S / 4 when quick)."""
    B, H, D = shape["B"], shape["H"], shape["D"]
    S = shape["S"] // 4 if quick else shape["S"]
    rows = []
    for causal in (False, True):
        gen = torch.Generator(device="cuda").manual_seed(seed + causal)
        q = torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=gen)
        kv = {H_kv: tuple(torch.randn(B, H_kv, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
              for H_kv in shape["H_kv"]}
        rows += grouped_rows(impls, q, kv, causal, **timing)
        del q, kv
        torch.cuda.empty_cache()
    return rows


def numbered_versions(rows: list[dict | None], ideas: list[str]) -> list[dict]:
    """The rows of a lesson's versions, timed in lesson order on the same inputs (None: a version
    that did not run): each gets its number from 1, the idea it adds and its speed-up over the
    version before (`speedup_over_previous`, absent after a version that did not run)."""
    numbered, previous_ms = [], None
    for number, (row, idea) in enumerate(zip(rows, ideas, strict=True), 1):
        if row is None:
            previous_ms = None
            continue
        row.update(version=number, adds=idea)
        if previous_ms is not None:
            row["speedup_over_previous"] = previous_ms / row["ms"]
        previous_ms = row["ms"]
        numbered.append(row)
    return numbered


def benchmark_attention(impls: dict[str, Callable], configs: list[dict], dtype=torch.float32,
                        desc: str = "attention", count=None) -> list[dict]:
    """Rows for every implementation on every config (dict with B, H, S, D, causal; optional Sk).

    All implementations of one config see the same inputs. An implementation that raises (an
    unsupported D, say) is skipped for that config with a printed note; out-of-memory too.
    count: the progress count of a larger sweep this one is part of (utils.bench.sweep).
    """

    def run_config(c: dict) -> list[dict]:
        B, H, S, D, causal = c["B"], c["H"], c["S"], c["D"], c["causal"]
        Sk = c.get("Sk", S)
        q, k, v = random_qkv(B, H, S, Sk, D, dtype=dtype)
        ref = None
        if B * H * S * Sk <= REFERENCE_LIMIT // 8:
            ref = reference.attention(q, k, v, is_causal=causal)
        rows = list(try_attention_rows(impls, q, k, v, causal, ref).values())
        del q, k, v, ref
        torch.cuda.empty_cache()
        return rows

    return sweep(configs, run_config, desc, count)
