"""What one call of the course's attention costs the CPU, at a shape where the kernel is too small to hide it.

`python -m final.api_overhead` on a GPU measures, at B=1, H=1, S=16, D=64 (a decode-sized call: the
kernel runs in a few microseconds, so the caller's time is the launch path's), for every CUDA mode
of final.attention, each called three ways, beside torch SDPA in the same run:
    cuda_attention_forward  final.attention.cuda_attention_forward(q, k, v, mode=M)  (and mode="auto")
    phase_api               the phase's Python API: phase2_naive.attention, ..., phase5_fused.tensor_cores.attention
    op                      the phase's registered op (torch.ops.<phase>.<op>) with its arguments prepared
                            once: what remains once the Python layer is gone (the dispatcher, the C++
                            checks, the output allocation, the launch)
    sdpa, sdpa_<backend>    torch.nn.functional.scaled_dot_product_attention: its own dispatch, and each
                            backend pinned (for the whole timed loop) where it takes the dtype
Two figures per path, each the median over SAMPLES samples of CALLS calls issued back to back; the
samples of one dtype's paths are taken in turns (one sample of every path, then the next round), so
that a drift of the host's speed during the run (clock, other processes) moves every path alike
instead of whichever was measured last:
    host_us   CPU microseconds per call, the clock read right after the last call is issued, without
              waiting for the GPU (the queue takes CALLS launches without blocking): what the caller pays
    b2b_us    microseconds per call including the wait for the last kernel: the larger of the CPU's
              cost and the GPU's time per call
The difference cuda_attention_forward - op is the Python layer's cost; SDPA's host_us is the bar it is
held to. Each path's output is compared with utils.reference once (rel_err): a broken call must not look cheap.
Writes final/results/api_overhead.json (utils.results) and redraws final/README.md's table
`api_overhead` (final/manifest.json); `python -m final.benchmark` runs it too. Without a GPU it
measures nothing and says so.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from final.attention import MODE_INFO

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "results" / "api_overhead.json"
DEVICE = "cuda"  # (a test runs the pipeline on CPU, where every course mode refuses the inputs)

SHAPE = {"B": 1, "H": 1, "Sq": 16, "Sk": 16, "D": 64}
DTYPES = ("float32", "float16", "bfloat16")
# Every CUDA mode of final.attention, in each dtype it takes (final.attention.MODE_INFO)
MODE_DTYPES = {mode: tuple(str(d).replace("torch.", "") for d in info.dtypes)
               for mode, info in MODE_INFO.items() if info.cuda}
SDPA_PINNED = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")
CALLS = 200      # calls per sample: short enough for the launch queue, long enough for the clock
SAMPLES = 30
WARMUP = 20


def sample_us(fn) -> tuple[float, float]:
    """One sample of fn (module docstring): (host_us, b2b_us) per call over CALLS calls."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / CALLS * 1e6, (done - start) / CALLS * 1e6


def op_call(mode: str, q, k, v):
    """The phase's registered op, arguments prepared once: what the phase API ends with (its own
    defaults: scale 1/sqrt(D), no mask, not causal, phase 3's default tile; for FP32 the version the
    fused mode runs)."""
    import phase2_naive
    import phase3_tiled
    import phase4_coalesced
    from phase5_fused import fp32, hopper, tensor_cores

    scale = 1.0 / math.sqrt(q.shape[-1])
    if mode == "fused_hopper":
        op = hopper.load().attention_inference
        version = hopper.VERSIONS.index(hopper.DEFAULT_VERSION) + 1
        return lambda: op(q, k, v, False, scale, None, False, version)[0]
    if mode == "fused_tc":
        op = tensor_cores.load().attention
        return lambda: op(q, k, v, None, False, scale, None)
    if mode == "fused":
        op = fp32.load().attention_fastest_out
        return lambda: op(q, k, v, None, False, scale, 1, None, 0)
    phase = {"naive": phase2_naive, "tiled": phase3_tiled, "coalesced": phase4_coalesced}[mode]
    extra = (phase3_tiled.DEFAULT_TILE,) if mode == "tiled" else ()
    op = phase.load().attention
    return lambda: op(q, k, v, None, False, scale, *extra)


def phase_api_call(mode: str, q, k, v):
    """The phase's Python API, as final.attention calls it."""
    import phase2_naive
    import phase3_tiled
    import phase4_coalesced
    from phase5_fused import fp32, hopper, tensor_cores

    if mode == "fused":
        return lambda: fp32.attention(q, k, v, kernel="fastest")
    fn = {"naive": phase2_naive.attention, "tiled": phase3_tiled.attention, "coalesced": phase4_coalesced.attention,
          "fused_tc": tensor_cores.attention, "fused_hopper": hopper.attention}[mode]
    return lambda: fn(q, k, v)


