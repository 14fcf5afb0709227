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


def tests_row(path: str, grade: dict | None) -> str:
    """How many of the tests under a pytest path passed in the recorded GPU run of the grader (a
    test's id is its module's dotted path, then `::` or `.` and its name)."""
    prefix = path.rstrip("/").removesuffix(".py").replace("/", ".")
    ran_on_gpu = grade is not None and grade.get("gpu_available") and not grade.get("no_gpu")
    sections = [(p, [t for t in p.get("tests", []) if t["id"].startswith((prefix + ".", prefix + "::"))])
                for p in (grade or {}).get("phases", [])]
    sections = [(p, found) for p, found in sections if found]  # a lesson's tests are in its phase's section
    tests = [t for _, found in sections for t in found]
    if not ran_on_gpu or not tests:
        return row(f"pytest {path}", "not recorded on a GPU yet", None)
    outcomes = Counter(t["outcome"] for t in tests)
    others = [f"{n} {outcome}" for outcome, n in sorted(outcomes.items()) if outcome != "passed"]
    result = ", ".join([f"{outcomes['passed']} of {len(tests)} passed", *others])
    return row(f"pytest {path}", result, section_env(grade, sections[0][0]))


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
    rows = [*(tests_row(path, grade) for path in tests), *(sanitize_row(module, sanitized) for module in modules)]
    read = [record for record, used in ((GRADE_RECORD, tests), (SANITIZE_RECORD, modules)) if used]
    sources = ", ".join(p.relative_to(REPO_ROOT).as_posix() for p in read)
    return [*HEADER, *(rows or [row("–", "–", None)]), *(["", f"_{sources}._"] if read else [])]
