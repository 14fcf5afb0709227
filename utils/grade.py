"""Per-phase grader: the official tests, then the speed of the code the student wrote, scored against
the phase's rubric.

    python -m utils.grade --phase 3                        # this checkout, graded against itself
    python -m utils.grade --all --student DIR              # a student's copy, against this checkout
    python -m utils.grade --phase 3 --reference DIR        # this copy, against the instructor's DIR
    python -m utils.grade --phase 3 --hidden-tests DIR     # plus an instructor's hidden tests
    python -m utils.grade --all --out DIR                  # report folder (default build/grade/)
    python -m utils.grade --all --resume                   # reuse the phases an interrupted run finished
    python -m utils.grade --phase 5 --into utils/results/grade/all.json   # one phase of the course's record anew
    python -m utils.grade --phase 5 --official-only        # only the tests that earn points (faster)

The reference copy (the instructor's checkout) supplies everything the grade depends on: the
rubrics and manifests (utils.grade_rubric), the official tests and utils (utils.grade_tests), the
solution kernels the speed is compared with, and this grader itself: given another --reference,
the grader hands over to that copy's own. The student's copy supplies only its phase code. Per phase:

1. Correctness: the official tests (the rubric's files as the reference collects them) run in the
   grading tree; the points are shared by them, a missing one counts as failed. The lessons' other
   tests (their manifests' `tests`) run too and are recorded, not scored (--official-only: they do
   not run, nor the official files' other tests, and the report says so). Hidden tests
   (--hidden-tests: DIR/<phase folder>/ or DIR/phaseN/, or DIR itself for one phase) are official.
2. Scripts (phase 1): each command of the rubric runs in the grading tree and must exit 0.
3. Speed, on a GPU when every official test passed: utils.grade_bench times the rubric's call in the
   reference copy (with the peers) and in the grading tree, each in its own process, after checking
   that the phase's own kernels did the work; the value is the reference solution's time over the
   graded copy's, so the reference graded against itself earns every speed point.

Without a GPU nothing is scored: the tests that need no GPU run and are reported, and each phase
reads "not graded: no GPU". The report (Markdown and JSON, with utils.results' environment stamp)
goes to OUT/<phase>.md|json, or OUT/all.md|json for --all. Each phase's section is also kept in
build/grade/phases/<phase>.json as soon as it is graded: --resume reuses those graded in the same
setting (GPU, driver, torch, CUDA, commit, copies, hidden tests), so a stopped run goes on where it was.
--into REPORT puts the phases graded (this checkout against itself, on a GPU) into an all-phase report
in place of their old sections, each section then stamped with the run that graded it, so that the
course's record can be brought up to date one phase at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from utils.build import REPO_ROOT
from utils.grade_rubric import (LEVELS, NO_GPU, RubricError, load_rubric, lesson_tests, max_points, rubrics,
                                score_benchmark, score_correctness, score_scripts)
from utils.grade_tests import (assemble_tree, hidden_test_files, official_ids, outcome_records, run_pytest,
                               run_scripts, tree_dir)
from utils.progress import duration, remaining, stream_process

DEFAULT_OUT = REPO_ROOT / "build" / "grade"
KEPT = DEFAULT_OUT / "phases"   # each phase's section of the last run, for --resume
WORKER_TIMEOUT_S = 1800.0


# ------------------------------------------------------------------------------------------------
# Speed: the timing worker in the reference copy and in the grading tree


def run_worker(root: Path, benchmarks: list[dict], with_peers: bool, reps: int) -> dict:
    """utils.grade_bench in its own process in root: {"benchmarks": ..., "ceilings": ...}, with
    "failure" (the end of its output) when it stopped before the end."""
    with tempfile.TemporaryDirectory(prefix="grade-bench-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"benchmarks": benchmarks, "peers": with_peers, "reps": reps}))
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
        # its lines (one per shape timed) shown as they come: the timing takes minutes
        returncode, output = stream_process([sys.executable, "-m", "utils.grade_bench", str(spec), str(out)],
                                            root, env, WORKER_TIMEOUT_S)
        if returncode is None:
            failure = f"the timing process ran past {WORKER_TIMEOUT_S:.0f} s"
            print(f"  {failure} and was stopped", flush=True)
        else:
            failure = None if returncode == 0 else "\n".join(output.splitlines()[-10:])
        result = json.loads(out.read_text()) if out.exists() else {"benchmarks": {}}
    return {**result, "failure": failure}


def measure_speed(rubric: dict, tree: Path, reference: Path) -> dict:
    """The reference solution and peers timed in the reference copy, the graded code in its tree."""
    reps = rubric.get("reps", 20)
    ref = run_worker(reference, rubric["benchmarks"], True, reps)
    graded = ref if tree == reference else run_worker(tree, rubric["benchmarks"], False, reps)
    return {"reference": ref, "graded": graded}


def speed_parts(rubric: dict, measured: dict | None, gate: dict, gpu: bool) -> list[dict]:
    parts = []
    for bench in rubric.get("benchmarks", []):
        shapes = None if measured is None else {
            side: measured[side]["benchmarks"].get(bench["name"], []) for side in ("reference", "graded")}
        parts.append(score_benchmark(bench, shapes, gate, gpu))
    return parts


# ------------------------------------------------------------------------------------------------
# One phase


def grade_phase(rubric_path: Path, tree: Path, reference: Path, gpu: bool, hidden_dir: Path | None = None,
                single_phase: bool = True, lesson_paths: list[str] = (), timeout_s: float = 3600.0,
                official_only: bool = False) -> dict:
    """Grade one phase of the code in tree (the grading tree, or the reference itself) against the
    reference copy's rubric and tests; returns its report section. official_only: run the official
    tests alone (not the lessons' other tests, nor the other tests of the official files)."""
    rubric = load_rubric(rubric_path)
    name = rubric["phase"]
    correctness_spec = rubric["correctness"]
    select = correctness_spec.get("select")
    official = official_ids(reference, correctness_spec["tests"], timeout_s, select)
    paths = list(dict.fromkeys([*correctness_spec["tests"], *([] if official_only else lesson_paths)]))
    print(f"== {name}: tests ({len(official)} official, in {', '.join(map(str, paths))})", flush=True)
    run = run_pytest(tree, paths, timeout_s, select if official_only else None, echo=True)
    tests = outcome_records(official, run, gpu)
    hidden = hidden_test_files(hidden_dir, name, single_phase) if hidden_dir else []
    if hidden:  # node ids relative to the hidden folder's parent, in the reference and in the tree alike
        options = {"importlib_mode": True, "rootdir": Path(hidden_dir).resolve().parent}
        hidden_ids = official_ids(reference, hidden, timeout_s, **options)
        print(f"== {name}: hidden tests ({len(hidden_ids)})", flush=True)
        tests += outcome_records(hidden_ids, run_pytest(tree, hidden, timeout_s, echo=True, **options), gpu,
                                 source="hidden")
    correctness = score_correctness(tests, rubric["correctness"]["points"])
    print(f"== {name}: {correctness['passed']} of {correctness['total']} scored tests passed", flush=True)

    scripts = run_scripts(rubric["scripts"], tree) if rubric.get("scripts") else []
    measured, note = None, ""
    if rubric.get("benchmarks"):
        if not gpu:
            note = NO_GPU
        elif not correctness["gate"]:
            note = f"not measured: {correctness['gate_reason']}"
        else:
            print(f"== {name}: speed", flush=True)
            measured = measure_speed(rubric, tree, reference)
            note = "; ".join(dict.fromkeys(m["failure"] for m in measured.values() if m.get("failure")))
    speed = speed_parts(rubric, measured, correctness, gpu)

    parts = [{"name": "correctness: official tests", "points": correctness["points"], "max": correctness["max"],
              "status": f"{correctness['passed']} of {correctness['total']} passed", "value": None}]
    if scripts:
        s = score_scripts(scripts, rubric["scripts"]["points"])
        parts.append({"name": "scripts run", "points": s["points"], "max": s["max"],
                      "status": f"{s['passed']} of {s['total']} ran", "value": None})
    parts += [{"name": f"speed: {p['name']}", "points": p["points"], "max": p["max"], "status": p["status"],
               "value": p["value"]} for p in speed]
    if not gpu:
        for part in parts:
            part["points"] = None
        parts[0]["status"] = (f"{correctness['passed']} of {correctness['total']} passed, "
                              f"{correctness['counts'].get(NO_GPU, 0)} need a GPU")
    return {"phase": name, "title": rubric.get("title", name), "scored": rubric["scored"],
            "rubric": rubric_path.relative_to(reference).as_posix() if rubric_path.is_relative_to(reference)
            else str(rubric_path),
            "points": sum(p["points"] for p in parts) if gpu else None, "max": max_points(rubric),
            "status": "graded" if gpu else NO_GPU, "parts": parts, "correctness": correctness,
            "tests": tests, "official_only": official_only, "hidden_test_files": [str(p) for p in hidden],
            "scripts": scripts,
            "benchmark_note": note, "measured": measured, "speed": speed}


def carry_other_tests(new: dict, old: dict, old_env: dict) -> dict:
    """An --official-only section with the not-scored tests of the section it replaces (those it did
    not run itself), each stamped with the run that ran it, so that the record keeps every lesson's
    last GPU outcome; any other section as it is."""
    if not new.get("official_only"):
        return new
    ran = {t["id"] for t in new["tests"]}
    env = old.get("env", old_env)
    kept = [dict(t, env=t.get("env", env)) for t in old["tests"] if not t["scored"] and t["id"] not in ran]
    return dict(new, tests=[*new["tests"], *kept])


def merge_into(path: Path, sections: list[dict], env: dict) -> dict:
    """The all-phase report at `path` with `sections` in place of its sections of the same phases (a
    phase it lacks is added at the end). Every section then carries its own environment stamp: the
    new ones `env`, the kept ones that of the run that graded them (the report's, where they have
    none yet); the report's own stamp becomes `env` and its points are summed anew. An --official-only
    section keeps the replaced section's other tests (carry_other_tests)."""
    old = json.loads(Path(path).read_text())
    new = {s["phase"]: dict(s, env=env) for s in sections}
    phases = [carry_other_tests(new.pop(s["phase"]), s, old["env"]) if s["phase"] in new
              else dict(s, env=s.get("env", old["env"])) for s in old["phases"]]
    phases += new.values()
    points = [s["points"] for s in phases]
    return {**old, "env": env, "phases": phases, "points": None if None in points else sum(points),
            "max": sum(s["max"] for s in phases)}


def build_report(sections: list[dict], gpu: bool, student: Path, reference: Path, env: dict | None = None) -> dict:
    if env is None:
        from utils.results import env_stamp

        env = env_stamp()
    def where(copy: Path) -> str:
        return "this checkout" if copy == REPO_ROOT else str(copy)

    return {"env": env, "gpu_available": gpu, "no_gpu": None if gpu else NO_GPU,
            "graded_copy": where(student), "reference_copy": where(reference), "phases": sections,
            "points": sum(s["points"] for s in sections) if gpu else None,
            "max": sum(s["max"] for s in sections)}


# ------------------------------------------------------------------------------------------------
# Report: tables of what was found, under headings


def _fmt(x, digits=3) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def _cell(text, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return (text if len(text) <= limit else text[:limit - 1] + "…").replace("|", "\\|")


def _score(points, maximum) -> str:
    return NO_GPU if points is None else f"{points:.1f} / {maximum:.0f}"


def render_markdown(report: dict) -> str:
    env, phases = report["env"], report["phases"]
    title = phases[0]["phase"] if len(phases) == 1 else "all phases"
    lines = [f"# Grade: {title}: {_score(report['points'], report['max'])}", "",
             "| GPU | torch | CUDA | commit | date | graded copy | reference copy |", "|---|---|---|---|---|---|---|",
             f"| {env.get('gpu')} | {env.get('torch')} | {env.get('cuda')} | {env.get('commit')} | {env.get('date')} | "
             f"{report['graded_copy']} | {report['reference_copy']} |", ""]
    if len(phases) > 1:
        lines += ["| phase | score |", "|---|---|"]
        lines += [f"| {s['phase']} | {_score(s['points'], s['max'])} |" for s in phases] + [""]
    for s in phases:
        lines += _phase_markdown(s)
    return "\n".join(lines).rstrip() + "\n"


def _phase_markdown(s: dict) -> list[str]:
    env = s.get("env")  # a section put into the report by --into: the run that graded it
    graded = [f"Graded on {env.get('gpu')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, commit "
              f"{env.get('commit')}, {env.get('date')}.", ""] if env else []
    lines = [f"## {s['title']}: {_score(s['points'], s['max'])}", "", *graded, f"Rubric `{s['rubric']}`: {s['scored']}",
             "", "| part | status | value | points |", "|---|---|---|---|"]
    lines += [f"| {_cell(p['name'])} | {_cell(p['status'])} | {_fmt(p['value'])} | {_score(p['points'], p['max'])} |"
              for p in s["parts"]]
    outcomes = sorted({t["outcome"] for t in s["tests"]})
    lines += ["", "### Tests", "", "| outcome | official | not scored |", "|---|---|---|"]
    lines += [f"| {o} | {sum(t['scored'] for t in s['tests'] if t['outcome'] == o)} | "
              f"{sum(not t['scored'] for t in s['tests'] if t['outcome'] == o)} |" for o in outcomes]
    if s.get("official_only"):
        carried = any("env" in t for t in s["tests"])
        lines += ["", "Only the official tests ran (`--official-only`); "
                  + ("the not-scored tests are kept from the record's earlier run, each with its stamp in the JSON."
                     if carried else "the lessons' other tests are not in this record.")]
    shown = [t for t in s["tests"] if t["outcome"] not in ("passed", "xfailed", NO_GPU)]
    if shown:
        lines += ["", "| test | official | result | message |", "|---|---|---|---|"]
        lines += [f"| `{_cell(t['id'], 200)}` | {'yes' if t['scored'] else 'no'} | {t['outcome']} | "
                  f"{_cell(t['message'])} |" for t in sorted(shown, key=lambda t: not t["scored"])]
    lines.append("")
    if s["scripts"]:
        lines += ["### Scripts", "", "| script | command | exit | output |", "|---|---|---|---|"]
        lines += [f"| {_cell(r['name'])} | `{_cell(r['command'])}` | {r['returncode']} | {_cell(r['output'], 200)} |"
                  for r in s["scripts"]] + [""]
    if s["benchmark_note"]:
        lines += ["### Speed", "", "| note |", "|---|", f"| {_cell(s['benchmark_note'], 1000)} |", ""]
    for part in s["speed"] if s["measured"] else []:
        lines += _speed_table(part, s["measured"])
    return lines


def _speed_table(part: dict, measured: dict) -> list[str]:
    """Per shape: the graded and reference times, their ratio, the peers' times, the own-kernel share."""
    reference_shapes = measured["reference"]["benchmarks"].get(part["name"], [])
    graded_shapes = measured["graded"]["benchmarks"].get(part["name"], [])
    peers = [n for n in (reference_shapes[0]["impls"] if reference_shapes else {}) if n != "impl"]
    ceilings = measured["reference"].get("ceilings") or {}
    lines = [f"### Speed: {part['name']}", "",
             "| shape | yours ms | reference ms | reference / yours | own kernels | "
             + "".join(f"{p} ms | " for p in peers) + "".join(f"% of {c} | " for c in ceilings),
             "|---|---|---|---|---|" + "---|" * (len(peers) + len(ceilings))]
    for ref, mine in zip(reference_shapes, graded_shapes):
        ours, theirs = mine["impls"]["impl"], ref["impls"]["impl"]
        ratio = theirs["ms"] / ours["ms"] if ours.get("ms") and theirs.get("ms") else None
        cells = [ref["label"], _fmt(ours.get("ms")) if ours.get("ms") else _cell(ours.get("error", "–"), 120),
                 _fmt(theirs.get("ms")), _fmt(ratio), _fmt(ours.get("own_share"))]
        cells += [_fmt(ref["impls"][p].get("ms")) for p in peers]
        for key, value in ceilings.items():
            work = ref["bytes"] if key.endswith("TBps") else ref["flops"]
            cells.append(f"{100 * work / (ours['ms'] * 1e-3) / (value * 1e12):.0f}%" if ours.get("ms") else "–")
        lines.append("| " + " | ".join(cells) + " |")
    th = " / ".join(_fmt(part["thresholds"][lv]) for lv in LEVELS)
    return lines + ["", "| aggregate | value | minimum / good / excellent | level |", "|---|---|---|---|",
                    f"| {part['aggregate']} | {_fmt(part['value'])} | {th} | {part['status']} |", ""]


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


def hand_over(args, reference: Path, student: Path) -> int:
    """Run the reference copy's own grader on this copy (the grade must not depend on this copy's)."""
    cmd = [sys.executable, "-m", "utils.grade", "--student", str(student), "--out", str(args.out.resolve()),
           "--test-timeout", str(args.test_timeout)]
    cmd += ["--all"] if args.all else ["--phase", str(args.phase)]
    cmd += ["--hidden-tests", str(args.hidden_tests.resolve())] if args.hidden_tests else []
    print(f"grade: handing over to the grader of {reference}", flush=True)
    return subprocess.call(cmd, cwd=reference, env={**os.environ, "PYTHONPATH": str(reference)})


def setting(gpu: bool, student: Path, reference: Path, hidden: Path | None, official_only: bool = False) -> dict:
    """What a phase's grade depends on besides the code: a kept section is reused only in the same one."""
    from utils.results import env_stamp

    env = env_stamp()
    return {**{key: env[key] for key in ("gpu", "sms", "torch", "cuda", "driver", "commit")}, "gpu_available": gpu,
            "student": str(student), "reference": str(reference), "hidden_tests": str(hidden) if hidden else None,
            "official_only": official_only}


def kept_section(phase: str, where: dict) -> dict | None:
    """The section of phase kept by an earlier run in the same setting, if any."""
    path = KEPT / f"{phase}.json"
    if not path.is_file():
        return None
    kept = json.loads(path.read_text())
    return kept["section"] if kept.get("setting") == where else None


def keep_section(phase: str, section: dict, where: dict) -> None:
    path = KEPT / f"{phase}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setting": where, "section": section}, indent=1, default=str) + "\n")


