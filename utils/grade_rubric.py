"""Rubrics of the grader: where they are, what they may say, and the arithmetic of a score.

A phase's rubric.json (found through the manifests that declare it, utils/MANIFEST.md) says what
the student writes in the phase and how it is scored:

    {"phase": "phase3_tiled", "title": "...", "scored": "what is graded and why",
     "correctness": {"points": 60, "tests": ["phase3_tiled/test_tiled.py"], "select": "-k expression"},
     "scripts": {"points": 30, "timeout_s": 600, "commands": [{"name": "...", "args": ["-m", ...]}]},
     "benchmarks": [{"name": "attention FP32", "op": "attention", "dtype": "float32",
                     "call": "phase3_tiled:attention", "kwargs": {"tile": 16},
                     "kernels": "regex of the phase's own kernel names", "shapes": [{...}],
                     "peers": ["torch_naive"], "ceiling": "dram_TBps", "flush": "write",
                     "aggregate": "min", "minimum": 0.5, "good": 0.75, "excellent": 0.9, "points": 40}]}

Correctness points are shared by the official tests (the rubric's files in the reference copy,
narrowed by `select`); a speed value is the reference solution's time over the graded copy's, on
the same shapes in the same run, and earns the share of its points of the highest level it reaches.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from utils.manifest import load_manifest, manifests

LEVELS = ("minimum", "good", "excellent")
LEVEL_FRACTION = {"minimum": 0.5, "good": 0.8, "excellent": 1.0}
AGGREGATES = ("min", "geomean")
PASSING = ("passed", "xfailed")
NO_GPU = "not graded: no GPU"
CALL = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
RUBRIC_KEYS = {"phase", "title", "scored", "correctness", "scripts", "benchmarks", "reps"}
BENCHMARK_KEYS = {"name", "op", "dtype", "call", "kwargs", "kernels", "shapes", "peers", "ceiling", "flush",
                  "aggregate", *LEVELS, "points"}


class RubricError(ValueError):
    """A rubric file that the grader cannot use; the message names the file and the field."""


# ------------------------------------------------------------------------------------------------
# Where the rubrics are


def rubrics() -> dict[int, Path]:
    """Phase number (the integer part of a manifest's `order`) -> the rubric.json it declares."""
    found: dict[int, Path] = {}
    for path in manifests():
        manifest = load_manifest(path.parent)
        if "rubric" in manifest and "order" in manifest:
            found.setdefault(int(manifest["order"]), (manifest["_dir"] / manifest["rubric"]).resolve())
    return dict(sorted(found.items()))


def lesson_tests(number: int) -> list[str]:
    """Every pytest path the manifests of a phase's lessons declare (run and recorded, not all scored)."""
    paths = []
    for path in manifests():
        manifest = load_manifest(path.parent)
        if "order" in manifest and int(manifest["order"]) == number:
            paths += [p for p in manifest.get("tests", []) if p not in paths]
    return paths


# ------------------------------------------------------------------------------------------------
# Loading and checking


def load_rubric(path: Path) -> dict:
    """A phase's rubric, checked against its folder and the copy that holds it (the reference)."""
    path = Path(path).resolve()
    if not path.exists():
        raise RubricError(f"{path}: no rubric")
    try:
        rubric = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RubricError(f"{path}: not JSON: {exc}") from exc
    problems = validate_rubric(rubric, path.parent.name, root=path.parent.parent)
    if problems:
        raise RubricError(f"{path}: " + "; ".join(problems))
    return rubric


def module_file(root: Path, module: str) -> Path | None:
    """The file of a dotted module name under root, without importing it."""
    base = Path(root, *module.split("."))
    return next((p for p in (base / "__init__.py", base.with_suffix(".py")) if p.exists()), None)


def validate_rubric(rubric: dict, folder_name: str | None = None, root: Path | None = None) -> list[str]:
    """Every problem found in a rubric (an empty list when it is usable). With root (the copy that
    holds it), the test files and the modules of the calls must exist there."""
    from utils.bench import FLUSHES
    from utils.grade_bench import CEILING_KEYS, DTYPES, OPS

    problems = [f"unknown field {key!r}" for key in sorted(set(rubric) - RUBRIC_KEYS)]
    if folder_name is not None and rubric.get("phase") != folder_name:
        problems.append(f"phase is {rubric.get('phase')!r}, the folder is {folder_name!r}")
    if not rubric.get("scored"):
        problems.append("scored: say what the student writes in this phase and what is graded")
    correctness = rubric.get("correctness")
    if not isinstance(correctness, dict) or not _is_points(correctness.get("points")):
        problems.append("correctness.points must be a number >= 0")
        correctness = {}
    tests = correctness.get("tests")
    if not tests or not all(isinstance(t, str) for t in tests):
        problems.append("correctness.tests must list the official test files")
    elif root is not None:
        problems += [f"correctness.tests: {t} is not in {root}" for t in tests if not (Path(root) / t).is_file()]
    scripts = rubric.get("scripts")
    if scripts is not None:
        if not _is_points(scripts.get("points")):
            problems.append("scripts.points must be a number >= 0")
        commands = scripts.get("commands")
        if not commands or not all(isinstance(c.get("args"), list) and c.get("name") for c in commands):
            problems.append("scripts.commands must be a list of {name, args}")
    for b, bench in enumerate(rubric.get("benchmarks", [])):
        where = f"benchmarks[{b}] ({bench.get('name')})"
        problems += [f"{where}: unknown field {key!r}" for key in sorted(set(bench) - BENCHMARK_KEYS)]
        op = OPS.get(bench.get("op"))
        if op is None:
            problems.append(f"{where}: op {bench.get('op')!r} is not one of {sorted(OPS)}")
            continue
        if bench.get("dtype") not in DTYPES:
            problems.append(f"{where}: dtype {bench.get('dtype')!r} is not one of {DTYPES}")
        call = bench.get("call", "")
        if not CALL.match(call):
            problems.append(f"{where}: call {call!r} must be 'module:function'")
        elif root is not None and module_file(root, call.split(":")[0]) is None:
            problems.append(f"{where}: call {call!r}: no module {call.split(':')[0]} in {root}")
        if not isinstance(bench.get("kwargs", {}), dict):
            problems.append(f"{where}: kwargs must be an object")
        try:
            re.compile(bench.get("kernels") or "")
            if not bench.get("kernels"):
                problems.append(f"{where}: kernels must be a regex of the phase's own kernel names")
        except re.error as exc:
            problems.append(f"{where}: kernels is not a regex: {exc}")
        unknown = [p for p in bench.get("peers", []) if p not in op.peers]
        if unknown:
            problems.append(f"{where}: peers {unknown} are not {bench['op']} peers {op.peers}")
        if bench.get("ceiling", CEILING_KEYS[0]) not in CEILING_KEYS:
            problems.append(f"{where}: ceiling {bench.get('ceiling')!r} is not one of {CEILING_KEYS}")
        if bench.get("flush", "write") not in FLUSHES:
            problems.append(f"{where}: flush {bench.get('flush')!r} is not one of {FLUSHES} (utils.bench)")
        shapes = bench.get("shapes") or []
        if not shapes:
            problems.append(f"{where}: no shapes")
        for shape in shapes:
            missing = [k for k in op.keys if not isinstance(shape.get(k), int) or shape[k] < 1]
            if missing:
                problems.append(f"{where}: shape {shape} lacks positive integers {missing}")
        if bench.get("aggregate", "min") not in AGGREGATES:
            problems.append(f"{where}: aggregate must be one of {AGGREGATES}")
        levels = [bench.get(level) for level in LEVELS]
        if not all(isinstance(v, (int, float)) and v > 0 for v in levels):
            problems.append(f"{where}: minimum, good and excellent must be numbers > 0")
        elif not levels[0] <= levels[1] <= levels[2]:
            problems.append(f"{where}: thresholds must rise: minimum <= good <= excellent, got {levels}")
        elif levels[2] > 1:
            problems.append(f"{where}: excellent {levels[2]} > 1 would deny the reference solution its points")
        if not _is_points(bench.get("points")):
            problems.append(f"{where}: points must be a number >= 0")
    return problems


def _is_points(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def max_points(rubric: dict) -> float:
    total = rubric["correctness"]["points"] + (rubric.get("scripts") or {}).get("points", 0)
    return total + sum(b["points"] for b in rubric.get("benchmarks", []))


# ------------------------------------------------------------------------------------------------
# Scores


def score_correctness(tests: list[dict], points: float) -> dict:
    """Points shared by the official tests (those with "scored"); only a pass earns its share. The
    gate (speed measured) opens only when every official test passed."""
    official = [t for t in tests if t["scored"]]
    counts: dict[str, int] = {}
    for t in official:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    passing = sum(counts.get(o, 0) for o in PASSING)
    not_passing = len(official) - passing
    if not official:
        gate, reason = False, "no official test was collected"
    elif counts.get(NO_GPU):
        gate, reason = False, f"{counts[NO_GPU]} official test(s) {NO_GPU}"
    elif not_passing:
        gate, reason = False, f"{not_passing} of {len(official)} official test(s) did not pass"
    else:
        gate, reason = True, f"all {len(official)} official tests passed"
    return {"points": points * passing / len(official) if official else 0.0, "max": points,
            "counts": counts, "total": len(official), "passed": passing, "gate": gate, "gate_reason": reason}


def level_for(value: float | None, bench: dict) -> str | None:
    """The highest level whose threshold value reaches (None: below minimum or no value)."""
    if value is None or not math.isfinite(value):
        return None
    reached = None
    for level in LEVELS:
        if value >= bench[level]:
            reached = level
    return reached


def aggregate(values: list[float], how: str = "min") -> float | None:
    if not values or any(v is None or not math.isfinite(v) or v <= 0 for v in values):
        return None
    if how == "geomean":
        return math.exp(sum(math.log(v) for v in values) / len(values))
    return min(values)


def speed_values(reference: list[dict], graded: list[dict]) -> tuple[list[float], str | None]:
    """Per shape, the reference solution's ms over the graded copy's; or why there is no value."""
    values = []
    for ref, mine in zip(reference, graded):
        ours, theirs = mine["impls"]["impl"], ref["impls"]["impl"]
        if ours.get("ms") is None:
            return values, f"at {mine['label']}: {ours.get('error', 'not measured')}"
        if theirs.get("ms") is None:
            return values, f"the reference solution at {ref['label']}: {theirs.get('error', 'not measured')}"
        values.append(theirs["ms"] / ours["ms"])
    if len(values) < max(len(reference), len(graded)) or not values:
        return values, "a shape was not measured"
    return values, None


def score_benchmark(bench: dict, measured: dict | None, gate: dict, gpu: bool) -> dict:
    """One benchmark's speed part. measured: {"reference": shapes, "graded": shapes} or None."""
    row = {"name": bench["name"], "aggregate": bench.get("aggregate", "min"),
           "thresholds": {lv: bench[lv] for lv in LEVELS}, "max": bench["points"], "points": 0.0,
           "values": [], "value": None, "level": None, "status": ""}
    if not gpu:
        row["status"] = NO_GPU
    elif not gate["gate"]:
        row["status"] = f"not measured: {gate['gate_reason']}"
    elif measured is None:
        row["status"] = "not measured"
    else:
        row["values"], why = speed_values(measured["reference"], measured["graded"])
        if why:
            row["status"] = f"no points: {why}"
        else:
            row["value"] = aggregate(row["values"], row["aggregate"])
            row["level"] = level_for(row["value"], bench)
            row["points"] = bench["points"] * LEVEL_FRACTION[row["level"]] if row["level"] else 0.0
            row["status"] = row["level"] or "below minimum"
    return row


def score_scripts(results: list[dict], points: float) -> dict:
    passed = sum(r["passed"] for r in results)
    return {"points": points * passed / len(results) if results else 0.0, "max": points,
            "passed": passed, "total": len(results)}
