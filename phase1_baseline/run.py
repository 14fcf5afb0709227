"""`python -m phase1_baseline.run [--quick]`: where the baseline GPT's time goes, and where its
attention sits on the Roofline.

On a GPU it measures (profile_pytorch: the profiler split, the model and attention sweeps, ncu on
the attention's kernels), writes results/metrics.json and renders the README tables and
results/roofline.png from it (utils.render, as manifest.json declares them). Without a GPU it only
renders, from the committed results. --quick: a smoke run written to results/quick/ (not rendered);
--no-ncu: skip Nsight Compute.
"""

from __future__ import annotations

import sys
from pathlib import Path

from utils.kernel_bench import lesson_main, results_dir

HERE = Path(__file__).resolve().parent
MODULE = "phase1_baseline.run"


def measure(quick: bool, no_ncu: bool = False) -> Path:
    from phase1_baseline import profile_pytorch as prof
    from utils.ncu import NcuUnavailable
    from utils.results import write_results
    from utils.roofline import get_ceilings

    ceilings = get_ceilings()
    seq_lens, batches = ((128, 256), (1, 8)) if quick else (prof.SEQ_LENS, prof.BATCHES)
    profile = prof.profile_ops()
    rows = prof.model_rows(seq_lens, batches) + prof.attention_rows(seq_lens)
    ncu, notes = [], ["--quick or --no-ncu: no ncu"] if quick or no_ncu else []
    if not (quick or no_ncu):
        try:
            ncu = prof.ncu_records(MODULE)
        except NcuUnavailable as exc:
            notes.append(f"ncu did not run: {exc}")
            print(notes[-1], flush=True)
    return write_results(results_dir(HERE, quick) / "metrics.json", rows, ceilings, profile=profile, ncu=ncu,
                         notes=notes)


def profile_target(names: str) -> None:
    from phase1_baseline.profile_pytorch import ncu_target

    ncu_target()


def main(argv=None) -> int:
    return lesson_main(argv, HERE, __doc__.split("\n\n")[0], lambda args: measure(args.quick, args.no_ncu),
                       profile_target)

if __name__ == "__main__":
    sys.exit(main())
