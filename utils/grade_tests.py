"""The grader's test runs: the grading tree, pytest in a subprocess, the official tests' outcomes.

A student's copy is never run as it is. The grading tree puts the student's phase code beside the
reference copy's utils, pytest configuration and test files:

    from the student's copy    every package folder but utils/, without its test_*.py, conftest.py,
                               rubric.json, manifest.json, results/ and build/
    from the reference copy    utils/, pyproject.toml, and every test_*.py of its package folders

so the tests that run are the instructor's (a test the student deleted or edited runs as the
instructor wrote it), and so are the helpers they call (utils.testing) and the timing worker.
The tree keeps its build/ between runs, so an unchanged extension is not compiled again.

The official tests are those the reference copy collects from the rubric's files (narrowed by its
`select`); one the graded tree does not collect or run counts as failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from utils.grade_rubric import NO_GPU
from utils.progress import stream_process

STUDENT_SKIPS = ("test_*.py", "conftest.py", "rubric.json", "manifest.json", "results", "build", "__pycache__", "*.pyc")
MESSAGE_CHARS = 2000


# ------------------------------------------------------------------------------------------------
# The grading tree


def packages(root: Path) -> list[Path]:
    """The top-level package folders of a copy, utils excepted."""
    return sorted(p for p in Path(root).iterdir() if (p / "__init__.py").is_file() and p.name != "utils")


def tree_dir(reference: Path, student: Path) -> Path:
    """Where the grading tree of a student's copy lives: one stable folder per copy (its build/ is kept)."""
    digest = hashlib.sha256(str(Path(student).resolve()).encode()).hexdigest()[:8]
    return Path(reference) / "build" / "grade" / "trees" / f"{Path(student).resolve().name}-{digest}"


