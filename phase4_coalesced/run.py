"""`python -m phase4_coalesced.run [--quick] [--no-ncu]`: measure phase 4 on the GPU, then render.

1. Attention forward at B=4, H=8, D in {64, 128}, S in {128 ... 4096}, causal and not, and
   S=8192 (non-causal) for the fast implementations, beside its peers in the same run:
   torch_naive (cuBLAS SGEMM + torch softmax, TF32 off), sdpa_math, sdpa_efficient,
   phase2_naive (S <= 2048: it is slow) and phase3_tiled_t16 (S <= 4096).
2. Each kernel on its own at S=4096 (matmul_qk, softmax, matmul_av) beside phase 3's, cuBLAS SGEMM
   (torch.matmul, TF32 off, impl "cublas") and torch.softmax on the same shapes.
3. Nsight Compute on one call each of phase3_tiled_t16, phase4_coalesced and torch_naive at the
   headline shape (B=4, H=8, S=4096, D=64): the records of each impl, told apart by a one-thread
   marker kernel launched before each (this script's --profile-target).
4. results/metrics.json, then the tables and plots that manifest.json declares (utils.render).
Without a GPU it measures nothing and renders from the committed results. --quick: a short
sweep written to results/quick/metrics.json, not rendered.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import phase2_naive as ph2
import phase3_tiled as ph3
import phase4_coalesced as ph4
from utils import peers
from utils.attention_bench import benchmark_attention
from utils.kernel_bench import (attention_impl, kernel_rows, lesson_main, peer_impls, results_dir)

HERE = Path(__file__).resolve().parent
NAME = "phase4_coalesced"
HEADLINE = {"B": 4, "H": 8, "S": 4096, "D": 64, "causal": False}   # kernel rows, ncu and Roofline
PROFILED = ("phase3_tiled_t16", NAME, "torch_naive")
MARKER_KERNEL = "spin_kernel"  # what torch.cuda._sleep launches: the separator between impls
# Largest S each peer is timed at (the slow ones would take the whole time budget above it).
MAX_S = {"phase2_naive": 2048, "phase3_tiled_t16": 4096, "sdpa_math": 4096}
FAST = (NAME, "torch_naive", "sdpa_efficient")   # the impls timed at S = 8192


def attention_impls() -> dict:
    """{impl name: f(q, k, v, causal)} for phase 4 and every peer."""
    return {NAME: attention_impl(ph4), "phase3_tiled_t16": attention_impl(ph3, tile=16),
            "phase2_naive": attention_impl(ph2), **peer_impls()}


def kernel_ops() -> dict:
    """{impl: {op: f}} for the per-kernel timings: phase 4, phase 3, cuBLAS SGEMM and torch.softmax."""

    def mm(a, b):
        with peers.no_tf32():
            return torch.matmul(a, b)

    return {NAME: {"matmul_qk": ph4.matmul_qk, "softmax": ph4.softmax, "matmul_av": ph4.matmul_av},
            "phase3_tiled_t16": {"matmul_qk": lambda q, k: ph3.matmul_qk(q, k, tile=16), "softmax": ph3.softmax,
                                 "matmul_av": lambda p, v: ph3.matmul_av(p, v, tile=16)},
            "cublas": {"matmul_qk": lambda q, k: mm(q, k.transpose(-1, -2)), "matmul_av": mm},
            "torch_naive": {"softmax": lambda s: torch.softmax(s, dim=-1)}}


# ------------------------------------------------------------------------------------------------
# Benchmarks


def sweep_groups(quick: bool) -> list[tuple[list[dict], tuple[str, ...] | None]]:
    """Groups of configs of one S, each with the impls it runs (None: all that allow that S)."""
    B, H = HEADLINE["B"], HEADLINE["H"]
    seqs = (512, 4096) if quick else (128, 256, 512, 1024, 2048, 4096)
    dims = (64,) if quick else (64, 128)
    causal = (False,) if quick else (False, True)
    groups = [([{"B": B, "H": H, "S": S, "D": D, "causal": c} for D in dims for c in causal], None)
              for S in seqs]
    if not quick:  # S = 8192: the fast implementations only (one B*H*8192^2 fp32 buffer is 8.6 GB)
        groups.append(([{"B": B, "H": H, "S": 8192, "D": D, "causal": False} for D in dims], FAST))
    return groups


def attention_sweep(impls: dict, quick: bool) -> list[dict]:
    rows = []
    for configs, only in sweep_groups(quick):
        S = configs[0]["S"]
        chosen = {n: f for n, f in impls.items() if (only is None or n in only) and S <= MAX_S.get(n, S)}
        rows += benchmark_attention(chosen, configs, desc=f"attention S={S}")
    return rows


# ------------------------------------------------------------------------------------------------
# Nsight Compute


def profile_target(names: list[str]) -> None:
    """One call of each named impl at the headline shape, each after a marker kernel."""
    B, H, S, D = HEADLINE["B"], HEADLINE["H"], HEADLINE["S"], HEADLINE["D"]
    gen = torch.Generator().manual_seed(0)
    # Inputs made on the CPU and copied: no RNG kernel among the profiled launches.
    q, k, v = (torch.randn(B, H, S, D, generator=gen).cuda() for _ in range(3))
    impls = attention_impls()
    torch.cuda.synchronize()
    for name in names:
        torch.cuda._sleep(1)
        impls[name](q, k, v, HEADLINE["causal"])
    torch.cuda.synchronize()


def run_ncu() -> dict:
    """Per-kernel ncu records of the profiled impls: {"shape", "records": {impl: [...]}}, or
    {"error": why} where ncu could not run."""
    from utils.ncu import NcuUnavailable, profile_python

    start = time.perf_counter()
    print("ncu: profiling " + ", ".join(PROFILED) + " at the headline shape ...", flush=True)
    try:
        records = profile_python([f"{NAME}.run", "--profile-target", ",".join(PROFILED)],
                                 launch_count=60, timeout=150)
    except (NcuUnavailable, OSError) as exc:
        print(f"ncu unavailable: {exc}", flush=True)
        return {"error": str(exc)}
    except Exception as exc:  # a timeout, say: the benchmark results still stand
        print(f"ncu failed: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}
    # Each marker kernel starts the records of the next profiled impl.
    by_impl: dict[str, list[dict]] = {}
    current = -1
    for r in records:
        if MARKER_KERNEL in r["kernel"]:
            current += 1
            continue
        name = PROFILED[current] if 0 <= current < len(PROFILED) else "unattributed"
        by_impl.setdefault(name, []).append(r)
    print(f"ncu: {len(records)} kernel records in {time.perf_counter() - start:.0f} s", flush=True)
    return {"shape": HEADLINE, "records": by_impl}


# ------------------------------------------------------------------------------------------------


def measure(args) -> Path:
    """The measurements of this lesson, written to its results file (returned)."""
    from utils.results import write_results
    from utils.roofline import get_ceilings

    ceilings = get_ceilings()
    rows = attention_sweep(attention_impls(), args.quick)
    # Each kernel alone at the headline S, both head dims.
    print("each kernel on its own:", flush=True)
    shapes = [(HEADLINE["S"], D) for D in ((64,) if args.quick else (64, 128))]
    for impl, ops in kernel_ops().items():
        rows += kernel_rows(impl, ops, shapes, warmup=5, reps=30, max_seconds=3.0)
    ncu = {"error": "skipped (--no-ncu)"} if args.no_ncu else run_ncu()
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, ceilings, ncu=ncu,
                         headline=HEADLINE)


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 4 benchmark and ncu profile, then its tables and plots", measure,
                       lambda names: profile_target(names.split(",")))


if __name__ == "__main__":
    sys.exit(main())
