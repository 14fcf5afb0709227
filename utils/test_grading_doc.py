"""The README grading sections, generated from the rubrics and the recorded grade (CPU only)."""

import pytest

from utils import grading_doc
from utils.grade import PHASES, load_rubric
from utils.build import REPO_ROOT


@pytest.mark.parametrize("number", sorted(PHASES))
def test_every_rubric_part_has_a_row_and_every_readme_the_markers(number):
    rubric = load_rubric(REPO_ROOT / PHASES[number])
    lines = grading_doc.rubric_lines(number, rubric)
    parts = [p for b in rubric.get("benchmarks", []) for p in b["parts"]]
    assert sum(line.startswith("| ") for line in lines) == 1 + 1 + len(parts) + bool(rubric.get("scripts"))  # header, correctness
    assert f"make grade PHASE={number}" in lines[0]
    text = (REPO_ROOT / PHASES[number] / "README.md").read_text()
    assert grading_doc.BEGIN in text and grading_doc.END in text


def test_record_lines_show_the_recorded_points_or_say_there_are_none():
    grade = {"env": {"gpu": "GPU X", "commit": "abc1234", "date": "2026-01-02T00:00:00"},
             "phases": [{"phase": "phase2_naive", "points": 90.0, "max": 100,
                         "parts": [{"name": "correctness tests", "status": "9 of 9 passed", "points": 90.0, "max": 90}]}]}
    lines = grading_doc.record_lines("phase2_naive", grade)
    assert "GPU X" in lines[0] and "**90 / 100**" in lines[0] and lines[-1].startswith("| correctness tests |")
    assert grading_doc.record_lines("phase3_tiled", grade)[0].startswith("No recorded grade")