def assemble_tree(student: Path, reference: Path, dest: Path) -> Path:
    """The student's phase code with the reference's utils, configuration and tests (see the module)."""
    student, reference, dest = Path(student), Path(reference), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for entry in dest.iterdir():  # everything but the build cache goes
        if entry.name != "build":
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for package in packages(student):
        shutil.copytree(package, dest / package.name, ignore=shutil.ignore_patterns(*STUDENT_SKIPS))
    shutil.copytree(reference / "utils", dest / "utils", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(reference / "pyproject.toml", dest / "pyproject.toml")
    for package in packages(reference):
        for test in package.rglob("test_*.py"):
            if "__pycache__" not in test.parts:
                target = dest / test.relative_to(reference)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(test, target)
    return dest


# ------------------------------------------------------------------------------------------------
# pytest in a subprocess


def run_pytest(tree: Path, paths: list, timeout_s: float, select: str | None = None, collect_only: bool = False,
               importlib_mode: bool = False, rootdir: Path | None = None, echo: bool = False) -> dict:
    """pytest over paths (relative to tree, or absolute) with the grader's plugin, in tree; rootdir
    (default tree) is what node ids are relative to. Returns {"collected": [ids], "tests": {id: record},
    "returncode", "seconds", "output_tail"}. echo: show pytest's progress lines as they come (its
    dots and percentages, indented; utils.progress.stream_process) instead of keeping them."""
    tree = Path(tree)
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        outcomes = Path(tmp) / "outcomes.json"
        cmd = [sys.executable, "-m", "pytest", *map(str, paths), "-q", "-p", "no:cacheprovider",
               "-p", "utils.grade_plugin", "-c", str(tree / "pyproject.toml"), "--rootdir", str(rootdir or tree)]
        cmd += (["-k", select] if select else []) + (["--collect-only"] if collect_only else [])
        cmd += ["--import-mode=importlib"] if importlib_mode else []
        env = {**os.environ, "PYTHONPATH": str(tree), "GRADE_OUTCOMES": str(outcomes)}
        start = time.perf_counter()
        if echo:
            returncode, output = stream_process(cmd, tree, env, timeout_s, prefix="    ")
            if returncode is None:
                output += f"\npytest ran past the {timeout_s:.0f} s limit and was stopped"
        else:
            try:
                proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
                returncode, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired:
                returncode, output = None, f"pytest ran past the {timeout_s:.0f} s limit and was stopped"
        found = json.loads(outcomes.read_text()) if outcomes.exists() else {"collected": [], "tests": {}}
    return {**found, "returncode": returncode, "seconds": time.perf_counter() - start,
            "output_tail": "\n".join(output.splitlines()[-30:])}


def official_ids(reference: Path, paths: list, timeout_s: float, select: str | None = None, **options) -> list[str]:
    """The node ids the reference copy collects from the official test files (with the rubric's select)."""
    found = run_pytest(reference, paths, timeout_s, select, collect_only=True, **options)
    if not found["collected"]:
        raise RuntimeError(f"the reference copy collects no official test from {paths}:\n" + found["output_tail"])
    return found["collected"]


def record_id(node_id: str) -> str:
    """A test's id in the grade record: its module's dotted path, `::`, the rest of its node id."""
    path, sep, rest = node_id.partition("::")
    return path.removesuffix(".py").replace("/", ".") + sep + rest


def _is_gpu_reason(message: str) -> bool:
    text = message.lower()
    return "gpu" in text or "cuda" in text


def outcome_records(official: list[str], run: dict, gpu: bool, source: str = "phase") -> list[dict]:
    """One record per test that ran or should have: the official ones ("scored") first, each with its
    outcome in the run (a missing one failed), then every other test that ran (recorded, not scored).
    A skip for want of a GPU on a machine without one is NO_GPU."""
    ran = run["tests"]
    errors = {node: r for node, r in ran.items() if node not in run["collected"] and r["outcome"] == "error"}

    def record(node: str, scored: bool) -> dict:
        r = ran.get(node)
        if r is None:
            cause = next((e["message"] for where, e in errors.items() if node.startswith(where)), "")
            r = {"outcome": "failed", "message": f"missing: the graded copy did not run this official test. {cause}",
                 "seconds": 0.0}
        outcome = NO_GPU if r["outcome"] == "skipped" and not gpu and _is_gpu_reason(r["message"]) else r["outcome"]
        return {"id": record_id(node), "source": source, "scored": scored, "outcome": outcome,
                "message": r["message"].strip()[:MESSAGE_CHARS], "seconds": r["seconds"]}

    wanted = set(official)
    others = [n for n in ran if n not in wanted]
    return [record(n, True) for n in official] + [record(n, False) for n in others]


def hidden_test_files(hidden_dir: Path, phase: str, single_phase: bool) -> list[Path]:
    """The hidden tests for one phase: DIR/<phase folder>/ or DIR/phaseN/, else DIR itself when
    DIR has no phase sub-folders and a single phase is graded."""
    hidden_dir = Path(hidden_dir)
    if not hidden_dir.is_dir():
        raise SystemExit(f"--hidden-tests {hidden_dir}: not a folder")
    for sub in (hidden_dir / phase, hidden_dir / phase.split("_")[0]):
        if sub.is_dir():
            return sorted(sub.rglob("test_*.py"))
    has_phase_dirs = any(p.is_dir() and p.name.startswith("phase") for p in hidden_dir.iterdir())
    if single_phase and not has_phase_dirs:
        return sorted(hidden_dir.glob("test_*.py"))
    return []


def run_scripts(scripts: dict, tree: Path) -> list[dict]:
    """Each command of the rubric's scripts, with this interpreter, in the graded tree."""
    results = []
    timeout = scripts.get("timeout_s", 600)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    for command in scripts["commands"]:
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, *command["args"]], cwd=tree, env=env, capture_output=True,
                                  text=True, timeout=timeout)
            ok, rc = proc.returncode == 0, proc.returncode
            output = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        except subprocess.TimeoutExpired:
            ok, rc, output = False, None, f"ran past {timeout} s"
        results.append({"name": command["name"], "command": "python " + " ".join(command["args"]),
                        "passed": ok, "returncode": rc, "output": output[:MESSAGE_CHARS],
                        "seconds": time.perf_counter() - start})
    return results
