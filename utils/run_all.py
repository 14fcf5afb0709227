"""The full GPU job (`make run`): build every kernel, run every lesson, redraw every table and plot.

The lessons are found through their manifest.json files (utils.manifest.lessons): each names the
module that measures it (`run`), its place in the course (`order`) and its part of the job (`part`).
On a GPU: builds every extension in parallel, measures the ceilings (cached per GPU), runs each
lesson's `run` in course order, then `python -m utils.render` (the tables and plots of every
manifest, the checks tables included). Optional steps: the test suite (--tests), compute-sanitizer
on every lesson (--sanitize, recorded in utils/results/sanitize.json) and the grader over every
lesson (--grade, recorded in utils/results/grade/). --archive DIR packs every results folder and
the logs into DIR/results.tar.gz, to unpack at the repository root.
Without a GPU nothing is measured: `python -m utils.render` redraws every table and plot from the
committed results, and this says so. Last, the walkthrough notebook is executed and stored with its
outputs (utils.notebook). Each step prints its number (step i of n) and its time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable

from utils.build import REPO_ROOT, BuildSetupError, build_all, check_setup
from utils.manifest import lessons
from utils.progress import duration, stream_process

LOG_DIR = REPO_ROOT / "build" / "logs"
# The job in parts for GPU slots of about 10 minutes: each part builds first and runs the lessons
# whose manifest names it; these parts also run the grader (which runs the graded lessons' tests;
# the tests of the others and of utils run beside it) and the sanitizer. Unpack each part's archive
# at the repository root: it holds only the results that part wrote. Then `make run` without a GPU
# redraws the tables and plots.
PART_STEPS = {1: {"grade": True, "tests": True}, 2: {"sanitize": True}}

Step = tuple[str, Callable[[], bool]]


def lesson_runs(part: int | None = None) -> list[str]:
    """The lessons' `run` modules in course order (only those of one part, if given)."""
    return [run for m in lessons() if "run" in m and part in (None, m.get("part")) for run in runs_of(m)]


def runs_of(manifest: dict) -> list[str]:
    """A manifest's `run`: one module, or a list of modules run in turn."""
    run = manifest["run"]
    return [run] if isinstance(run, str) else list(run)


def parts() -> list[int]:
    return sorted(set(PART_STEPS) | {m["part"] for m in lessons() if "part" in m})


def ungraded_tests() -> list[str]:
    """The tests the grader does not run: those of the lessons without a rubric, and utils'."""
    return [*(t for m in lessons() if not m.get("rubric") for t in m.get("tests", [])), "utils"]