def pinned(impl: str):
    """The SDPA backend an impl pins (sdpa_flash, ...) as a context entered around the whole timed
    loop, so that entering it is not counted; no context for the others."""
    import contextlib

    if impl not in SDPA_PINNED:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from utils.peers import SDPA_BACKENDS

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[impl])])


def paths(dtype_name: str, q, k, v) -> list[tuple]:
    """(impl, mode, make) for every path measured in this dtype; make() returns the call (made when
    its turn comes: the op path needs the extension the phase API path has built)."""
    import torch.nn.functional as F

    from final.attention import cuda_attention_forward

    out = []
    for mode in (m for m, dtypes in MODE_DTYPES.items() if dtype_name in dtypes):
        out.append(("cuda_attention_forward", mode, lambda m=mode: lambda: cuda_attention_forward(q, k, v, mode=m)))
        out.append(("phase_api", mode, lambda m=mode: phase_api_call(m, q, k, v)))
        out.append(("op", mode, lambda m=mode: op_call(m, q, k, v)))
    out.append(("cuda_attention_forward", "auto", lambda: lambda: cuda_attention_forward(q, k, v)))
    for impl in ("sdpa", *SDPA_PINNED):
        out.append((impl, None, lambda: lambda: F.scaled_dot_product_attention(q, k, v)))
    return out


def measure(notes: list[str]) -> list[dict]:
    from utils import reference
    from utils.testing import random_qkv, rel_error

    rows = []
    for dtype_name in DTYPES:
        q, k, v = random_qkv(SHAPE["B"], SHAPE["H"], SHAPE["Sq"], SHAPE["Sk"], SHAPE["D"], dtype=getattr(torch, dtype_name),
                             device=DEVICE)
        ref = reference.attention(q, k, v)
        # Each path once: its call made, checked against the reference and warmed up.
        ready = []  # (label, impl, mode, fn, rel_err)
        for impl, mode, make in paths(dtype_name, q, k, v):
            label = f"{impl}{'' if mode is None else f' mode={mode}'} {dtype_name}"
            try:
                with pinned(impl):
                    fn = make()
                    err = rel_error(fn(), ref)
                    for _ in range(WARMUP):
                        fn()
            except Exception as exc:  # noqa: BLE001 - a path that fails (an SDPA backend that does not
                # take the dtype, a build that failed) is reported; the others are still measured
                notes.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
                print(f"  {label}: not measured ({type(exc).__name__})", flush=True)
                continue
            ready.append((label, impl, mode, fn, err))
        # SAMPLES rounds, one sample of every path in each.
        samples = [[] for _ in ready]
        for _ in range(SAMPLES):
            for (_, impl, _, fn, _), taken in zip(ready, samples):
                with pinned(impl):
                    taken.append(sample_us(fn))
        for (label, impl, mode, _, err), taken in zip(ready, samples):
            host = statistics.median(h for h, _ in taken)
            b2b = statistics.median(b for _, b in taken)
            rows.append({"impl": impl, "mode": mode, "op": "attention", **SHAPE, "dtype": dtype_name,
                         "causal": False, "ms": host / 1e3, "host_us": host, "b2b_us": b2b, "rel_err": err})
            print(f"  {label:48s} host {host:7.2f} us/call, back-to-back {b2b:7.2f} us/call, rel err {err:.1e}",
                  flush=True)
    return rows


def run(out: Path = RESULTS_PATH) -> Path:
    """Measure every path (module docstring) and write the results file; needs a GPU."""
    from utils.results import write_results

    notes: list[str] = []
    start = time.perf_counter()
    print(f"per-call cost at {SHAPE}, {SAMPLES} x {CALLS} calls per path", flush=True)
    rows = measure(notes)
    path = write_results(out, rows, notes=notes, calls=CALLS, samples=SAMPLES,
                         grad_enabled=torch.is_grad_enabled(), wall_s=time.perf_counter() - start)
    from utils.build import shown
    print(f"wrote {shown(path)} ({len(rows)} rows, {time.perf_counter() - start:.0f} s)", flush=True)
    return path


def results_main(argv, name: str, doc: str, run_to, results_path: Path) -> int:
    """The command line of final's measurement scripts: --out (default results_path), nothing measured
    without a GPU; run_to(out), then final/README.md's tables redrawn when out is the committed file."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=results_path, help="results file (default: %(default)s)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: no CUDA GPU visible, nothing measured")
        return 0
    run_to(args.out)
    if args.out.resolve() == results_path:
        from utils.render import render

        render(HERE)
    return 0


def main(argv=None) -> int:
    return results_main(argv, "final.api_overhead", __doc__, run, RESULTS_PATH)


if __name__ == "__main__":
    sys.exit(main())