def phase_rubrics(phase: str | None) -> dict[int, Path]:
    """The rubric of --phase (its number or folder name), or every rubric."""
    found = rubrics()
    if phase is None:
        return found
    chosen = {n: p for n, p in found.items() if phase in (str(n), p.parent.name)}
    if not chosen:
        raise SystemExit(f"--phase {phase}: the phases with a rubric are "
                         + ", ".join(f"{n} ({p.parent.name})" for n, p in found.items()))
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--phase", help="phase number or folder name")
    which.add_argument("--all", action="store_true", help="every phase with a rubric")
    parser.add_argument("--student", type=Path, default=REPO_ROOT, help="the copy graded (default: this checkout)")
    parser.add_argument("--reference", type=Path, default=REPO_ROOT,
                        help="the instructor's copy: rubrics, official tests, solutions (default: this checkout)")
    parser.add_argument("--hidden-tests", type=Path, metavar="DIR", help="a folder of the instructor's pytest files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report folder (default build/grade/)")
    parser.add_argument("--test-timeout", type=float, default=3600.0, help="seconds per pytest run")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the phases a stopped run graded in the same setting (build/grade/phases/)")
    parser.add_argument("--official-only", action="store_true",
                        help="run only the official tests, not the lessons' other tests (faster; the report says so)")
    parser.add_argument("--into", type=Path, metavar="REPORT",
                        help="put the phases graded into this all-phase report (its JSON) instead of --out")
    args = parser.parse_args(argv)
    student, reference = args.student.resolve(), args.reference.resolve()
    if args.into and not (student == reference == REPO_ROOT and not args.hidden_tests and args.into.exists()
                          and gpu_available()):
        print(f"grade: --into {args.into} takes this checkout graded against itself on a GPU, without hidden "
              f"tests, into an existing report", file=sys.stderr)
        return 2
    if reference != REPO_ROOT:
        return hand_over(args, reference, student)

    try:
        chosen = phase_rubrics(None if args.all else args.phase)
        for path in chosen.values():  # every rubric is checked before anything runs
            load_rubric(path)
    except RubricError as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    gpu = gpu_available()
    if not gpu:
        print(f"No CUDA GPU visible: the speed and the GPU tests cannot be graded here, so no phase gets a score "
              f"({NO_GPU}). The tests that need no GPU run and are listed in the report.", flush=True)
    tree = reference if student == reference else assemble_tree(student, reference, tree_dir(reference, student))
    where = setting(gpu, student, reference, args.hidden_tests, args.official_only)
    sections, start = [], time.perf_counter()
    for n, (number, path) in enumerate(chosen.items(), 1):
        spent = time.perf_counter() - start
        left = remaining(n - 1, len(chosen), spent)
        print(f"\n=== grade: phase {n} of {len(chosen)} ({path.parent.name}), {duration(spent)} so far"
              f"{', ' + left if left else ''}", flush=True)
        section = kept_section(path.parent.name, where) if args.resume else None
        if section is not None:
            print(f"== {path.parent.name}: graded by an earlier run in this setting (--resume)", flush=True)
        else:
            section = grade_phase(path, tree, reference, gpu, args.hidden_tests, single_phase=not args.all,
                                  lesson_paths=lesson_tests(number), timeout_s=args.test_timeout,
                                  official_only=args.official_only)
            keep_section(path.parent.name, section, where)
        sections.append(section)
    if args.into:
        from utils.results import env_stamp

        report = merge_into(args.into, sections, env_stamp())
        json_path, md_path = write_report(report, args.into.parent, args.into.stem)
    else:
        report = build_report(sections, gpu, student, reference)
        json_path, md_path = write_report(report, args.out, "all" if args.all else sections[0]["phase"])
    for s in sections:
        done = s["correctness"]
        print(f"{s['phase']}: {_score(s['points'], s['max'])}" + ("" if gpu else
              f" ({done['passed']} of {done['total']} official tests passed, {done['counts'].get(NO_GPU, 0)} need a GPU)"))
    if len(sections) > 1:
        print(f"total: {_score(report['points'], report['max'])}")
    print(f"report: {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
