"""Per-phase grader: correctness tests first, then a short benchmark, scored against the phase's rubric.

    python -m utils.grade --phase 3                       # one phase (number or folder name)
    python -m utils.grade --all                           # every phase
    python -m utils.grade --phase 3 --hidden-tests DIR    # plus an instructor's hidden tests
    python -m utils.grade --all --out DIR                 # report folder (default build/grade/)

It grades the checked-out copy (the solutions or a student's copy) in four steps per phase:

1. Correctness: the phase's pytest files run in a subprocess (`--junitxml` to a temporary file);
   every test is reported with passed / failed / error / skipped and its message. A test skipped
   because no GPU is visible is reported as "not graded: no GPU", never as passed. The correctness
   points are shared equally by all the tests collected (the phase's and the hidden ones): a test
   that does not pass (failed, error, skipped, not graded) earns nothing.
2. Hidden tests (`--hidden-tests DIR`): pytest files of the instructor's, run in their own pytest
   subprocess against this copy. If DIR has a sub-folder named after the phase (`phase3_tiled/`,
   or `phase3/`), the test_*.py files in it are run for that phase; a DIR without such
   sub-folders applies to the single phase given with --phase. The tests run with the repository
   root as working directory and on PYTHONPATH, so they import the phase as the phase's own tests
   do (`import phase3_tiled as ph`, `from utils.testing import requires_gpu, assert_close`), with
   pytest's importlib import mode (their file names may repeat the phase's).
3. Scripts (phase 1): each command of the rubric's "scripts" runs with this interpreter and must
   exit 0 (CPU or GPU).
4. Speed (GPU only, and only when every correctness test of the phase passed): for each benchmark
   of the rubric, the phase's kernel and the implementations it is compared with (the previous
   phase's kernel, the peer) run on the rubric's shapes in this process, through the phases' own
   APIs and utils.bench.time_cuda (warm-up, L2 flush, median; a benchmark's "flush": "read" picks
   the read-only flush). Each output is first checked
   against a float32 PyTorch reference of the same inputs: a kernel that is wrong on the benchmark
   shape earns no speed points. A part's value (speed-up = time of the other / time of ours, or
   the fraction of a ceiling from utils.roofline.get_ceilings) is aggregated over the shapes
   ("min" by default, or "geomean") and earns the points of the highest level it reaches:
   minimum 50%, good 80%, excellent 100% (below minimum: nothing).

Each phase's rubric is phaseN_x/rubric.json. The report (Markdown and JSON, with the environment
stamp of utils.results) goes to OUT/<phase>.md|json for one phase, OUT/all.md|json for --all.
Without a GPU the grader says so in one line and grades only what needs none.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PHASES = {
    1: "phase1_baseline",
    2: "phase2_naive",
    3: "phase3_tiled",
    4: "phase4_coalesced",
    5: "phase5_fused",
    6: "phase6_layernorm_mlp",
}
DEFAULT_OUT = REPO_ROOT / "build" / "grade"
LEVELS = ("minimum", "good", "excellent")
LEVEL_FRACTION = {"minimum": 0.5, "good": 0.8, "excellent": 1.0}
AGGREGATES = ("min", "geomean")
METRICS = {"speedup": ("previous", "peer"), "ceiling_fraction": ("ceiling",)}
CEILING_KEYS = ("dram_TBps", "fp32_TFLOPs", "sgemm_TFLOPs", "tf32_tc_TFLOPs", "fp16_tc_TFLOPs",
                "bf16_tc_TFLOPs")
NO_GPU_LINE = ("No CUDA GPU visible: grading only what needs none (CPU tests and scripts); GPU tests "
               "are reported as 'not graded: no GPU' and no speed is measured.")
NO_GPU = "not graded: no GPU"
PASSING = ("passed", "xfailed")
MESSAGE_CHARS = 2000

# Implementations the benchmarks can time, per op; the shape keys each op needs.
ATTENTION_IMPLS = ("torch_naive", "sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn",
                   "phase2_naive", "phase3_tiled_t8", "phase3_tiled_t16", "phase3_tiled_t32",
                   "phase4_coalesced", "phase5_fused", "phase5_fused_teaching", "phase5_fused_tc")
OPS = {
    "attention": {"impls": ATTENTION_IMPLS, "shape_keys": ("B", "H", "S", "D")},
    "layer_norm": {"impls": ("phase6_layer_norm", "torch_layer_norm"), "shape_keys": ("rows", "hidden")},
    "mlp": {"impls": ("phase6_mlp", "torch_mlp"), "shape_keys": ("tokens", "hidden", "inner")},
}
DTYPES = ("float32", "float16", "bfloat16")


class RubricError(ValueError):
    """A rubric file that the grader cannot use; the message names the file and the field."""


# ------------------------------------------------------------------------------------------------
# Rubrics


def phase_dir(phase: int | str | Path) -> Path:
    """The folder of a phase given as its number, its folder name or a path."""
    if isinstance(phase, Path):
        return phase.resolve()
    text = str(phase)
    if text.isdigit():
        if int(text) not in PHASES:
            raise SystemExit(f"--phase {text}: the phases are {sorted(PHASES)}")
        return REPO_ROOT / PHASES[int(text)]
    path = Path(text)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.is_dir():
        raise SystemExit(f"--phase {text}: no such phase folder (the phases are {sorted(PHASES)})")
    return path.resolve()


def load_rubric(folder: Path) -> dict:
    path = Path(folder) / "rubric.json"
    if not path.exists():
        raise RubricError(f"{path}: no rubric")
    try:
        rubric = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RubricError(f"{path}: not JSON: {exc}") from exc
    problems = validate_rubric(rubric, Path(folder).name)
    if problems:
        raise RubricError(f"{path}: " + "; ".join(problems))
    return rubric


def validate_rubric(rubric: dict, folder_name: str | None = None) -> list[str]:
    """Every problem found in a rubric (an empty list when it is usable)."""
    from utils.bench import FLUSHES

    problems = []
    if folder_name is not None and rubric.get("phase") != folder_name:
        problems.append(f"phase is {rubric.get('phase')!r}, the folder is {folder_name!r}")
    correctness = rubric.get("correctness")
    if not isinstance(correctness, dict) or not _is_points(correctness.get("points")):
        problems.append("correctness.points must be a number >= 0")
    scripts = rubric.get("scripts")
    if scripts is not None:
        if not _is_points(scripts.get("points")):
            problems.append("scripts.points must be a number >= 0")
        commands = scripts.get("commands")
        if not commands or not all(isinstance(c.get("args"), list) and c.get("name") for c in commands):
            problems.append("scripts.commands must be a list of {name, args}")
    benchmarks = rubric.get("benchmarks", [])
    if not isinstance(benchmarks, list):
        problems.append("benchmarks must be a list")
        benchmarks = []
    for b, bench in enumerate(benchmarks):
        where = f"benchmarks[{b}] ({bench.get('name')})"
        op = bench.get("op")
        if op not in OPS:
            problems.append(f"{where}: op {op!r} is not one of {sorted(OPS)}")
            continue
        if bench.get("dtype") not in DTYPES:
            problems.append(f"{where}: dtype {bench.get('dtype')!r} is not one of {DTYPES}")
        if bench.get("impl") not in OPS[op]["impls"]:
            problems.append(f"{where}: impl {bench.get('impl')!r} is not a known {op} implementation")
        if bench.get("flush", "write") not in FLUSHES:
            problems.append(f"{where}: flush {bench.get('flush')!r} is not one of {FLUSHES} (utils.bench)")
        shapes = bench.get("shapes") or []
        if not shapes:
            problems.append(f"{where}: no shapes")
        for shape in shapes:
            missing = [k for k in OPS[op]["shape_keys"] if not isinstance(shape.get(k), int) or shape[k] < 1]
            if missing:
                problems.append(f"{where}: shape {shape} lacks positive integers {missing}")
        for p, part in enumerate(bench.get("parts") or []):
            pwhere = f"{where}.parts[{p}] ({part.get('name')})"
            metric, kind = part.get("metric"), part.get("kind")
            if metric not in METRICS:
                problems.append(f"{pwhere}: metric {metric!r} is not one of {sorted(METRICS)}")
            elif kind not in METRICS[metric]:
                problems.append(f"{pwhere}: kind {kind!r} does not go with metric {metric!r}")
            if metric == "speedup" and part.get("against") not in OPS[op]["impls"]:
                problems.append(f"{pwhere}: against {part.get('against')!r} is not a known {op} implementation")
            if metric == "speedup" and part.get("against") == bench.get("impl"):
                problems.append(f"{pwhere}: compares {bench.get('impl')} with itself")
            if metric == "ceiling_fraction" and part.get("ceiling") not in CEILING_KEYS:
                problems.append(f"{pwhere}: ceiling {part.get('ceiling')!r} is not one of {CEILING_KEYS}")
            if part.get("aggregate", "min") not in AGGREGATES:
                problems.append(f"{pwhere}: aggregate must be one of {AGGREGATES}")
            levels = [part.get(level) for level in LEVELS]
            if not all(isinstance(v, (int, float)) and v > 0 for v in levels):
                problems.append(f"{pwhere}: minimum, good and excellent must be numbers > 0")
            elif not levels[0] <= levels[1] <= levels[2]:
                problems.append(f"{pwhere}: thresholds must rise: minimum <= good <= excellent, got {levels}")
            if not _is_points(part.get("points")):
                problems.append(f"{pwhere}: points must be a number >= 0")
    return problems


def _is_points(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def rubric_max_points(rubric: dict) -> float:
    total = rubric["correctness"]["points"] + (rubric.get("scripts") or {}).get("points", 0)
    return total + sum(p["points"] for b in rubric.get("benchmarks", []) for p in b.get("parts", []))


# ------------------------------------------------------------------------------------------------
# Tests: pytest in a subprocess, JUnit XML parsed


def parse_junit(xml_text: str, gpu: bool, source: str = "phase") -> list[dict]:
    """One dict per test case: id, source, outcome, message, seconds.

    outcome: passed, failed, error, skipped, xfailed, or NO_GPU (a skip for want of a GPU on a
    machine without one)."""
    root = ET.fromstring(xml_text)
    tests = []
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test_id = f"{classname}::{name}" if classname else name
        outcome, message = "passed", ""
        for child in case:
            tag = child.tag
            text = (child.get("message") or "").strip()
            detail = (child.text or "").strip()
            if tag in ("failure", "error"):
                # A failure outranks an error in teardown reported on the same case.
                if outcome != "failed":
                    outcome = "failed" if tag == "failure" else "error"
                    message = _first_lines(text or detail, detail)
            elif tag == "skipped" and outcome == "passed":
                if child.get("type") == "pytest.xfail":
                    outcome, message = "xfailed", text
                else:
                    outcome, message = "skipped", text or detail
                    if not gpu and _is_gpu_reason(message):
                        outcome = NO_GPU
        tests.append({"id": test_id, "source": source, "outcome": outcome,
                      "message": message[:MESSAGE_CHARS], "seconds": float(case.get("time") or 0.0)})
    return tests


def _first_lines(message: str, detail: str) -> str:
    """The assertion message, with the last lines of the traceback (where the error is) if short."""
    if len(message) >= 120 or not detail:
        return message
    tail = "\n".join(detail.splitlines()[-6:])
    return f"{message}\n{tail}" if message else tail


def _is_gpu_reason(message: str) -> bool:
    text = message.lower()
    return "gpu" in text or "cuda" in text


def run_pytest(paths: list[Path], gpu: bool, source: str, timeout_s: float,
               importlib_mode: bool = False) -> dict:
    """Run pytest on the given files in a subprocess; returns {tests, returncode, seconds, output}."""
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *map(str, paths), "-q", "-p", "no:cacheprovider",
               "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(REPO_ROOT), f"--junitxml={junit}"]
        if importlib_mode:
            cmd.append("--import-mode=importlib")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            returncode = None
            output = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes)
                      else (exc.stdout or ""))
        seconds = time.perf_counter() - start
        tests = parse_junit(junit.read_text(), gpu, source) if junit.exists() and junit.stat().st_size else []
    if returncode is None:
        tests.append({"id": f"{source} tests", "source": source, "outcome": "error",
                      "message": f"pytest ran past the {timeout_s:.0f} s limit and was stopped", "seconds": seconds})
    elif not tests and returncode not in (0, 5):
        # pytest stopped before writing any test case (a usage error, an internal error).
        tests.append({"id": f"{source} tests", "source": source, "outcome": "error",
                      "message": f"pytest exited with {returncode}:\n" + "\n".join(output.splitlines()[-15:]),
                      "seconds": seconds})
    return {"tests": tests, "returncode": returncode, "seconds": seconds,
            "output_tail": "\n".join(output.splitlines()[-30:])}


def hidden_test_files(hidden_dir: Path, folder: Path, single_phase: bool) -> list[Path]:
    """The hidden tests for one phase: DIR/<phase folder>/ or DIR/phaseN/, else DIR itself when
    DIR has no phase sub-folders and a single phase is graded."""
    hidden_dir = Path(hidden_dir)
    if not hidden_dir.is_dir():
        raise SystemExit(f"--hidden-tests {hidden_dir}: not a folder")
    number = folder.name.split("_")[0]
    for sub in (hidden_dir / folder.name, hidden_dir / number):
        if sub.is_dir():
            return sorted(sub.rglob("test_*.py"))
    has_phase_dirs = any(p.is_dir() and p.name.startswith("phase") for p in hidden_dir.iterdir())
    if single_phase and not has_phase_dirs:
        return sorted(hidden_dir.glob("test_*.py"))
    return []


def run_scripts(scripts: dict) -> list[dict]:
    results = []
    for command in scripts["commands"]:
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, *command["args"]], cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=scripts.get("timeout_s", 600))
            ok, rc = proc.returncode == 0, proc.returncode
            output = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        except subprocess.TimeoutExpired:
            ok, rc, output = False, None, f"ran past {scripts.get('timeout_s', 600)} s"
        results.append({"name": command["name"], "command": "python " + " ".join(command["args"]),
                        "passed": ok, "returncode": rc, "output": output[:MESSAGE_CHARS],
                        "seconds": time.perf_counter() - start})
    return results


# ------------------------------------------------------------------------------------------------
# Scoring


def score_correctness(tests: list[dict], points: float) -> dict:
    """Points shared equally by all tests; only passing tests earn theirs. The gate (speed points
    allowed) needs at least one passing test, no failure or error, and no test left ungraded for
    want of a GPU."""
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    passing = sum(counts.get(o, 0) for o in PASSING)
    earned = points * passing / len(tests) if tests else 0.0
    broken = counts.get("failed", 0) + counts.get("error", 0)
    if not tests:
        gate, reason = False, "no tests were collected"
    elif broken:
        gate, reason = False, f"{broken} correctness test(s) failed"
    elif counts.get(NO_GPU):
        gate, reason = False, f"{counts[NO_GPU]} GPU test(s) not graded: no GPU"
    elif not passing:
        gate, reason = False, "no test passed"
    else:
        gate, reason = True, "every test that ran passed"
    return {"points": earned, "max": points, "counts": counts, "total": len(tests), "gate": gate,
            "gate_reason": reason}


def level_for(value: float | None, part: dict) -> str | None:
    """The highest level whose threshold value reaches (None: below minimum or no value)."""
    if value is None or not math.isfinite(value):
        return None
    reached = None
    for level in LEVELS:
        if value >= part[level]:
            reached = level
    return reached


def aggregate(values: list[float], how: str = "min") -> float | None:
    if not values or any(v is None or not math.isfinite(v) or v <= 0 for v in values):
        return None
    if how == "geomean":
        return math.exp(sum(math.log(v) for v in values) / len(values))
    return min(values)


def part_values(bench: dict, part: dict, measured: list[dict], ceilings: dict | None) -> tuple[list, str | None]:
    """Per-shape values of a part from the measured shapes, or (values so far, why not graded)."""
    values = []
    for shape in measured:
        mine = shape["impls"].get(bench["impl"], {})
        if mine.get("ms") is None:
            return values, f"{bench['impl']} did not run at {shape['label']}: {mine.get('error', 'not measured')}"
        if part["metric"] == "speedup":
            other = shape["impls"].get(part["against"], {})
            if other.get("ms") is None:
                return values, (f"{part['against']} ({part['kind']}) did not run at {shape['label']}: "
                                f"{other.get('error', 'not measured')}")
            values.append(other["ms"] / mine["ms"])
        else:
            ceiling = (ceilings or {}).get(part["ceiling"])
            if not ceiling or shape.get("bytes") is None:
                return values, f"ceiling {part['ceiling']} unknown"
            rate = shape["bytes"] / (mine["ms"] * 1e-3)  # bytes per second
            unit = 1e12 if part["ceiling"].endswith("TBps") else 1.0
            values.append(rate / (ceiling * unit))
    return values, None


def score_benchmarks(rubric: dict, measured: dict | None, gate: dict, gpu: bool,
                     ceilings: dict | None = None) -> list[dict]:
    """One scored dict per speed part. measured: {benchmark name: [shape results]} or None."""
    parts = []
    for bench in rubric.get("benchmarks", []):
        for part in bench.get("parts", []):
            row = {"benchmark": bench["name"], "name": part["name"], "kind": part["kind"],
                   "metric": part["metric"], "against": part.get("against") or part.get("ceiling"),
                   "aggregate": part.get("aggregate", "min"), "thresholds": {lv: part[lv] for lv in LEVELS},
                   "max": part["points"], "points": 0.0, "values": [], "value": None, "level": None,
                   "status": ""}
            if not gpu:
                row["status"] = NO_GPU
            elif not gate["gate"]:
                row["status"] = f"no speed points: {gate['gate_reason']}"
            elif measured is None or bench["name"] not in measured:
                row["status"] = "not measured"
            else:
                values, why = part_values(bench, part, measured[bench["name"]], ceilings)
                row["values"] = values
                if why:
                    row["status"] = f"not graded: {why}"
                else:
                    row["value"] = aggregate(values, row["aggregate"])
                    row["level"] = level_for(row["value"], part)
                    row["points"] = part["points"] * LEVEL_FRACTION[row["level"]] if row["level"] else 0.0
                    row["status"] = row["level"] or "below minimum"
            parts.append(row)
    return parts


def score_scripts(results: list[dict], points: float) -> dict:
    passed = sum(r["passed"] for r in results)
    return {"points": points * passed / len(results) if results else 0.0, "max": points,
            "passed": passed, "total": len(results)}


# ------------------------------------------------------------------------------------------------
# Benchmarks (GPU)


def shape_label(op: str, shape: dict, dtype: str) -> str:
    if op == "attention":
        label = f"B={shape['B']} H={shape['H']} S={shape['S']} D={shape['D']}"
        return label + (" causal" if shape.get("causal") else "") + f" {dtype}"
    return " ".join(f"{k}={shape[k]}" for k in OPS[op]["shape_keys"]) + f" {dtype}"


def _attention_impl(name: str):
    import functools
    import importlib

    from utils import peers

    if name == "torch_naive":
        return peers.torch_naive
    if name.startswith("sdpa_"):
        return peers.sdpa(name)
    if name.startswith("phase3_tiled_t"):
        return functools.partial(importlib.import_module("phase3_tiled").attention, tile=int(name[len("phase3_tiled_t"):]))
    if name == "phase5_fused":
        return functools.partial(importlib.import_module("phase5_fused").attention, kernel="fast")
    if name == "phase5_fused_teaching":
        return functools.partial(importlib.import_module("phase5_fused").attention, kernel="teaching")
    if name == "phase5_fused_tc":
        return importlib.import_module("phase5_fused.tc").attention
    return importlib.import_module(name).attention


def _bench_setup(op: str, shape: dict, dtype_name: str):
    """(make_call(impl) -> zero-argument callable, reference output, bytes moved, FLOPs).

    make_call resolves the implementation once (importing its phase), so the timed callable does
    nothing but call it."""
    import torch
    import torch.nn.functional as F

    from utils import roofline
    from utils.peers import no_tf32, torch_naive
    from utils.testing import randn, random_qkv

    dtype = getattr(torch, dtype_name)
    if op == "attention":
        B, H, S, D, causal = shape["B"], shape["H"], shape["S"], shape["D"], bool(shape.get("causal"))
        q, k, v = random_qkv(B, H, S, S, D, dtype=dtype)
        ref = torch_naive(q.float(), k.float(), v.float(), is_causal=causal)

        def make_call(name):
            fn = _attention_impl(name)
            return lambda: fn(q, k, v, is_causal=causal)

        nbytes = roofline.attention_bytes(B, H, S, S, D, elem_bytes=q.element_size())
        return make_call, ref, nbytes, roofline.attention_flops(B, H, S, S, D, causal=causal)
    if op == "layer_norm":
        rows, hidden = shape["rows"], shape["hidden"]
        x = randn(rows, hidden, dtype=dtype)
        w, b = randn(hidden, dtype=dtype), randn(hidden, dtype=dtype)
        ref = F.layer_norm(x.float(), (hidden,), w.float(), b.float())

        def make_call(name):
            if name == "torch_layer_norm":
                return lambda: F.layer_norm(x, (hidden,), w, b)
            import phase6_layernorm_mlp as p6

            return lambda: p6.layer_norm(x, w, b)

        nbytes = roofline.layer_norm_bytes(rows, hidden, x.element_size())
        return make_call, ref, nbytes, roofline.layer_norm_flops(rows, hidden)
    if op == "mlp":
        tokens, hidden, inner = shape["tokens"], shape["hidden"], shape["inner"]
        x, res = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype)
        w1, b1 = randn(inner, hidden, dtype=dtype, scale=hidden ** -0.5), randn(inner, dtype=dtype)
        w2, b2 = randn(hidden, inner, dtype=dtype, scale=inner ** -0.5), randn(hidden, dtype=dtype)

        def torch_mlp():  # torch eager, TF32 off (phase 6 run.py's torch_mlp)
            with no_tf32():
                return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2) + res

        def make_call(name):
            if name == "torch_mlp":
                return torch_mlp
            import phase6_layernorm_mlp as p6

            return lambda: p6.mlp(x, w1, b1, w2, b2, residual=res)

        ref = torch_mlp().float()
        nbytes = roofline.mlp_bytes(tokens, hidden, inner, x.element_size())
        return make_call, ref, nbytes, roofline.mlp_flops(tokens, hidden, inner)
    raise ValueError(f"unknown op {op!r}")


def run_benchmark(bench: dict, reps: int = 20) -> list[dict]:
    """Time the benchmark's impl and every impl its parts compare with, shape by shape."""
    import torch

    from utils.bench import time_cuda
    from utils.testing import REL_TOLERANCE, rel_error

    dtype = getattr(torch, bench["dtype"])
    names = [bench["impl"]] + [p["against"] for p in bench.get("parts", []) if p["metric"] == "speedup"]
    names = list(dict.fromkeys(names))
    results = []
    for shape in bench["shapes"]:
        label = shape_label(bench["op"], shape, bench["dtype"])
        make_call, ref, nbytes, flops = _bench_setup(bench["op"], shape, bench["dtype"])
        impls = {}
        for name in names:
            entry: dict = {"ms": None}
            try:
                call = make_call(name)
                out = call()
                torch.cuda.synchronize()
                err = rel_error(out, ref)
                entry["rel_err"] = err
                tol = REL_TOLERANCE[dtype]
                if not err <= tol:
                    entry["error"] = f"wrong result on the benchmark shape: rel error {err:.3g} > {tol:.1e}"
                else:
                    entry["ms"] = time_cuda(call, warmup=3, reps=reps, max_seconds=2.0,
                                            flush=bench.get("flush", "write"))
                    entry["gbps"] = nbytes / (entry["ms"] * 1e-3) / 1e9
                    entry["tflops"] = flops / (entry["ms"] * 1e-3) / 1e12
                del out
            except Exception as exc:  # noqa: BLE001 - a student's kernel may fail in any way
                entry["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            impls[name] = entry
            print(f"  [{bench['name']}] {label} {name}: "
                  + (f"{entry['ms']:.3f} ms" if entry["ms"] is not None else entry.get("error", "")), flush=True)
        results.append({"shape": shape, "label": label, "bytes": nbytes, "flops": flops, "impls": impls})
        del make_call, ref
        torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------------------------------------
# Grading


def grade_phase(folder: Path, gpu: bool, hidden_dir: Path | None = None, single_phase: bool = True,
                bench: bool = True, test_timeout_s: float = 3600.0) -> dict:
    """Grade one phase folder; returns its report section."""
    folder = Path(folder)
    rubric = load_rubric(folder)
    print(f"== {rubric['phase']}: correctness tests", flush=True)
    test_files = sorted(folder.glob("test_*.py"))
    runs = {"phase": run_pytest(test_files, gpu, "phase", test_timeout_s)} if test_files else {}
    tests = list(runs["phase"]["tests"]) if test_files else []
    hidden_files: list[Path] = []
    if hidden_dir is not None:
        hidden_files = hidden_test_files(hidden_dir, folder, single_phase)
        if hidden_files:
            print(f"== {rubric['phase']}: {len(hidden_files)} hidden test file(s)", flush=True)
            runs["hidden"] = run_pytest(hidden_files, gpu, "hidden", test_timeout_s, importlib_mode=True)
            tests += runs["hidden"]["tests"]
    correctness = score_correctness(tests, rubric["correctness"]["points"])

    scripts, script_score = [], None
    if rubric.get("scripts"):
        print(f"== {rubric['phase']}: scripts", flush=True)
        scripts = run_scripts(rubric["scripts"])
        script_score = score_scripts(scripts, rubric["scripts"]["points"])

    measured, ceilings, bench_note = None, None, ""
    if rubric.get("benchmarks"):
        if not gpu:
            bench_note = NO_GPU
        elif not correctness["gate"]:
            bench_note = f"not measured: {correctness['gate_reason']} (no speed points for a wrong kernel)"
        elif not bench:
            bench_note = "not measured (--no-bench)"
        else:
            print(f"== {rubric['phase']}: benchmark", flush=True)
            if any(p["metric"] == "ceiling_fraction" for b in rubric["benchmarks"] for p in b["parts"]):
                from utils import roofline

                ceilings = {k: v for k, v in roofline.get_ceilings().items() if k in CEILING_KEYS}
            measured = {b["name"]: run_benchmark(b, rubric.get("reps", 20)) for b in rubric["benchmarks"]}
    speed = score_benchmarks(rubric, measured, correctness, gpu, ceilings)

    parts = [{"name": "correctness tests", "points": correctness["points"], "max": correctness["max"],
              "status": f"{correctness['counts'].get('passed', 0)} of {correctness['total']} passed"}]
    if script_score:
        parts.append({"name": "scripts run", "points": script_score["points"], "max": script_score["max"],
                      "status": f"{script_score['passed']} of {script_score['total']} ran"})
    for p in speed:
        parts.append({"name": f"{p['benchmark']}: {p['name']}", "points": p["points"], "max": p["max"],
                      "status": p["status"], "value": p["value"]})
    total = sum(p["points"] for p in parts)
    return {"phase": rubric["phase"], "title": rubric.get("title", rubric["phase"]),
            "rubric": str((folder / "rubric.json").relative_to(REPO_ROOT)) if folder.is_relative_to(REPO_ROOT)
            else str(folder / "rubric.json"),
            "notes": rubric.get("notes", ""), "points": total, "max": rubric_max_points(rubric),
            "parts": parts, "correctness": correctness, "tests": tests,
            "pytest": {k: {"returncode": v["returncode"], "seconds": v["seconds"]} for k, v in runs.items()},
            "hidden_test_files": [str(p) for p in hidden_files], "scripts": scripts,
            "benchmark_note": bench_note, "measured": measured, "ceilings": ceilings, "speed": speed}


def build_report(sections: list[dict], gpu: bool, env: dict | None = None) -> dict:
    if env is None:
        from utils.results import env_stamp

        env = env_stamp()
    return {"env": env, "gpu_available": gpu, "no_gpu": None if gpu else NO_GPU_LINE,
            "level_fraction": LEVEL_FRACTION, "phases": sections,
            "points": sum(s["points"] for s in sections), "max": sum(s["max"] for s in sections)}


# ------------------------------------------------------------------------------------------------
# Report


def _fmt(x, digits=3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _cell(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|")


def render_markdown(report: dict) -> str:
    env = report["env"]
    lines = []
    phases = report["phases"]
    title = phases[0]["phase"] if len(phases) == 1 else "all phases"
    lines += [f"# Grade: {title} — {report['points']:.1f} / {report['max']:.0f} points", ""]
    if report.get("no_gpu"):
        lines += [f"**{report['no_gpu']}**", ""]
    lines += ["| GPU | SMs | driver | torch | CUDA | commit | date |", "|---|---|---|---|---|---|---|",
              f"| {env.get('gpu')} | {env.get('sms')} | {env.get('driver')} | {env.get('torch')} | "
              f"{env.get('cuda')} | {env.get('commit')} | {env.get('date')} |", ""]
    fr = report["level_fraction"]
    lines += [f"Speed parts earn {fr['minimum']:.0%} of their points at minimum, {fr['good']:.0%} at good, "
              f"{fr['excellent']:.0%} at excellent, nothing below minimum, and nothing unless every "
              "correctness test of the phase passed.", ""]
    if len(phases) > 1:
        lines += ["| phase | points | max |", "|---|---|---|"]
        lines += [f"| {s['phase']} | {s['points']:.1f} | {s['max']:.0f} |" for s in phases]
        lines += [f"| **total** | **{report['points']:.1f}** | **{report['max']:.0f}** |", ""]
    for s in phases:
        lines += _phase_markdown(s, heading="##" if len(phases) > 1 else "##")
    return "\n".join(lines).rstrip() + "\n"


def _phase_markdown(s: dict, heading: str) -> list[str]:
    lines = [f"{heading} {s['title']}: {s['points']:.1f} / {s['max']:.0f}", "",
             f"Rubric: `{s['rubric']}`. {s['notes']}".rstrip(), ""]
    lines += [f"{heading}# Points", "", "| part | status | value | points | max |", "|---|---|---|---|---|"]
    for p in s["parts"]:
        lines.append(f"| {_cell(p['name'])} | {_cell(p['status'])} | {_fmt(p.get('value'))} | "
                     f"{p['points']:.1f} | {p['max']:.0f} |")
    lines += [f"| **total** | | | **{s['points']:.1f}** | **{s['max']:.0f}** |", ""]

    c = s["correctness"]
    counts = ", ".join(f"{n} {o}" for o, n in sorted(c["counts"].items()))
    lines += [f"{heading}# Correctness tests ({counts or 'none'})", "",
              f"Speed gate: {'open' if c['gate'] else 'closed'} ({c['gate_reason']}).", ""]
    if s["hidden_test_files"]:
        lines += ["Hidden tests: " + ", ".join(f"`{p}`" for p in s["hidden_test_files"]), ""]
    graded = [t for t in s["tests"] if t["outcome"] != NO_GPU]
    ungraded = [t for t in s["tests"] if t["outcome"] == NO_GPU]
    if graded:
        lines += ["| test | source | result | message |", "|---|---|---|---|"]
        order = {"failed": 0, "error": 1, "skipped": 2}
        for t in sorted(graded, key=lambda t: order.get(t["outcome"], 3)):
            result = f"**{t['outcome']}**" if t["outcome"] in ("failed", "error") else t["outcome"]
            lines.append(f"| `{_cell(t['id'], 200)}` | {t['source']} | {result} | {_cell(t['message'])} |")
        lines.append("")
    if ungraded:
        lines += ["<details>", f"<summary>{len(ungraded)} test(s) {NO_GPU}</summary>", ""]
        lines += [f"- `{_cell(t['id'], 200)}` ({t['source']}): {_cell(t['message'], 120)}" for t in ungraded]
        lines += ["", "</details>", ""]

    if s["scripts"]:
        lines += [f"{heading}# Scripts", "", "| script | command | result | output |", "|---|---|---|---|"]
        for r in s["scripts"]:
            lines.append(f"| {_cell(r['name'])} | `{_cell(r['command'])}` | "
                         f"{'ran' if r['passed'] else '**failed** (exit ' + str(r['returncode']) + ')'} | "
                         f"{_cell(r['output'], 200)} |")
        lines.append("")

    if s["speed"] or s["benchmark_note"]:
        lines += [f"{heading}# Speed", ""]
        if s["benchmark_note"]:
            lines += [f"Benchmark {s['benchmark_note']}.", ""]
        if s.get("ceilings"):
            lines += ["Ceilings (utils.roofline.get_ceilings, this GPU): "
                      + ", ".join(f"{k} {v:.3g}" for k, v in s["ceilings"].items()), ""]
        for name, shapes in (s.get("measured") or {}).items():
            impls = list(dict.fromkeys(i for sh in shapes for i in sh["impls"]))
            lines += [f"**{name}**: median ms per shape (time_cuda, L2 flushed), same run", "",
                      "| shape | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
            for sh in shapes:
                cells = []
                for i in impls:
                    e = sh["impls"].get(i, {})
                    cells.append(f"{e['ms']:.3f}" if e.get("ms") is not None else _cell(e.get("error", "—"), 80))
                lines.append(f"| {sh['label']} | " + " | ".join(cells) + " |")
            lines.append("")
        if s["speed"]:
            lines += ["| part | against | per shape | aggregate | minimum / good / excellent | level | points |",
                      "|---|---|---|---|---|---|---|"]
            for p in s["speed"]:
                th = " / ".join(_fmt(p["thresholds"][lv]) for lv in LEVELS)
                per_shape = ", ".join(f"{v:.3g}" for v in p["values"]) or "—"
                lines.append(f"| {_cell(p['benchmark'] + ': ' + p['name'])} | {p['against']} | {per_shape} | "
                             f"{p['aggregate']} = {_fmt(p['value'])} | {th} | {_cell(p['status'])} | "
                             f"{p['points']:.1f} / {p['max']:.0f} |")
            lines.append("")
    return lines


def write_report(report: dict, out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path


# ------------------------------------------------------------------------------------------------
# Command line


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--phase", help="phase number (1-6) or phase folder")
    which.add_argument("--all", action="store_true", help="every phase")
    parser.add_argument("--hidden-tests", type=Path, metavar="DIR",
                        help="a folder of the instructor's pytest files (DIR/<phase folder>/ per phase)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report folder (default build/grade/)")
    parser.add_argument("--no-bench", action="store_true", help="correctness and scripts only")
    parser.add_argument("--test-timeout", type=float, default=3600.0, help="seconds per pytest run")
    args = parser.parse_args(argv)

    gpu = gpu_available()
    if not gpu:
        print(NO_GPU_LINE, flush=True)
    folders = [REPO_ROOT / PHASES[n] for n in sorted(PHASES)] if args.all else [phase_dir(args.phase)]
    try:
        for folder in folders:  # every rubric is checked before anything runs
            load_rubric(folder)
    except RubricError as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    sections = [grade_phase(f, gpu, args.hidden_tests, single_phase=not args.all, bench=not args.no_bench,
                            test_timeout_s=args.test_timeout) for f in folders]
    report = build_report(sections, gpu)
    stem = "all" if args.all else sections[0]["phase"]
    json_path, md_path = write_report(report, args.out, stem)
    for s in sections:
        print(f"{s['phase']}: {s['points']:.1f} / {s['max']:.0f}")
    if len(sections) > 1:
        print(f"total: {report['points']:.1f} / {report['max']:.0f}")
    print(f"report: {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
