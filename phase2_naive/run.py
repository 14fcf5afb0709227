"""`python -m phase2_naive.run [--quick] [--no-ncu]`: measure phase 2 on the GPU, then render.

1. Attention forward at B=4, H=8, D in {64, 128}, causal and not, S from 128 to 4096 (8192 at
   D=64), beside torch_naive, sdpa_math and sdpa_efficient timed in the same run. The naive
   kernels are slow: phase2_naive is measured at a larger S only while one call is predicted
   (time at the previous S, times the growth of S*S) to stay under MAX_CALL_MS, which keeps the
   run under 2 minutes.
2. Each kernel on its own (matmul_qk, softmax, matmul_av) beside cuBLAS / torch.softmax.
3. Nsight Compute on one attention call at the headline shape (this script's --profile-target).
4. results/metrics.json, then the tables and plots that manifest.json declares (utils.render).
Without a GPU it measures nothing and renders from the committed results. --quick: a short
sweep written to results/quick/metrics.json, not rendered.
"""

from __future__ import annotations

import sys
from pathlib import Path

import phase2_naive as ph
from utils.kernel_bench import (attention_impl, kernel_rows, lesson_main, peer_impls, profile,
                                profile_target, results_dir, sweep_with_budget, torch_kernel_ops)

HERE = Path(__file__).resolve().parent
NAME = "phase2_naive"
HEADLINE = {"B": 4, "H": 8, "S": 2048, "D": 64, "causal": False}   # ncu and Roofline shape
SEQ_LENS = {64: (128, 256, 512, 1024, 2048, 4096, 8192), 128: (128, 256, 512, 1024, 2048, 4096)}
QUICK_SEQ_LENS = {64: (128, 256, 512, 1024, 2048)}
MAX_CALL_MS = 120.0
KERNEL_SHAPES = ((1024, 64), (2048, 64), (2048, 128))               # (S, D) of the per-kernel rows
KERNEL_OPS = {"naive_qk_kernel": "matmul_qk", "naive_softmax_kernel": "softmax",
              "naive_av_kernel": "matmul_av"}


def measure(args) -> Path:
    """The measurements of this lesson, written to its results file (returned)."""
    from utils.results import write_results
    from utils.roofline import get_ceilings

    ceilings = get_ceilings()
    # The attention sweep, every peer in the same run.
    seq_lens = QUICK_SEQ_LENS if args.quick else SEQ_LENS
    naive = attention_impl(ph)
    panels = [{"D": D, "causal": c, "seq_lens": seq_lens[D], "impls": {**peer_impls(), NAME: naive}}
              for D in seq_lens for c in (False, True)]
    rows = sweep_with_budget(panels, {NAME: MAX_CALL_MS})
    # Each kernel on its own, beside cuBLAS and torch.softmax.
    print("each kernel on its own:", flush=True)
    shapes = KERNEL_SHAPES[:1] if args.quick else KERNEL_SHAPES
    rows += kernel_rows(NAME, {"matmul_qk": ph.matmul_qk, "softmax": ph.softmax, "matmul_av": ph.matmul_av},
                        shapes)
    for impl, ops in torch_kernel_ops().items():
        rows += kernel_rows(impl, ops, shapes)
    # ncu on one attention call at the headline shape.
    ncu = ({"shape": HEADLINE, "note": "skipped (--no-ncu)", "kernels": []} if args.no_ncu
           else profile(f"{NAME}.run", [NAME], "naive_", KERNEL_OPS, HEADLINE))
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, ceilings, ncu=ncu,
                         headline=HEADLINE, budget={"max_call_ms": MAX_CALL_MS})


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 2 benchmark and ncu profile, then its tables and plots", measure,
                       lambda names: profile_target(names, {NAME: lambda: attention_impl(ph)}, HEADLINE))


if __name__ == "__main__":
    sys.exit(main())
