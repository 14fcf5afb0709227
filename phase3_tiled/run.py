"""`python -m phase3_tiled.run [--quick] [--no-ncu]`: measure phase 3 on the GPU, then render.

1. Attention forward at B=4, H=8, D in {64, 128}, causal and not, S from 128 to 4096 (8192 at
   D=64), beside torch_naive, sdpa_math, sdpa_efficient and phase2_naive, all timed in the same
   run. The default tile (phase3_tiled_t16) runs in every panel; tiles 8 and 32 in the
   non-causal panels (the tile-size sweep; causal changes no work in these kernels). Each kernel
   of ours is measured at a larger S only while one call is predicted under its budget
   (BUDGETS_MS), which keeps the run under 2 minutes: phase2_naive stops first.
2. Each kernel on its own (matmul_qk, softmax, matmul_av) for every tile, beside cuBLAS and
   torch.softmax (and phase 2's kernels at S=1024).
3. The compiler report (registers, shared memory, theoretical occupancy: utils.compiler_report) and
   Nsight Compute on one attention call per tile at the headline shape.
4. results/metrics.json, then the tables and plots that manifest.json declares (utils.render).
Without a GPU it measures nothing and renders from the committed results. --quick: a short
sweep written to results/quick/metrics.json, not rendered.
"""

from __future__ import annotations

import sys
from pathlib import Path

import phase2_naive as ph2
import phase3_tiled as ph3
from utils.kernel_bench import (attention_impl, kernel_rows, lesson_main, peer_impls, profile,
                                profile_target, results_dir, sweep_with_budget, torch_kernel_ops)

HERE = Path(__file__).resolve().parent
NAME = "phase3_tiled"
HEADLINE = {"B": 4, "H": 8, "S": 2048, "D": 64, "causal": False}   # ncu and Roofline shape
IMPLS = {t: f"{NAME}_t{t}" for t in ph3.TILES}
DEFAULT_IMPL = IMPLS[ph3.DEFAULT_TILE]
SEQ_LENS = {64: (128, 256, 512, 1024, 2048, 4096, 8192), 128: (128, 256, 512, 1024, 2048, 4096)}
QUICK_SEQ_LENS = {64: (128, 256, 512, 1024, 2048)}
BUDGETS_MS = {"phase2_naive": 100.0, IMPLS[8]: 100.0, IMPLS[16]: 300.0, IMPLS[32]: 100.0}
KERNEL_SHAPES = ((1024, 64), (4096, 64), (4096, 128))
KERNEL_OPS = {"tiled_qk_kernel": "matmul_qk", "block_softmax_kernel": "softmax",
              "tiled_av_kernel": "matmul_av"}
KERNEL_SOURCES = tuple(s for s in ph3.SOURCES if s.endswith(".cu"))


def launch_threads(kernel: dict) -> int:
    """The launch configuration of a compiled kernel: T x T threads for a tiled matmul of tile T,
    up to 256 for the block softmax."""
    return kernel["tile"] ** 2 if kernel["tile"] else 256


def impl_factories() -> dict:
    """name -> () -> f(q, k, v, causal) for every tile and for phase 2."""
    factories = {IMPLS[t]: (lambda t=t: attention_impl(ph3, tile=t)) for t in ph3.TILES}
    factories["phase2_naive"] = lambda: attention_impl(ph2)
    return factories


def tile_ops(tile: int) -> dict:
    """Each kernel of one tile on its own; the softmax has no tile: timed under the default's name."""
    ops = {"matmul_qk": lambda q, k: ph3.matmul_qk(q, k, tile=tile),
           "matmul_av": lambda p, v: ph3.matmul_av(p, v, tile=tile)}
    if tile == ph3.DEFAULT_TILE:
        ops["softmax"] = ph3.softmax
    return ops


def measure(args) -> Path:
    """The measurements of this lesson, written to its results file (returned)."""
    from utils import compiler_report
    from utils.results import write_results
    from utils.roofline import get_ceilings

    ceilings = get_ceilings()
    # The attention sweep: every tile where causal is off, the default tile everywhere.
    impls = {name: make() for name, make in impl_factories().items()}
    seq_lens = QUICK_SEQ_LENS if args.quick else SEQ_LENS
    panels = []
    for D in seq_lens:
        for causal in (False, True):
            ours = [DEFAULT_IMPL] if causal else list(IMPLS.values())
            panels.append({"D": D, "causal": causal, "seq_lens": seq_lens[D],
                           "impls": {**peer_impls(), "phase2_naive": impls["phase2_naive"],
                                     **{n: impls[n] for n in ours}}})
    rows = sweep_with_budget(panels, BUDGETS_MS)
    # Each kernel on its own: every tile, phase 2 at the smallest shape, cuBLAS and torch.softmax.
    print("each kernel on its own:", flush=True)
    shapes = KERNEL_SHAPES[:1] if args.quick else KERNEL_SHAPES
    for t in ph3.TILES:
        rows += kernel_rows(IMPLS[t], tile_ops(t), shapes)
    rows += kernel_rows("phase2_naive", {"matmul_qk": ph2.matmul_qk, "softmax": ph2.softmax,
                                         "matmul_av": ph2.matmul_av}, KERNEL_SHAPES[:1])
    for impl, ops in torch_kernel_ops().items():
        rows += kernel_rows(impl, ops, shapes)
    # Registers and shared memory from ptxas, then ncu on one attention call per tile.
    try:
        compiler = compiler_report.report(HERE, KERNEL_SOURCES, KERNEL_OPS, launch_threads)
    except Exception as exc:  # the benchmark stands without it; the compiler table stays empty
        print(f"compiler report failed: {exc}", flush=True)
        compiler = []
    ncu = ({"shape": HEADLINE, "note": "skipped (--no-ncu)", "kernels": []} if args.no_ncu
           else profile(f"{NAME}.run", list(IMPLS.values()), "tiled_|block_softmax", KERNEL_OPS, HEADLINE))
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, ceilings, ncu=ncu,
                         compiler=compiler, headline=HEADLINE, budgets_ms=BUDGETS_MS)


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 3 benchmark, compiler report and ncu profile, then its tables and plots",
                       measure, lambda names: profile_target(names, impl_factories(), HEADLINE))


if __name__ == "__main__":
    sys.exit(main())