def run_logged(name: str, cmd: list[str]) -> bool:
    """Run cmd, streaming its output to the console and to build/logs/<name>.log."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    print(" ".join(cmd[1:]), flush=True)
    returncode, _ = stream_process(cmd, REPO_ROOT, dict(os.environ, PYTHONUNBUFFERED="1"), log=LOG_DIR / f"{name}.log")
    return returncode == 0


def python_step(name: str, *args: str) -> Step:
    return name, lambda: run_logged(name, [sys.executable, *args])


def ceilings_step(remeasure: bool) -> Step:
    def measure() -> bool:
        from utils.roofline import get_ceilings

        print(f"ceilings: {get_ceilings(remeasure=remeasure)}", flush=True)
        return True

    return "ceilings", measure


def plan(args: argparse.Namespace, gpu: bool) -> list[Step]:
    """The steps of this job, in order."""
    steps: list[Step] = []
    if gpu and not args.no_build:   # without a GPU nothing runs a kernel: the tests compile what they check
        try:
            check_setup()
            steps.append(("build", build_all))
        except BuildSetupError as exc:
            print(f"kernels not built: {exc}")
    if args.tests is not None:
        steps.append(python_step("tests", "-m", "pytest", "-q", "-ra", *args.tests))
    if gpu and args.sanitize:
        steps.append(python_step("sanitize", "-m", "utils.sanitize"))
    if gpu and args.grade:
        steps.append(python_step("grade", "-m", "utils.grade", "--all", "--out",
                                 str(REPO_ROOT / "utils" / "results" / "grade")))
    if gpu and not args.no_bench:
        steps.append(ceilings_step(args.remeasure))
        steps += [python_step(module, "-m", module) for module in args.only or lesson_runs(args.part)]
    # A part's (or a few lessons') archive holds only what it measured: the full job renders.
    if not gpu or not (args.only or args.part):
        steps.append(python_step("render", "-m", "utils.render"))
        steps.append(python_step("notebook", "-m", "utils.notebook", "final/walkthrough.ipynb"))
    return steps


def run_steps(steps: list[Step]) -> list[tuple[str, bool, float]]:
    """Run the steps in turn, each announced with its number and the job's time so far, and
    reported with its own time."""
    done = []
    job_start = time.perf_counter()
    for i, (name, step) in enumerate(steps, 1):
        print(f"\n=== step {i} of {len(steps)}: {name} ({duration(time.perf_counter() - job_start)} into the job)",
              flush=True)
        start = time.perf_counter()
        ok = step()
        seconds = time.perf_counter() - start
        print(f"=== step {i} of {len(steps)}: {name} {'ok' if ok else 'FAILED'} in {seconds:.1f} s", flush=True)
        done.append((name, ok, seconds))
    return done


def archive(dest: Path, since: float = 0.0) -> Path:
    """Pack the results files written since `since` (a time.time(); 0: all of them) and the logs
    into dest/results.tar.gz, with paths from the repository root."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "results.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for folder in sorted(REPO_ROOT.glob("*/results")) + sorted(REPO_ROOT.glob("*/*/results")):
            if "build" in folder.parts or ".venv" in folder.parts:
                continue
            for file in sorted(p for p in folder.rglob("*") if p.is_file() and p.stat().st_mtime >= since):
                tar.add(file, arcname=str(file.relative_to(REPO_ROOT)))
        if LOG_DIR.exists():
            tar.add(LOG_DIR, arcname="build/logs")
    return path


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-build", action="store_true", help="skip the parallel build (extensions build on first use)")
    parser.add_argument("--tests", nargs="*", metavar="PATH",
                        help="run the test suite first (the whole suite, or only these paths)")
    parser.add_argument("--sanitize", action="store_true", help="run compute-sanitizer on every lesson (GPU)")
    parser.add_argument("--grade", action="store_true", help="grade every lesson into utils/results/grade (GPU)")
    parser.add_argument("--no-bench", action="store_true", help="skip the lessons' runs")
    parser.add_argument("--only", nargs="+", metavar="MODULE", help="lessons' run modules to run (their manifests' `run`)")
    parser.add_argument("--remeasure", action="store_true", help="measure the ceilings again (else cached per GPU)")
    parser.add_argument("--archive", type=Path, help="pack the results written and the logs into ARCHIVE/results.tar.gz")
    parser.add_argument("--part", type=int, choices=parts(), help="one part of the full job (PART_STEPS, manifests' `part`)")
    args = parser.parse_args(argv)
    if args.part:
        steps = PART_STEPS.get(args.part, {})
        args.grade, args.sanitize = steps.get("grade", False), steps.get("sanitize", False)
        args.tests = ungraded_tests() if steps.get("tests") else None
        args.no_bench = not lesson_runs(args.part)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    started = time.time()

    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        print("no GPU visible: nothing is measured; every table and plot is redrawn from the committed "
              "results (python -m utils.render)", flush=True)
    summary = run_steps(plan(args, gpu))
    if args.archive:
        print(f"archived results to {archive(args.archive, since=started if args.part or args.only else 0.0)}")
    print("\n=== summary")
    for name, ok, seconds in summary:
        print(f"  {name:<28} {'ok' if ok else 'FAILED':<7} {seconds:7.1f} s")
    return 0 if all(ok for _, ok, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
