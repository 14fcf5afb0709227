"""Timing helpers: CUDA events, warm-up, L2 flush before every timed call, median of many runs;
peak extra memory of a call; a sweep helper that shows progress.

What the events time. A call costs host time (Python, argument checks, the launch) before its kernels
reach the GPU. Without care, the GPU finishes the L2 flush, records the start event, then idles while
the host is still preparing the call: the idle time lands between the events, and a peer whose host
path is slower looks slower on the GPU too. time_cuda therefore gives the host a head start (gpu_only,
the default): after the flush it queues a spin of about twice the call's measured host time, so the
kernels are queued before the GPU reaches the start event, and the events time the GPU's work alone.
The host cost of a call is measured on its own where it matters (final.benchmark's per-call cost),
and whole-model wall times pass gpu_only=False.

Implementations compared in one table are timed in turns (time_in_turns): each round times every one
of them once, so that a GPU whose speed drifts during a long sweep (its clock, its temperature)
moves every implementation's samples alike, instead of charging the drift to whichever was timed
last."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable

import torch

_flush_buffer: torch.Tensor | None = None


def _l2_flush_buffer() -> torch.Tensor:
    """A buffer twice the L2 size; writing it evicts whatever the last call left in L2."""
    global _flush_buffer
    if _flush_buffer is None:
        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
        _flush_buffer = torch.empty(max(2 * l2_bytes, 64 * 2**20) // 4, dtype=torch.float32, device="cuda")
    return _flush_buffer


FLUSHES = ("write", "read")


def evict_l2(flush: str = "write") -> None:
    """Evict what the last call left in L2: flush="write" zeroes a buffer twice the L2 size (as
    Triton's do_bench does), which leaves L2 full of dirty lines that the next call writes back to
    DRAM; flush="read" reads the buffer instead, leaving clean lines."""
    buffer = _l2_flush_buffer()
    if flush == "write":
        buffer.zero_()
    else:
        buffer.sum()


# The clock the head start's cycles are counted at: no GPU of the course runs its SMs faster, so the
# spin lasts at least the intended time. The cap bounds the wait for calls that synchronize inside.
SPIN_CLOCK_HZ = 2.0e9
MAX_HEAD_START_S = 0.05


def head_start_cycles(host_seconds: float) -> int:
    """torch.cuda._sleep cycles that keep the GPU busy for twice a call's host time (capped)."""
    return int(min(2.0 * max(host_seconds, 0.0), MAX_HEAD_START_S) * SPIN_CLOCK_HZ)


def host_seconds(fn: Callable[[], object], calls: int = 3) -> float:
    """The longest host time of a few calls of fn (the GPU drained before each)."""
    longest = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        longest = max(longest, time.perf_counter() - start)
    torch.cuda.synchronize()
    return longest


def timed_call(fn: Callable[[], object]) -> tuple[object, float]:
    """fn()'s output and its milliseconds on the current stream, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


def time_cuda(fn: Callable[[], object], warmup: int = 5, reps: int = 30, flush_l2: bool = True,
              max_seconds: float = 3.0, flush: str = "write", gpu_only: bool = True) -> float:
    """Median milliseconds of fn() on the current stream, timed with CUDA events.

    Each timed call is preceded by an L2 flush outside the events (evict_l2: "write" or
    "read") and, with gpu_only, by the host head start (module docstring): the events then time
    the GPU's work, not the host's. gpu_only=False times what a caller waits for one call, host
    included. Stops early after max_seconds of timed calls, with at least 5 samples.
    """
    return time_in_turns({"fn": fn}, warmup, reps, flush_l2, max_seconds, flush, gpu_only)["fn"]


def time_in_turns(fns: dict[str, Callable[[], object]], warmup: int = 5, reps: int = 30, flush_l2: bool = True,
                  max_seconds: float = 3.0, flush: str = "write", gpu_only: bool = True) -> dict[str, float]:
    """Median milliseconds of every fn, each timed as time_cuda times one, in turns: round r takes
    one sample of every fn, in the dict's order (module docstring). Stops early once the timed calls
    took max_seconds per fn on average, with at least 5 rounds."""
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    spins = {name: head_start_cycles(host_seconds(fn)) if gpu_only else 0 for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    spent = 0.0
    for rounds in range(1, reps + 1):
        for name, fn in fns.items():
            if flush_l2:
                evict_l2(flush)
            if spins[name]:
                torch.cuda._sleep(spins[name])
            samples[name].append(timed_call(fn)[1])
            spent += samples[name][-1] / 1e3
        if spent > max_seconds * len(fns) and rounds >= 5:
            break
    return {name: statistics.median(times) for name, times in samples.items()}


def profile_ranges(fn: Callable[[], object], ranges: Iterable[str]):
    """torch.profiler over one call of fn (after one warm-up call). Returns the profile, the GPU time
    of all its kernels (µs) and, per named range, the GPU time of the kernels launched inside it
    (a CPU range's device_time_total counts the kernels of its children too)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    total = float(sum(e.device_time_total for e in kernels))
    us = {name: float(sum(e.device_time_total for e in events if e.device_type == DeviceType.CPU and e.name == name))
          for name in ranges}
    return prof, total, us


def kernel_times(run: Callable[[], object], calls: int = 1) -> tuple[object, dict[str, float]]:
    """torch.profiler over `calls` calls of run (no warm-up: the caller warms up). Returns the last
    call's output and, per kernel name, the GPU microseconds it took per call (its total / calls)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            out = run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CPU and not event.is_user_annotation:
            times[event.name] = times.get(event.name, 0.0) + float(event.device_time_total) / calls
    return out, times


def peak_extra_mb(fn: Callable[[], object]) -> float:
    """Peak device memory fn() allocates beyond what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def sweep(configs: Iterable[dict], run_one: Callable[[dict], list[dict] | dict | None],
          desc: str = "sweep", count=None) -> list[dict]:
    """Run run_one(config) for every config, printing progress; collect the rows it returns.

    After each config a line: the config, how many are done, the time so far and an estimate of the
    time left (utils.progress.Count; pass one `count` to several sweeps to count them as one). Plain
    lines, no status line redrawn in place: run_one prints its own lines between them. A config
    that fails with out-of-memory is reported and skipped (the sweep goes on).
    """
    from utils.progress import Count

    configs = list(configs)
    count = count or Count(len(configs), desc)
    rows: list[dict] = []
    for config in configs:
        label = " ".join(f"{k}={v}" for k, v in config.items())
        try:
            result = run_one(config)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"{count.step()} {label}: out of memory, skipped", flush=True)
            continue
        if isinstance(result, dict):
            result = [result]
        rows.extend(result or [])
        print(f"{count.step()} {label}", flush=True)
    return rows
