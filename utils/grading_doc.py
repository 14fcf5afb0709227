"""The `grading` table of a phase README: its rubric and the solutions' last recorded grade, as tables.

utils.render fills it wherever a README has `<!-- table:grading -->` markers, from the rubric the
folder's manifest.json declares and the grader's record utils/results/grade/all.json
(`python -m utils.grade --all --out utils/results/grade` on a GPU, or one phase anew with
`--phase N --into utils/results/grade/all.json`). What the tables mean is
written by hand in the README, next to the markers.
"""

from __future__ import annotations

from utils.build import REPO_ROOT
from utils.gpu_checks import GRADE_RECORD, load_record, section_env
from utils.grade_rubric import LEVEL_FRACTION, LEVELS, load_rubric
from utils.grade_tests import record_id


def _num(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _shapes(bench: dict) -> str:
    return "; ".join(" ".join(f"{k}={v}" for k, v in shape.items()) for shape in bench["shapes"])


def _call(bench: dict) -> str:
    kwargs = ", ".join(f"{k}={v!r}" for k, v in bench.get("kwargs", {}).items())
    return f"`{bench['call']}`" + (f" ({kwargs})" if kwargs else "")


def rubric_lines(rubric: dict) -> list[str]:
    """One row per scored part: what runs, the thresholds of a speed part, the points."""
    levels = " | ".join(f"{lv} ({LEVEL_FRACTION[lv]:.0%})" for lv in LEVELS)
    lines = [f"| part | what runs | own kernels | {levels} | points |", "|---|---|---|---|---|---|---|"]
    correctness = rubric["correctness"]
    tests = ", ".join(f"`{t}`" for t in correctness["tests"])
    select = f" (`-k {correctness['select']}`)" if correctness.get("select") else ""
    lines.append(f"| correctness | {tests}{select} | – | – | – | – | {correctness['points']} |")
    if rubric.get("scripts"):
        names = "; ".join(c["name"] for c in rubric["scripts"]["commands"])
        lines.append(f"| scripts | {names} | – | – | – | – | {rubric['scripts']['points']} |")
    for bench in rubric.get("benchmarks", []):
        thresholds = " | ".join(f"{bench[lv]:g}x" for lv in LEVELS)
        kernels = bench["kernels"].replace("|", "\\|")
        lines.append(f"| speed: {bench['name']} | {_call(bench)} at {_shapes(bench)} | `{kernels}` | {thresholds} | "
                     f"{bench['points']} |")
    return lines


def scored_parts(rubric: dict) -> list[str]:
    """The names of the parts a grade under this rubric records, in the grader's words."""
    names = ["correctness: official tests"] + (["scripts run"] if rubric.get("scripts") else [])
    return names + [f"speed: {bench['name']}" for bench in rubric.get("benchmarks", [])]


def graded_under(rubric: dict, section: dict) -> bool:
    """Whether a phase's recorded grade was made under this rubric: the same parts, and a scored test
    from each of its official test files (a file the rubric gained since has none)."""
    scored_files = {t["id"].partition("::")[0] for t in section.get("tests", []) if t.get("scored")}
    official_files = [record_id(path) for path in rubric.get("correctness", {}).get("tests", [])]
    return ([p["name"] for p in section["parts"]] == scored_parts(rubric)
            and all(f in scored_files for f in official_files))


def record_lines(rubric: dict, record: dict | None) -> list[str]:
    """The parts of the phase's last recorded grade, and where it was recorded (and whether under
    another rubric than this one: a record older than the rubric)."""
    phase = rubric["phase"]
    lines = ["| part | status | value | points |", "|---|---|---|---|"]
    section = next((p for p in (record or {}).get("phases", []) if p["phase"] == phase), None)
    if section is None:
        return [*lines, "| – | not recorded on a GPU yet | – | – |"]
    for part in section["parts"]:
        points = part.get("points")
        lines.append(f"| {part['name']} | {part['status']} | {_num(part.get('value'))} | "
                     f"{'–' if points is None else _num(points)} / {part['max']:g} |")
    total = section.get("points")
    lines.append(f"| **total** | | | **{'–' if total is None else _num(total)} / {section['max']:g}** |")
    env = section_env(record, section)
    older = not graded_under(rubric, section)
    return [*lines, "", f"_{GRADE_RECORD.relative_to(REPO_ROOT).as_posix()}: {env['gpu']}, torch {env['torch']}, "
                        f"CUDA {env['cuda']}, {env['date'][:10]}, commit {env['commit']}"
                        + ("; graded under an earlier rubric" if older else "") + "._"]


def grading_lines(manifest: dict) -> list[str]:
    """The `grading` table of a folder: the rubric its manifest declares, then the recorded grade."""
    if "rubric" not in manifest:
        raise ValueError(f"{manifest['_dir'] / 'manifest.json'} declares no rubric for its grading table")
    rubric = load_rubric(manifest["_dir"] / manifest["rubric"])
    return [*rubric_lines(rubric), "", *record_lines(rubric, load_record(GRADE_RECORD))]
