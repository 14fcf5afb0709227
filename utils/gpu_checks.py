"""Checklist lines of the GPU checks that leave no measurement behind: the test suite and the sanitizer.

Read from two records a GPU run commits (never typed by hand):
    utils/results/grade/all.json   `python -m utils.grade --all --out utils/results/grade`: every test
                                   of every phase with its outcome, and the environment stamp
    utils/results/sanitize.json    `python -m utils.sanitize` (both tools): clean or not, per module and run
`python -m utils.gpu_checks` (also run by utils.report, so by `make run`) rewrites the section between
the gpu-checks markers of each phase README listed in READMES; phases 4 and 6 put the same lines in
their generated checklists. For the phases whose run.py writes no checklist (RESULTS), it adds where
the committed results were measured and, if recorded, whether the phase's target was met.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from utils.build import REPO_ROOT
from utils.readme import replace_between

GRADE_RECORD = REPO_ROOT / "utils" / "results" / "grade" / "all.json"
SANITIZE_RECORD = REPO_ROOT / "utils" / "results" / "sanitize.json"
BEGIN, END = "<!-- gpu-checks:begin -->", "<!-- gpu-checks:end -->"

# README -> (pytest target shown, test-id prefix in the grade record, sanitizer modules)
READMES = {
    "phase2_naive/README.md": ("pytest phase2_naive", "phase2_naive.", ("phase2_naive.sanitize_cases",)),
    "phase3_tiled/README.md": ("pytest phase3_tiled", "phase3_tiled.", ("phase3_tiled.sanitize_cases",)),
    "phase4_coalesced/README.md": ("pytest phase4_coalesced", "phase4_coalesced.",
                                   ("phase4_coalesced.sanitize_cases",)),
    "phase5_fused/README.md": ("pytest phase5_fused", "phase5_fused.",
                               ("phase5_fused.sanitize_cases", "phase5_fused.tc_sanitize_cases")),
    "phase5_fused/README_tensor_cores.md": ("pytest phase5_fused/test_tc.py", "phase5_fused.test_tc::",
                                            ("phase5_fused.tc_sanitize_cases",)),
    "phase6_layernorm_mlp/README.md": ("pytest phase6_layernorm_mlp", "phase6_layernorm_mlp.",
                                       ("phase6_layernorm_mlp.sanitize_cases",)),
}


# README -> its phase's results file, for the README whose checklist has no generated results line
RESULTS = {
    "phase2_naive/README.md": REPO_ROOT / "phase2_naive" / "results" / "metrics.json",
    "phase3_tiled/README.md": REPO_ROOT / "phase3_tiled" / "results" / "metrics.json",
}


def load_record(path: Path) -> dict | None:
    """A JSON record, or None where it was never written."""
    return json.loads(path.read_text()) if path.exists() else None


def _where(env: dict, record: Path) -> str:
    return (f"{env['gpu']}, commit {env['commit']}, {env['date'][:10]}; "
            f"{record.relative_to(REPO_ROOT).as_posix()}")


def tests_line(target: str, prefix: str, grade: dict | None) -> str:
    """Ticked when the record holds this README's tests, run on a GPU, and every one passed."""
    tests = [t for p in (grade or {}).get("phases", []) for t in p.get("tests", []) if t["id"].startswith(prefix)]
    if not tests or grade.get("no_gpu") or not grade.get("gpu_available", True):
        return f"- [ ] `{target}` passes on the GPU: no GPU run of these tests recorded yet ({GRADE_RECORD.name})."
    passed = sum(t["outcome"] == "passed" for t in tests)
    ok = passed == len(tests)
    return (f"- [{'x' if ok else ' '}] `{target}` passes on the GPU: {passed} of {len(tests)} tests passed "
            f"({_where(grade['env'], GRADE_RECORD)}).")


def sanitize_line(modules: tuple[str, ...], record: dict | None) -> str:
    """Ticked when every module of this README ran under both tools and all runs were clean."""
    runs = [r for r in (record or {}).get("runs", []) if r["module"] in modules]
    what = "compute-sanitizer memcheck and racecheck clean on " + ", ".join(f"`{m}`" for m in modules)
    if not runs:
        return f"- [ ] {what}: no sanitizer run recorded yet ({SANITIZE_RECORD.name})."
    clean = sum(r["clean"] for r in runs)
    ok = clean == len(runs) == 2 * len(modules)
    env = runs[-1].get("env", record["env"])
    return f"- [{'x' if ok else ' '}] {what}: {clean} of {len(runs)} runs clean ({_where(env, SANITIZE_RECORD)})."


def results_lines(path: Path, doc: dict | None) -> list[str]:
    """Where the committed results come from, and the phase's target if its run.py records one
    ("target": {"rule": ..., "met": ...})."""
    name = path.relative_to(REPO_ROOT).as_posix()
    if doc is None:
        return [f"- [ ] `{name}` and its plots from one GPU run: no results committed yet."]
    env = doc["env"]
    lines = [f"- [{'x' if 'H100' in env['gpu'] else ' '}] `{name}` and its plots from one run on the H100: "
             f"measured on {env['gpu']}, commit {env['commit']}, {env['date'][:10]}."]
    target = doc.get("target")
    if isinstance(target, dict) and "met" in target:
        lines.append(f"- [{'x' if target['met'] else ' '}] target: {target['rule']} — "
                     f"{'met' if target['met'] else 'not met'} in that run.")
    return lines


def checklist_lines(readme: str) -> list[str]:
    target, prefix, modules = READMES[readme]
    lines = [tests_line(target, prefix, load_record(GRADE_RECORD)),
             sanitize_line(modules, load_record(SANITIZE_RECORD))]
    if readme in RESULTS:
        lines += results_lines(RESULTS[readme], load_record(RESULTS[readme]))
    return lines


def update_readmes() -> None:
    for readme in READMES:
        replace_between(REPO_ROOT / readme, BEGIN, END, checklist_lines(readme))


def main() -> int:
    update_readmes()
    print("phase READMEs: test and sanitizer checklist lines regenerated from utils/results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
