"""What the run.py of the three-kernel phases (2-4) share: the attention sweep that stops a slow
kernel before it takes the whole run, each kernel timed on its own beside cuBLAS and
torch.softmax, Nsight Compute on one attention call per implementation, the command line, and
the path without a GPU (render the committed results, measure nothing).

An implementation is f(q, k, v, causal) -> out on CUDA float32 tensors.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import torch

from utils.build import shown
from utils.render import render


# ------------------------------------------------------------------------------------------------
# Implementations


def attention_impl(phase, **kwargs):
    """f(q, k, v, causal) over a phase package's attention (its extension built first); kwargs
    go to every call (phase 3's tile)."""
    phase.load()
    return lambda q, k, v, causal: phase.attention(q, k, v, is_causal=causal, **kwargs)


def peer_impls() -> dict:
    """PyTorch's attention peers: torch_naive, sdpa_math, sdpa_efficient."""
    from utils import peers

    def wrap(fn):
        return lambda q, k, v, causal: fn(q, k, v, is_causal=causal)

    return {"torch_naive": wrap(peers.torch_naive), "sdpa_math": wrap(peers.sdpa("sdpa_math")),
            "sdpa_efficient": wrap(peers.sdpa("sdpa_efficient"))}


def torch_kernel_ops() -> dict:
    """The per-kernel peers: cuBLAS SGEMM (TF32 off) for the matmuls, torch.softmax."""
    from utils.peers import no_tf32

    def mm_qk(q, k):
        with no_tf32():
            return torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)

    def mm_av(p, v):
        with no_tf32():
            return torch.matmul(p, v)

    return {"cublas": {"matmul_qk": mm_qk, "matmul_av": mm_av},
            "torch_naive": {"softmax": lambda s: torch.softmax(s, dim=-1)}}


# ------------------------------------------------------------------------------------------------
# Sweeps


def sweep_with_budget(panels: list[dict], budgets: dict[str, float], B: int = 4, H: int = 8,
                      desc: str = "attention") -> list[dict]:
    """Attention rows for every panel {"D", "causal", "seq_lens", "impls": {name: fn}} and each of
    its S (ascending), at batch B and H heads.

    An impl named in `budgets` (name -> max ms per call) runs at the next S of a panel only while
    its time at the previous S, scaled by the growth of S*S, stays under its budget; once skipped
    (or out of memory) it stays out of that panel.
    """
    from utils.attention_bench import benchmark_attention
    from utils.progress import Count

    rows = []
    count = Count(sum(len(panel["seq_lens"]) for panel in panels), desc)  # one count over every panel
    for panel in panels:
        active = dict(panel["impls"])
        last: dict = {}  # impl -> (S, ms) of its last measurement in this panel
        for S in panel["seq_lens"]:
            # Drop the impls whose predicted time at this S passes their budget.
            for name, budget in budgets.items():
                if name in active and name in last:
                    S0, ms0 = last[name]
                    if ms0 * (S / S0) ** 2 > budget:
                        print(f"    {name}: skipped from S={S} on (predicted "
                              f"{ms0 * (S / S0) ** 2:.0f} ms per call > {budget:.0f} ms)", flush=True)
                        del active[name]
            config = {"B": B, "H": H, "S": S, "D": panel["D"], "causal": panel["causal"]}
            new = benchmark_attention(active, [config], desc=desc, count=count)
            # A budgeted impl that produced no row (out of memory, say) stays out of the panel.
            measured = {r["impl"] for r in new}
            for name in budgets:
                if name in active and name not in measured:
                    del active[name]
            for r in new:
                last[r["impl"]] = (S, r["ms"])
            rows += new
    return rows


