"""The "How this phase is graded" section of each phase README, generated from the phase's rubric.json
and from the last recorded grade of the solutions (utils/results/grade/all.json), never typed by hand.

`python -m utils.grading_doc` (also run by utils.report, so by `make run`) rewrites the section between
the grading markers of every phase README.
"""

from __future__ import annotations

import sys

from utils.build import REPO_ROOT
from utils.gpu_checks import GRADE_RECORD, load_record
from utils.grade import LEVEL_FRACTION, LEVELS, PHASES, load_rubric
from utils.readme import fmt, replace_between

BEGIN, END = "<!-- grading:begin -->", "<!-- grading:end -->"
METRIC_WORDS = {"speedup": "speed-up (time of the other / time of ours)",
                "ceiling_fraction": "fraction of the ceiling measured on the same GPU"}


def _shapes(bench: dict) -> str:
    return "; ".join(", ".join(f"{k}={v}" for k, v in shape.items()) for shape in bench.get("shapes", []))


def rubric_lines(number: int, rubric: dict) -> list[str]:
    """How the grader scores this phase: the command, the notes, one row per part."""
    levels = ", ".join(f"{lv} {LEVEL_FRACTION[lv]:.0%}" for lv in LEVELS)
    lines = [f"`make grade PHASE={number}` (or `python -m utils.grade --phase {number}`) grades the checked-out "
             f"copy against `{PHASES[number]}/rubric.json`; `HIDDEN=DIR` adds an instructor's tests. Correctness "
             f"comes first: no speed points unless every test passes. A speed part earns a share of its points "
             f"by the highest level its value reaches ({levels}; nothing below minimum); the value is "
             f"aggregated over the shapes listed.", "", rubric.get("notes", ""), "",
             "| part | measured on | minimum | good | excellent | points |", "|---|---|---|---|---|---|",
             f"| correctness: every test of the phase (and the hidden ones) | – | – | – | all pass | "
             f"{rubric['correctness']['points']} |"]
    scripts = rubric.get("scripts")
    if scripts:
        names = ", ".join(c["name"] for c in scripts["commands"])
        lines.append(f"| scripts run and exit 0: {names} | – | – | – | all run | {scripts['points']} |")
    for bench in rubric.get("benchmarks", []):
        for part in bench["parts"]:
            what = f"{bench['name']}: {part['name']} — {METRIC_WORDS[part['metric']]}, {part.get('aggregate', 'min')}"
            lines.append(f"| {what} | {_shapes(bench)} | {fmt(part['minimum'])} | {fmt(part['good'])} | "
                         f"{fmt(part['excellent'])} | {part['points']} |")
    return lines + [""]


def record_lines(folder: str, grade: dict | None) -> list[str]:
    """The solutions' grade from the recorded run, if the record holds this phase."""
    phase = next((p for p in (grade or {}).get("phases", []) if p["phase"] == folder), None)
    if phase is None:
        return ["No recorded grade of the solutions for this phase yet "
                "(`python -m utils.run_all --grade` on a GPU writes it)."]
    env = grade["env"]
    lines = [f"The solutions, graded on {env['gpu']} (commit {env['commit']}, {env['date'][:10]}; "
             f"{GRADE_RECORD.relative_to(REPO_ROOT).as_posix()}): **{fmt(phase['points'])} / {phase['max']}**.", "",
             "| part | status | value | points |", "|---|---|---|---|"]
    for part in phase["parts"]:
        value = fmt(part["value"]) if part.get("value") is not None else "–"
        lines.append(f"| {part['name']} | {part['status']} | {value} | {fmt(part['points'])} / {part['max']} |")
    return lines


def section_lines(number: int, grade: dict | None) -> list[str]:
    folder = PHASES[number]
    return rubric_lines(number, load_rubric(REPO_ROOT / folder)) + record_lines(folder, grade)


def update_readmes() -> None:
    grade = load_record(GRADE_RECORD)
    for number, folder in PHASES.items():
        replace_between(REPO_ROOT / folder / "README.md", BEGIN, END, section_lines(number, grade))


def main() -> int:
    update_readmes()
    print("phase READMEs: grading sections regenerated from the rubrics and utils/results/grade")
    return 0


if __name__ == "__main__":
    sys.exit(main())
