"""`python -m phase1_baseline.run [--quick]`: where the baseline GPT's time goes, and where its
attention sits on the Roofline.

On a GPU it measures (profile_pytorch: the profiler split, the model and attention sweeps, ncu on
the attention's kernels), writes results/metrics.json and renders the README tables and
results/roofline.png from it (utils.render, as manifest.json declares them). Without a GPU it only
renders, from the committed results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from utils.render import render

HERE = Path(__file__).resolve().parent
MODULE = "phase1_baseline.run"


def measure(quick: bool) -> Path:
    from phase1_baseline import profile_pytorch as prof
    from utils.ncu import NcuUnavailable
    from utils.results import write_results
    from utils.roofline import get_ceilings

    ceilings = get_ceilings()
    seq_lens, batches = ((128, 256), (1, 8)) if quick else (prof.SEQ_LENS, prof.BATCHES)
    profile = prof.profile_ops()
    rows = prof.model_rows(seq_lens, batches) + prof.attention_rows(seq_lens)
    ncu, notes = [], ["--quick: no ncu"] if quick else []
    if not quick:
        try:
            ncu = prof.ncu_records(MODULE)
        except NcuUnavailable as exc:
            notes.append(f"ncu did not run: {exc}")
            print(notes[-1], flush=True)
    return write_results(HERE / "results" / "metrics.json", rows, ceilings, profile=profile, ncu=ncu, notes=notes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sweep, no ncu (a smoke run)")
    parser.add_argument("--ncu-target", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ncu_target:
        from phase1_baseline.profile_pytorch import ncu_target

        ncu_target()
        return 0
    if torch.cuda.is_available():
        print(f"wrote {measure(args.quick).relative_to(HERE.parent)}", flush=True)
    else:
        print("no GPU: rendering the tables and the Roofline from the committed results", flush=True)
    render(HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