def kernel_rows(impl: str, ops: dict, shapes, B: int = 4, H: int = 8, reference_limit: int = 2**28,
                **timing) -> list[dict]:
    """Rows for each kernel on its own. ops: {"matmul_qk": f(q, k), "softmax": f(s),
    "matmul_av": f(p, v)}; any may be missing. Inputs are fresh random tensors per (S, D) shape;
    rel_err against float64 where B*H*S*S <= reference_limit. timing: utils.bench.time_cuda's
    arguments (default: 2 warm-up calls, at most 10 timed ones within a second)."""
    timing = {"warmup": 2, "reps": 10, "max_seconds": 1.0, **timing}
    from utils import reference, roofline
    from utils.bench import time_cuda
    from utils.testing import random_qkv, randn, rel_error

    rows = []
    for S, D in shapes:
        q, k, v = random_qkv(B, H, S, S, D)
        s = randn(B, H, S, S)
        p = torch.softmax(s, dim=-1)
        small = B * H * S * S <= reference_limit
        # op -> (call, FLOPs, minimum bytes, float64 reference or None)
        cases = {
            "matmul_qk": (lambda: ops["matmul_qk"](q, k), roofline.matmul_flops(S, S, D, B * H),
                          roofline.matmul_bytes(S, S, D, B * H),
                          (lambda: (q.double() @ k.double().transpose(-1, -2)) / D**0.5) if small else None),
            "softmax": (lambda: ops["softmax"](s), roofline.softmax_flops(B * H * S, S),
                        roofline.softmax_bytes(B * H * S, S),
                        (lambda: reference.softmax(s)) if small else None),
            "matmul_av": (lambda: ops["matmul_av"](p, v), roofline.matmul_flops(S, D, S, B * H),
                          roofline.matmul_bytes(S, D, S, B * H),
                          (lambda: p.double() @ v.double()) if small else None),
        }
        for op, (fn, flops, nbytes, ref) in cases.items():
            if op not in ops:
                continue
            ms = time_cuda(fn, **timing)
            row = {"impl": impl, "op": op, "B": B, "H": H, "Sq": S, "Sk": S, "D": D,
                   "dtype": "float32", "causal": False, "ms": ms,
                   "tflops": roofline.tflops(flops, ms), "gbps": roofline.gbps(nbytes, ms)}
            if ref is not None:
                row["rel_err"] = rel_error(fn(), ref())
            rows.append(row)
            print(f"    {impl:<18} {op:<10} S={S} D={D}: {ms:.3f} ms", flush=True)
        del q, k, v, s, p
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------
# Nsight Compute


def headline_inputs(shape: dict):
    """Fresh q, k, v at a shape {"B", "H", "S", "D"}."""
    from utils.testing import random_qkv

    return random_qkv(shape["B"], shape["H"], shape["S"], shape["S"], shape["D"])


def profile_target(names: str, factories: dict, shape: dict) -> None:
    """One attention call per named impl (comma-separated; factories: name -> () -> f) at the
    shape: what ncu profiles."""
    q, k, v = headline_inputs(shape)
    fns = {n: factories[n]() for n in names.split(",")}   # build/load before the profiled launches
    torch.cuda.synchronize()
    for fn in fns.values():
        fn(q, k, v, shape["causal"])
    torch.cuda.synchronize()


def profile(module: str, targets: list[str], kernel_regex: str, kernel_ops: dict, shape: dict) -> dict:
    """ncu records for `python -m module --profile-target T` (each target one attention call of
    three kernels at the shape), each labelled with its impl and op (kernel_ops: a part of the
    kernel's name -> op); or a note saying why ncu did not run."""
    from utils.ncu import NcuUnavailable, profile_python, summarize

    try:
        records = profile_python([module, "--profile-target", ",".join(targets)], kernel_regex,
                                 launch_count=3 * len(targets))
    except (NcuUnavailable, OSError) as exc:
        print(f"ncu: not run ({str(exc).splitlines()[0]})", flush=True)
        return {"shape": shape, "note": f"ncu unavailable: {exc}", "kernels": []}
    print(summarize(records), flush=True)
    for n, r in enumerate(records):
        r["impl"] = targets[n // 3] if n // 3 < len(targets) else "?"
        r["op"] = next((op for key, op in kernel_ops.items() if key in r["kernel"]), "?")
    return {"shape": shape, "kernels": records}


# ------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv, description: str):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true",
                        help="a short sweep written to results/quick/ (not rendered)")
    parser.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute step")
    parser.add_argument("--profile-target", metavar="NAMES",
                        help="internal: one headline attention call per named impl (for ncu)")
    return parser.parse_args(argv)


def results_dir(folder: Path, quick: bool) -> Path:
    """Where a run writes: results/, or results/quick/ for a --quick run."""
    return folder / "results" / ("quick" if quick else "")


def render_committed(folder: Path) -> int:
    """Without a GPU: measure nothing, draw the folder's tables and plots from its committed results."""
    print(f"no GPU: nothing measured; {folder.name}'s tables and plots drawn from its committed results",
          flush=True)
    render(folder)
    return 0


def lesson_main(argv, folder: Path, description: str, measure: Callable[[argparse.Namespace], Path],
                profile_target: Callable[[str], None] | None = None) -> int:
    """Every lesson's `python -m PKG.run`: with --profile-target NAMES, only the calls ncu profiles
    (profile_target(NAMES); a lesson that ncu does not profile passes none); without a GPU, the committed results rendered; else measure(args)
    writes the results file and returns its path, which is rendered unless --quick."""
    args = parse_args(argv, description)
    if args.profile_target:
        if profile_target is None:
            raise SystemExit(f"{folder.name}'s run profiles nothing with ncu: it has no --profile-target")
        profile_target(args.profile_target)
        return 0
    if not torch.cuda.is_available():
        return render_committed(folder)
    start = time.perf_counter()
    metrics = measure(args)
    print(f"wrote {shown(metrics)} in {time.perf_counter() - start:.0f} s", flush=True)
    if not args.quick:
        render(folder)
    return 0
