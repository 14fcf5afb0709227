"""Timing worker of the grader: `python -m utils.grade_bench SPEC OUT`.

utils.grade runs it in a subprocess whose working directory (and PYTHONPATH) is the copy being
timed: the reference copy, or the grading tree that holds a student's phase code beside the
reference's utils and tests. The rubric names the implementation by a string ("phase3_tiled:attention"),
resolved here, in this process. For each benchmark of SPEC ({"benchmarks": [...], "peers": bool,
"reps": n}) and each of its shapes it
1. makes INPUT_SETS sets of inputs and calls the implementation once (a first call may build it);
2. profiles one call (torch.profiler) and refuses the implementation unless the kernels that match
   the rubric's `kernels` regex took at least KERNEL_SHARE of that call's GPU time: an API that hands
   the work to cuBLAS or SDPA, or returns a stored result without running a kernel, is not timed;
3. times it: before each call the next input set is refilled with new random values and the L2
   cache is flushed, both outside the CUDA events; the outputs of SPOT_CHECKS timed calls picked at
   random are compared with a float32 PyTorch reference of their own inputs, so a call that returns
   anything but the answer to its inputs (a cached result) fails;
4. with "peers", times the benchmark's peers the same way, and reads the ceilings if one is named.
OUT: {"benchmarks": {name: [{"shape", "label", "bytes", "flops", "impls": {"impl" | peer: entry}}]},
"ceilings": {...}}, rewritten after every shape; an entry is {"ms", "rel_err", "checked", "kernels",
"own_share"} or holds "error".
"""

from __future__ import annotations

import importlib
import json
import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from utils import peers, roofline
from utils.bench import kernel_times
from utils.testing import REL_TOLERANCE, rel_error

INPUT_SETS = 3
SPOT_CHECKS = 3
KERNEL_SHARE = 0.9
WARMUP, MIN_REPS, MAX_SECONDS = 3, 5, 2.0
DTYPES = ("float32", "float16", "bfloat16")
CEILING_KEYS = ("dram_TBps", "fp32_TFLOPs", "sgemm_TFLOPs", "tf32_tc_TFLOPs", "fp16_tc_TFLOPs", "bf16_tc_TFLOPs")


@dataclass(frozen=True)
class Op:
    keys: tuple[str, ...]                # the shape fields a benchmark of this op gives
    peers: tuple[str, ...]               # the implementations it may be timed beside
    inputs: Callable                     # (shape, dtype, device) -> list of tensors
    call: Callable                       # (fn, tensors, shape, kwargs) -> output
    reference: Callable                  # (tensors, shape) -> float32 output
    model: Callable                      # (shape, element bytes) -> (bytes, FLOPs)
    peer: Callable                       # peer name -> fn taking the phase API's arguments


def _randn(device, dtype, *shape):
    return torch.empty(*shape, dtype=dtype, device=device).normal_()


ATTENTION = Op(
    keys=("B", "H", "S", "D"),
    peers=("torch_naive", *peers.SDPA_BACKENDS),
    inputs=lambda s, dtype, device: [_randn(device, dtype, s["B"], s["H"], s["S"], s["D"]) for _ in range(3)],
    call=lambda fn, t, s, kw: fn(*t, is_causal=bool(s.get("causal")), **kw),
    reference=lambda t, s: peers.torch_naive(*(x.float() for x in t), is_causal=bool(s.get("causal"))),
    model=lambda s, e: (roofline.attention_bytes(s["B"], s["H"], s["S"], s["S"], s["D"], elem_bytes=e),
                        roofline.attention_flops(s["B"], s["H"], s["S"], s["S"], s["D"], causal=bool(s.get("causal")))),
    peer=lambda name: peers.torch_naive if name == "torch_naive" else peers.sdpa(name),
)
LAYER_NORM = Op(
    keys=("rows", "hidden"),
    peers=("torch_layer_norm",),
    inputs=lambda s, dtype, device: [_randn(device, dtype, s["rows"], s["hidden"]),
                                     _randn(device, dtype, s["hidden"]), _randn(device, dtype, s["hidden"])],
    call=lambda fn, t, s, kw: fn(*t, **kw),
    reference=lambda t, s: F.layer_norm(t[0].float(), (s["hidden"],), t[1].float(), t[2].float()),
    model=lambda s, e: (roofline.layer_norm_bytes(s["rows"], s["hidden"], e),
                        roofline.layer_norm_flops(s["rows"], s["hidden"])),
    peer=lambda name: lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
)
OPS = {"attention": ATTENTION, "layer_norm": LAYER_NORM}


def label(op: str, shape: dict, dtype: str) -> str:
    text = " ".join(f"{k}={shape[k]}" for k in OPS[op].keys)
    return text + (" causal" if shape.get("causal") else "") + f" {dtype}"


