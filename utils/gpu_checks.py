"""The `checks` table: the GPU checks that leave no measurement behind, the tests and the sanitizer.

utils.render fills it wherever a README has `<!-- table:checks -->` markers, with one row per
pytest path (`tests`) and per sanitizer module (`sanitize`) of the folder's manifest.json, read
from the two records a GPU run commits (never typed by hand):
    utils/results/grade/all.json   `python -m utils.grade --all --out utils/results/grade` (or one
                                   phase anew: `--phase N --into utils/results/grade/all.json`): every
                                   test of every lesson with its outcome, and the environment stamp
    utils/results/sanitize.json    `python -m utils.sanitize` (both tools): clean or not, per module and run
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from utils.build import REPO_ROOT
from utils.sanitize import RECORD as SANITIZE_RECORD
from utils.sanitize import TOOLS

GRADE_RECORD = REPO_ROOT / "utils" / "results" / "grade" / "all.json"
HEADER = ["| check | result | GPU | commit | date |", "|---|---|---|---|---|"]


def load_record(path: Path) -> dict | None:
    """A JSON record, or None where it was never written."""
    return json.loads(path.read_text()) if path.exists() else None


def section_env(record: dict, section: dict) -> dict:
    """The environment stamp of the run that graded a phase's section: its own where the section was
    put into the record by a later run (utils.grade --into), else the record's."""
    return section.get("env", record["env"])


def row(check: str, result: str, env: dict | None) -> str:
    where = [env["gpu"], env["commit"], env["date"][:10]] if env else ["–"] * 3
    return "| " + " | ".join([check, result, *where]) + " |"


def tests_rows(path: str, grade: dict | None) -> list[str]:
    """How many of the tests under a pytest path passed in the recorded GPU runs of the grader (a
    test's id is its module's dotted path, then `::` or `.` and its name): one row per run, the
    latest first. A test ran in its section's run, or in the run its own stamp names (a test kept
    from an earlier run by an --official-only regrade, utils.grade.carry_other_tests)."""
    prefix = path.rstrip("/").removesuffix(".py").replace("/", ".")
    ran_on_gpu = grade is not None and grade.get("gpu_available") and not grade.get("no_gpu")
    runs: dict[str, tuple[dict, list[dict]]] = {}
    for section in (grade or {}).get("phases", []):
        for t in section.get("tests", []):
            if t["id"].startswith((prefix + ".", prefix + "::")):
                env = t.get("env") or section_env(grade, section)
                runs.setdefault(json.dumps(env, sort_keys=True), (env, []))[1].append(t)
    if not ran_on_gpu or not runs:
        return [row(f"pytest {path}", "not recorded on a GPU yet", None)]
    lines = []
    for env, tests in sorted(runs.values(), key=lambda run: run[0].get("date", ""), reverse=True):
        outcomes = Counter(t["outcome"] for t in tests)
        others = [f"{n} {outcome}" for outcome, n in sorted(outcomes.items()) if outcome != "passed"]
        lines.append(row(f"pytest {path}", ", ".join([f"{outcomes['passed']} of {len(tests)} passed", *others]), env))
    return lines


def sanitize_row(module: str, record: dict | None) -> str:
    """Each sanitizer tool's verdict on a module in its latest recorded run."""
    runs = {r["tool"]: r for r in (record or {}).get("runs", []) if r["module"] == module}
    if not runs:
        return row(f"compute-sanitizer {module}", "not recorded on a GPU yet", None)
    verdicts = [f"{tool} {('clean' if runs[tool]['clean'] else 'errors') if tool in runs else 'not run'}"
                for tool in TOOLS]
    env = [*runs.values()][-1].get("env", record["env"])  # a module's runs are recorded together
    return row(f"compute-sanitizer {module}", ", ".join(verdicts), env)


def checks_lines(manifest: dict) -> list[str]:
    """The `checks` table of a folder (its manifest's tests and sanitize) and the records it read."""
    tests, modules = manifest.get("tests", []), manifest.get("sanitize", [])
    grade, sanitized = load_record(GRADE_RECORD), load_record(SANITIZE_RECORD)
    rows = [*(line for path in tests for line in tests_rows(path, grade)),
            *(sanitize_row(module, sanitized) for module in modules)]
    read = [record for record, used in ((GRADE_RECORD, tests), (SANITIZE_RECORD, modules)) if used]
    sources = ", ".join(p.relative_to(REPO_ROOT).as_posix() for p in read)
    return [*HEADER, *(rows or [row("–", "–", None)]), *(["", f"_{sources}._"] if read else [])]
