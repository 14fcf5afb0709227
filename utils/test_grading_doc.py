"""The `grading` table (utils.grading_doc, filled by utils.render): tables only, from the rubric and
the grader's record (CPU only)."""

import json
import re

import pytest

from utils import grading_doc, render
from utils.build import REPO_ROOT
from utils.grade_rubric import load_rubric, rubrics
from utils.manifest import load_manifest, manifests

RUBRICS = rubrics()
RECORD = {"env": {"gpu": "GPU X", "torch": "2.x", "cuda": "13.0", "commit": "abc1234", "date": "2026-01-02T00:00:00"},
          "phases": [{"phase": "phase2_naive", "points": 100.0, "max": 100,
                      "parts": [{"name": "correctness: official tests", "status": "117 of 117 passed", "value": None,
                                 "points": 90.0, "max": 90},
                                {"name": "speed: attention FP32", "status": "excellent", "value": 1.0,
                                 "points": 10.0, "max": 10}]}]}


def is_table_line(line: str) -> bool:
    """A table row, a blank line, or the one italic line naming the record and where it was made."""
    return line == "" or line.startswith("|") or (line.startswith("_") and line.endswith("._"))


@pytest.mark.parametrize("number", sorted(RUBRICS))
def test_rubric_table_has_a_row_per_scored_part(number):
    rubric = load_rubric(RUBRICS[number])
    lines = grading_doc.rubric_lines(rubric)
    assert all(is_table_line(line) for line in lines)
    rows = lines[2:]
    assert len(rows) == 1 + bool(rubric.get("scripts")) + len(rubric["benchmarks"])
    points = [float(row.rstrip(" |").rsplit("|", 1)[1]) for row in rows]
    assert sum(points) == 100
    for bench, row in zip(rubric["benchmarks"], rows[-len(rubric["benchmarks"]) or len(rows):]):
        assert bench["call"] in row and f"{bench['excellent']:g}x" in row
        assert row.count(" | ") == lines[0].count(" | ")  # the regex's | are escaped


def test_record_table_shows_the_recorded_parts_or_that_there_are_none():
    rubric = {"phase": "phase2_naive", "benchmarks": [{"name": "attention FP32"}]}
    lines = grading_doc.record_lines(rubric, RECORD)
    assert all(is_table_line(line) for line in lines)
    assert "| correctness: official tests | 117 of 117 passed | – | 90 / 90 |" in lines
    assert "| **total** | | | **100 / 100** |" in lines
    assert "GPU X" in lines[-1] and "abc1234" in lines[-1] and "grade/all.json" in lines[-1]
    assert "earlier rubric" not in lines[-1]
    other = {"phase": "phase3_tiled", "benchmarks": []}
    assert grading_doc.record_lines(other, RECORD)[-1] == "| – | not recorded on a GPU yet | – | – |"
    no_gpu = {**RECORD, "phases": [{**RECORD["phases"][0], "points": None,
                                   "parts": [{**p, "points": None} for p in RECORD["phases"][0]["parts"]]}]}
    assert "| **total** | | | **– / 100** |" in grading_doc.record_lines(rubric, no_gpu)


def test_a_record_made_under_another_rubric_says_so():
    changed = {"phase": "phase2_naive", "benchmarks": [{"name": "attention FP32, a new part"}]}
    assert grading_doc.record_lines(changed, RECORD)[-1].endswith("; graded under an earlier rubric._")


def test_a_record_without_tests_of_an_official_file_was_made_under_another_rubric():
    section = {**RECORD["phases"][0], "tests": [{"id": "phase2_naive.test_naive::test_a[teaching]", "scored": True},
                                               {"id": "phase2_naive.test_other::test_b", "scored": False}]}
    record = {**RECORD, "phases": [section]}
    rubric = {"phase": "phase2_naive", "benchmarks": [{"name": "attention FP32"}],
              "correctness": {"tests": ["phase2_naive/test_naive.py"]}}
    assert "earlier rubric" not in grading_doc.record_lines(rubric, record)[-1]
    rubric["correctness"]["tests"].append("phase2_naive/test_other.py")  # recorded, but not scored then
    assert grading_doc.record_lines(rubric, record)[-1].endswith("; graded under an earlier rubric._")