def resolve(call: str) -> Callable:
    """The function a rubric names as 'module:function', imported in this process."""
    module, _, name = call.partition(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------------------
# Kernels that ran, and timed calls


def own_share(times: dict[str, float], pattern: str) -> float:
    """The share of the GPU time spent in kernels whose names match the phase's regex (0 if none ran)."""
    total = sum(times.values())
    own = sum(us for name, us in times.items() if re.search(pattern, name))
    return own / total if total > 0 else 0.0


def cuda_timer(flush: str) -> Callable:
    """timer(run) -> (output, ms): flush L2 as utils.bench.time_cuda does, then time run() alone."""
    from utils.bench import evict_l2, timed_call

    def timed(run):
        evict_l2(flush)
        return timed_call(run)

    return timed


def measure(run: Callable, sets: list, refresh: Callable, check: Callable, timer: Callable,
            reps: int, rng: random.Random) -> tuple[float, float, int]:
    """(median ms, worst spot-check error, calls checked) of run(inputs) over timed calls, each on the
    next input set refilled with new values; as many calls as fit in MAX_SECONDS (MIN_REPS..reps)."""
    warm = [timer(lambda: run(sets[i % len(sets)]))[1] for i in range(WARMUP)]
    n = max(MIN_REPS, min(reps, int(MAX_SECONDS * 1e3 / max(statistics.median(warm), 1e-3))))
    picked = set(rng.sample(range(n), min(SPOT_CHECKS, n)))
    samples, errors = [], []
    for i in range(n):
        inputs = sets[i % len(sets)]
        refresh(inputs)
        out, ms = timer(lambda: run(inputs))
        samples.append(ms)
        if i in picked:
            errors.append(check(out, inputs))
        del out
    return statistics.median(samples), max(errors), len(errors)


def refresh(inputs: list) -> None:
    """New random values in the same buffers."""
    for t in inputs:
        t.normal_()


def time_impl(op: Op, fn: Callable, kwargs: dict, kernels: str | None, shape: dict, sets: list,
              timer: Callable, reps: int, rng: random.Random) -> dict:
    """One implementation at one shape: the kernel check (when kernels is given), then the timing."""
    tol = REL_TOLERANCE[sets[0][0].dtype]

    def run(inputs):
        return op.call(fn, inputs, shape, kwargs)

    def check(out, inputs):
        return rel_error(out, op.reference(inputs, shape))

    entry: dict = {"ms": None}
    try:
        run(sets[0])  # the first call builds the extension
        torch.cuda.synchronize()
        if kernels:
            refresh(sets[0])
            out, entry["kernels"] = kernel_times(lambda: run(sets[0]))
            entry["own_share"] = own_share(entry["kernels"], kernels)
            if entry["own_share"] < KERNEL_SHARE:
                others = sorted((n for n in entry["kernels"] if not re.search(kernels, n)),
                                key=entry["kernels"].get, reverse=True)[:3]
                entry["error"] = (f"the phase's kernels ({kernels}) ran {entry['own_share']:.0%} of the GPU time "
                                  f"of a call, below {KERNEL_SHARE:.0%}; other kernels: {others or 'none'}")
                return entry
            if not check(out, sets[0]) <= tol:
                entry["error"] = f"wrong result on the benchmark shape (rel error > {tol:.1e})"
                return entry
        ms, err, checked = measure(run, sets, refresh, check, timer, reps, rng)
        entry.update(rel_err=err, checked=checked)
        if not err <= tol:
            entry["error"] = f"a timed call returned a wrong result: rel error {err:.3g} > {tol:.1e}"
        else:
            entry["ms"] = ms
    except Exception as exc:  # noqa: BLE001 - a student's kernel may fail in any way
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        entry["error"] = f"{type(exc).__name__}: {first}"
    return entry


def run_benchmark(bench: dict, with_peers: bool, reps: int, timer: Callable | None = None,
                  device: str = "cuda", done: Callable = lambda shapes: None) -> list[dict]:
    """Every shape of a benchmark: the rubric's call (as "impl") and, with_peers, its peers."""
    op = OPS[bench["op"]]
    dtype = getattr(torch, bench["dtype"])
    timer = timer or cuda_timer(bench.get("flush", "write"))
    rng = random.SystemRandom()
    impls = {"impl": (resolve(bench["call"]), bench.get("kwargs", {}), bench["kernels"])}
    if with_peers:
        impls.update({name: (op.peer(name), {}, None) for name in bench.get("peers", [])})
    shapes = []
    for shape in bench["shapes"]:
        sets = [op.inputs(shape, dtype, device) for _ in range(INPUT_SETS)]
        nbytes, flops = op.model(shape, sets[0][0].element_size())
        entries = {name: time_impl(op, fn, kwargs, kernels, shape, sets, timer, reps, rng)
                   for name, (fn, kwargs, kernels) in impls.items()}
        shapes.append({"shape": shape, "label": label(bench["op"], shape, bench["dtype"]),
                       "bytes": nbytes, "flops": flops, "impls": entries})
        print(f"  [{bench['name']}] {shapes[-1]['label']}: "
              + ", ".join(f"{n} {e['ms']:.3f} ms" if e["ms"] else f"{n} {e.get('error')}" for n, e in entries.items()),
              flush=True)
        done(shapes)
        del sets
        if device == "cuda":
            torch.cuda.empty_cache()
    return shapes


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"benchmarks": {}}

    def save(name, shapes):
        result["benchmarks"][name] = shapes
        Path(out_path).write_text(json.dumps(result, default=float))

    for bench in spec["benchmarks"]:
        run_benchmark(bench, spec["peers"], spec.get("reps", 20), done=lambda shapes: save(bench["name"], shapes))
    if spec["peers"] and any(b.get("ceiling") for b in spec["benchmarks"]):
        result["ceilings"] = {k: v for k, v in roofline.get_ceilings().items() if k in CEILING_KEYS}
        Path(out_path).write_text(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