def test_a_section_with_its_own_stamp_is_shown_with_it():
    """A phase put into the record by a later run (utils.grade --into) names that run."""
    env = {**RECORD["env"], "gpu": "GPU Y", "commit": "def5678"}
    record = {**RECORD, "phases": [{**RECORD["phases"][0], "env": env}]}
    rubric = {"phase": "phase2_naive", "benchmarks": [{"name": "attention FP32"}]}
    stamp = grading_doc.record_lines(rubric, record)[-1]
    assert "GPU Y" in stamp and "def5678" in stamp


def test_the_renderer_fills_the_grading_table_where_its_markers_stand(tmp_path):
    """A phase folder whose README has the markers and whose manifest declares a rubric."""
    folder = tmp_path / "phase9_fake"
    folder.mkdir()
    rubric = json.loads((REPO_ROOT / "phase3_tiled" / "rubric.json").read_text())
    rubric.update(phase="phase9_fake", correctness={"points": 60, "tests": ["phase9_fake/test_fake.py"]})
    rubric["benchmarks"][0]["call"] = "phase9_fake:attention"
    (folder / "rubric.json").write_text(json.dumps(rubric))
    (folder / "__init__.py").write_text("")
    (folder / "test_fake.py").write_text("")
    (folder / "manifest.json").write_text(json.dumps({"name": "phase9_fake", "rubric": "rubric.json"}))
    (folder / "README.md").write_text("# T\n\nHand-written.\n\n<!-- table:grading -->\nold\n<!-- /table:grading -->\n")
    assert render.render_tables(load_manifest(folder)) == ["grading"]
    text = (folder / "README.md").read_text()
    assert "old" not in text and "Hand-written." in text and "| speed: attention FP32 | `phase9_fake:attention`" in text
    body = text.split("<!-- table:grading -->\n")[1].split("<!-- /table:grading -->")[0]
    assert all(is_table_line(line) for line in body.splitlines())


def test_a_grading_table_needs_a_declared_rubric(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "t"}))
    (tmp_path / "README.md").write_text("<!-- table:grading -->\n<!-- /table:grading -->\n")
    with pytest.raises(ValueError, match="declares no rubric"):
        render.render_tables(load_manifest(tmp_path))


def grading_readmes() -> dict:
    """README -> the rubric its grading table shows: the READMEs of the manifests that declare a
    rubric, and the README beside each rubric (phase 5's overview)."""
    found = {path.parent / "README.md": path for path in RUBRICS.values()}
    for path in manifests():
        manifest = load_manifest(path.parent)
        if "rubric" in manifest:
            found[path.parent / manifest.get("readme", "README.md")] = (path.parent / manifest["rubric"]).resolve()
    return {readme: rubric for readme, rubric in found.items() if "<!-- table:grading -->" in readme.read_text()}


def test_every_rubric_has_its_grading_table_in_a_readme_and_no_old_marker_is_left():
    for path in [*manifests(), *RUBRICS.values()]:
        text = (path.parent / "README.md").read_text()
        assert "grading:begin" not in text and "grading:end" not in text, path
    assert set(grading_readmes().values()) == set(RUBRICS.values())


@pytest.mark.parametrize("number", sorted(RUBRICS))
def test_hand_written_lines_above_the_table_name_the_grade_command(number):
    readmes = [readme for readme, rubric in grading_readmes().items() if rubric == RUBRICS[number]]
    assert readmes
    for readme in readmes:
        above = readme.read_text().split("<!-- table:grading -->")[0].rstrip("\n").splitlines()[-6:]
        assert any(f"make grade PHASE={number}" in line for line in above)
        assert not re.search(r"\d+(\.\d+)? / \d+", "\n".join(above))  # no typed score
