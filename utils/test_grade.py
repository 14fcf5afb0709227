"""The grader (utils.grade, grade_rubric, grade_tests, grade_bench, grade_plugin): rubrics, scores,
the cheats it refuses, and the no-GPU path; the GPU parts run where a GPU is and skip elsewhere."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from utils import grade, grade_bench, grade_rubric, grade_tests, peers
from utils.build import REPO_ROOT
from utils.testing import requires_gpu

RUBRICS = grade_rubric.rubrics()
ENV = {"gpu": "none", "sms": 0, "torch": "x", "cuda": "none", "driver": "none", "date": "d", "commit": "c"}
SCORE = re.compile(r"\d+(\.\d+)? / \d+")
# Kernel names that torch's own libraries launch (cuBLAS, SDPA, torch's softmax and LayerNorm).
LIBRARY_KERNELS = ["ampere_sgemm_128x64_nn", "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32",
                   "cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>",
                   "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float>::Params)",
                   "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>(Flash_fwd_params)",
                   "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*)",
                   "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int)"]


def phase_kernels(folder: Path) -> dict[str, str]:
    """Kernel name -> the text of the .cu file that defines it, for every kernel under folder."""
    found = {}
    for path in folder.rglob("*.cu"):
        text = path.read_text()
        found.update({name: text for name in re.findall(r"__global__[\s\S]{0,300}?\b(\w+_kernel)\s*\(", text)})
    return found


# ------------------------------------------------------------------------------------------------
# The course's rubrics


def test_every_phase_has_a_rubric_declared_by_its_manifests():
    assert sorted(RUBRICS) == [1, 2, 3, 4, 5, 6]
    assert RUBRICS[5] == REPO_ROOT / "phase5_fused" / "rubric.json"


@pytest.mark.parametrize("number", sorted(RUBRICS))
def test_every_rubric_loads_totals_100_and_names_its_official_tests(number):
    rubric = grade_rubric.load_rubric(RUBRICS[number])  # also checks the files and modules exist
    assert grade_rubric.max_points(rubric) == 100
    assert rubric["correctness"]["tests"] and rubric["scored"]
    for bench in rubric["benchmarks"]:
        assert bench["call"].startswith(rubric["phase"])  # the phase's own API
        assert bench["excellent"] <= 1  # the reference solution reaches every level


@pytest.mark.parametrize("number", [n for n in sorted(RUBRICS) if grade_rubric.load_rubric(RUBRICS[n])["benchmarks"]])
def test_speed_is_scored_only_on_kernels_the_student_writes(number):
    """Each benchmark's kernel regex matches kernels of its phase, every one in a file with a solution
    region (in the starter kit, where the regions are TODOs: a TODO), and no kernel of torch's libraries."""
    rubric = grade_rubric.load_rubric(RUBRICS[number])
    kernels = phase_kernels(RUBRICS[number].parent)
    for bench in rubric["benchmarks"]:
        matched = {name: text for name, text in kernels.items() if re.search(bench["kernels"], name)}
        assert matched, bench["kernels"]
        assert all("BEGIN SOLUTION" in text or "TODO(student)" in text for text in matched.values()), sorted(matched)
        assert not [k for k in LIBRARY_KERNELS if re.search(bench["kernels"], k)]


def test_shipped_kernels_earn_no_speed_points():
    benches = [b for path in RUBRICS.values() for b in grade_rubric.load_rubric(path)["benchmarks"]]
    for shipped in ("fused_fast_kernel", "tc_attention_kernel", "linear_kernel", "gelu_kernel"):
        assert not [b for b in benches if re.search(b["kernels"], shipped)], shipped
    phase5 = grade_rubric.load_rubric(RUBRICS[5])
    assert phase5["correctness"]["select"] == "teaching"


def test_bad_rubrics_are_reported():
    rubric = json.loads(RUBRICS[3].read_text())
    bench = rubric["benchmarks"][0]
    bench["good"], bench["excellent"] = 3.0, 2.0
    bench["call"] = "phase9_magic:attention"
    bench["kernels"] = "(unclosed"
    bench["peers"] = ["cudnn_magic"]
    bench["kind"] = "previous"
    bench["shapes"].append({"B": 1, "H": 1, "S": 0})
    bench["flush"] = "sideways"
    rubric["correctness"]["tests"] = ["phase3_tiled/test_gone.py"]
    problems = " ".join(grade_rubric.validate_rubric(rubric, "phase4_coalesced", root=REPO_ROOT))
    for words in ("thresholds must rise", "no module phase9_magic", "not a regex", "cudnn_magic",
                  "unknown field 'kind'", "lacks positive integers", "the folder is", "sideways", "test_gone.py"):
        assert words in problems, words
    bench.update(good=1.0, excellent=1.5)
    assert "would deny the reference solution" in " ".join(grade_rubric.validate_rubric(rubric))


# ------------------------------------------------------------------------------------------------
# Scores


def _tests(*outcomes, scored=True):
    return [{"id": f"t{n}", "source": "phase", "scored": scored, "outcome": o, "message": "", "seconds": 0.0}
            for n, o in enumerate(outcomes)]


def test_correctness_points_are_over_the_official_tests_and_any_non_pass_closes_the_gate():
    ok = grade_rubric.score_correctness(_tests("passed", "passed", "xfailed", "passed"), 60)
    assert ok["points"] == pytest.approx(60) and ok["gate"]
    for outcome in ("failed", "error", "skipped", grade_rubric.NO_GPU):
        c = grade_rubric.score_correctness(_tests("passed", outcome, "passed", "passed"), 60)
        assert c["points"] == pytest.approx(45) and not c["gate"], outcome
    unscored = grade_rubric.score_correctness(_tests("passed") + _tests("failed", scored=False), 60)
    assert unscored["points"] == 60 and unscored["gate"]  # shipped code's tests are recorded, not scored
    assert not grade_rubric.score_correctness([], 60)["gate"]


def test_levels_at_their_edges():
    bench = {"minimum": 0.5, "good": 0.75, "excellent": 0.9}
    assert grade_rubric.level_for(0.49, bench) is None
    assert grade_rubric.level_for(0.5, bench) == "minimum"
    assert grade_rubric.level_for(0.89, bench) == "good"
    assert grade_rubric.level_for(0.9, bench) == "excellent"
    assert grade_rubric.level_for(None, bench) is None and grade_rubric.level_for(float("nan"), bench) is None
    assert grade_rubric.aggregate([2.0, 8.0], "geomean") == pytest.approx(4.0)
    assert grade_rubric.aggregate([2.0, 8.0], "min") == 2.0
    assert grade_rubric.aggregate([2.0, float("inf")]) is None


OPEN = {"gate": True, "gate_reason": "all passed"}


def _shapes(*impl_ms, peer_ms=1.0):
    return [{"label": f"shape{n}", "bytes": 4e9, "flops": 1e12,
             "impls": {"impl": {"ms": ms} if ms else {"ms": None, "error": "it broke"}, "torch_naive": {"ms": peer_ms}}}
            for n, ms in enumerate(impl_ms)]


def test_speed_is_the_reference_time_over_yours_at_the_worst_shape():
    bench = grade_rubric.load_rubric(RUBRICS[3])["benchmarks"][0]
    part = grade_rubric.score_benchmark(bench, {"reference": _shapes(1.0, 2.0), "graded": _shapes(1.25, 2.0)}, OPEN, True)
    assert part["values"] == [0.8, 1.0] and part["value"] == 0.8 and part["level"] == "good"
    assert part["points"] == pytest.approx(40 * grade_rubric.LEVEL_FRACTION["good"])
    faster = grade_rubric.score_benchmark(bench, {"reference": _shapes(1.0, 2.0), "graded": _shapes(0.5, 1.0)}, OPEN, True)
    assert faster["points"] == 40


def test_no_speed_points_without_a_measurement_a_gate_or_a_gpu():
    bench = grade_rubric.load_rubric(RUBRICS[3])["benchmarks"][0]
    broken = grade_rubric.score_benchmark(bench, {"reference": _shapes(1.0, 1.0), "graded": _shapes(1.0, None)}, OPEN, True)
    assert broken["points"] == 0 and "it broke" in broken["status"]
    no_ref = grade_rubric.score_benchmark(bench, {"reference": _shapes(None, 1.0), "graded": _shapes(1.0, 1.0)}, OPEN, True)
    assert no_ref["points"] == 0 and "reference solution" in no_ref["status"]
    short = grade_rubric.score_benchmark(bench, {"reference": _shapes(1.0, 1.0), "graded": _shapes(1.0)}, OPEN, True)
    assert short["points"] == 0
    closed = {"gate": False, "gate_reason": "2 of 9 official test(s) did not pass"}
    assert grade_rubric.score_benchmark(bench, None, closed, True)["status"].endswith("did not pass")
    assert grade_rubric.score_benchmark(bench, None, OPEN, False)["status"] == grade_rubric.NO_GPU


@pytest.mark.parametrize("number", sorted(RUBRICS))
def test_the_reference_solution_graded_against_itself_scores_100(number):
    """Against itself, the reference's measurement is the graded one (grade.measure_speed)."""
    rubric = grade_rubric.load_rubric(RUBRICS[number])
    correctness = grade_rubric.score_correctness(_tests("passed", "passed"), rubric["correctness"]["points"])
    same = {"benchmarks": {b["name"]: _shapes(*[3.0] * len(b["shapes"])) for b in rubric["benchmarks"]}}
    speed = grade.speed_parts(rubric, {"reference": same, "graded": same}, correctness, gpu=True)
    scripts = grade_rubric.score_scripts([{"passed": True}], rubric.get("scripts", {}).get("points", 0))
    assert correctness["points"] + scripts["points"] + sum(p["points"] for p in speed) == 100


def test_the_reference_is_measured_once_when_it_grades_itself(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(grade, "run_worker", lambda root, benches, peers_, reps: calls.append((root, peers_)) or {})
    rubric = grade_rubric.load_rubric(RUBRICS[3])
    measured = grade.measure_speed(rubric, REPO_ROOT, REPO_ROOT)
    assert calls == [(REPO_ROOT, True)] and measured["graded"] is measured["reference"]
    calls.clear()
    grade.measure_speed(rubric, tmp_path, REPO_ROOT)
    assert calls == [(REPO_ROOT, True), (tmp_path, False)]  # peers once, in the reference copy


# ------------------------------------------------------------------------------------------------
# The official tests come from the reference copy (a fake phase, run for real with pytest)

FAKE_PHASE = '''
VALUES = (1, 2, 3)


def double(x):
    return 2 * x


def triple(x):
    return 3 * x
'''
FAKE_TESTS = textwrap.dedent('''
    import pytest

    import phase9_fake


    @pytest.mark.parametrize("x", phase9_fake.VALUES)
    def test_double(x):
        assert phase9_fake.double(x) == 2 * x


    def test_zero():
        assert phase9_fake.double(0) == 1, "zero doubled is not one"


    @pytest.mark.skipif(True, reason="no CUDA GPU visible")
    def test_needs_gpu():
        pass
''')


@pytest.fixture()
def copies(tmp_path):
    """A reference copy (the course's utils, a fake phase with its rubric and tests) and a student's
    copy of it."""
    reference, student = tmp_path.resolve() / "reference", tmp_path.resolve() / "student"
    for root in (reference, student):
        (root / "phase9_fake").mkdir(parents=True)
        (root / "utils").symlink_to(REPO_ROOT / "utils")
        (root / "pyproject.toml").write_text((REPO_ROOT / "pyproject.toml").read_text())
        (root / "phase9_fake" / "__init__.py").write_text(FAKE_PHASE)
        (root / "phase9_fake" / "test_fake.py").write_text(FAKE_TESTS)
    rubric = json.loads(RUBRICS[3].read_text())
    rubric.update(phase="phase9_fake", correctness={"points": 60, "tests": ["phase9_fake/test_fake.py"]})
    rubric["benchmarks"][0]["call"] = "phase9_fake:double"
    (reference / "phase9_fake" / "rubric.json").write_text(json.dumps(rubric))
    return reference, student


def _grade(reference, student, gpu=False, hidden=None):
    tree = grade_tests.assemble_tree(student, reference, grade_tests.tree_dir(reference, student))
    return grade.grade_phase(reference / "phase9_fake" / "rubric.json", tree, reference, gpu, hidden)


def _outcomes(section):
    return {t["id"].split("::")[-1]: (t["outcome"], t["scored"]) for t in section["tests"]}


def test_the_reference_copy_graded_as_it_is(copies):
    reference, _ = copies
    section = grade.grade_phase(reference / "phase9_fake" / "rubric.json", reference, reference, gpu=True)
    assert _outcomes(section) == {"test_double[1]": ("passed", True), "test_double[2]": ("passed", True),
                                  "test_double[3]": ("passed", True), "test_zero": ("failed", True),
                                  "test_needs_gpu": ("skipped", True)}
    assert "zero doubled is not one" in next(t["message"] for t in section["tests"] if t["outcome"] == "failed")
    assert section["points"] == pytest.approx(60 * 3 / 5)  # the gate is closed: no speed measured
    assert "did not pass" in section["benchmark_note"]


def test_official_only_runs_the_official_tests_alone(copies):
    """--official-only: the official tests run (the rubric's select applied to its files), not the
    lessons' other tests nor the official files' other tests, and the report says so; without it both
    run and are recorded, not scored."""
    reference, _ = copies
    rubric_path = reference / "phase9_fake" / "rubric.json"
    rubric = json.loads(rubric_path.read_text())
    rubric["correctness"]["select"] = "double"
    rubric_path.write_text(json.dumps(rubric))
    (reference / "phase9_fake" / "test_lesson.py").write_text("def test_lesson():\n    pass\n")
    lessons = ["phase9_fake/test_lesson.py"]
    doubles = {f"test_double[{x}]": ("passed", True) for x in (1, 2, 3)}
    full = grade.grade_phase(rubric_path, reference, reference, gpu=False, lesson_paths=lessons)
    assert _outcomes(full) == {**doubles, "test_zero": ("failed", False), "test_needs_gpu": (grade.NO_GPU, False),
                               "test_lesson": ("passed", False)}
    only = grade.grade_phase(rubric_path, reference, reference, gpu=False, lesson_paths=lessons, official_only=True)
    assert _outcomes(only) == doubles and only["correctness"] == full["correctness"]
    said = "Only the official tests ran"
    assert said in "\n".join(grade._phase_markdown(only)) and said not in "\n".join(grade._phase_markdown(full))


def test_deleting_or_editing_a_failing_test_changes_nothing(copies):
    reference, student = copies
    before = _grade(reference, student, gpu=True)
    (student / "phase9_fake" / "test_fake.py").unlink()
    deleted = _grade(reference, student, gpu=True)
    (student / "phase9_fake" / "test_fake.py").write_text("def test_zero():\n    pass\n")
    edited = _grade(reference, student, gpu=True)
    for section in (deleted, edited):
        assert _outcomes(section) == _outcomes(before) and section["points"] == before["points"]
        assert not section["correctness"]["gate"]


def test_a_test_the_graded_copy_does_not_collect_counts_as_failed(copies):
    reference, student = copies
    (student / "phase9_fake" / "__init__.py").write_text(FAKE_PHASE.replace("(1, 2, 3)", "(1,)"))
    section = _grade(reference, student, gpu=True)
    missing = [t for t in section["tests"] if t["message"].startswith("missing")]
    assert [t["id"].split("::")[-1] for t in missing] == ["test_double[2]", "test_double[3]"]
    assert all(t["outcome"] == "failed" and t["scored"] for t in missing)
    assert section["correctness"]["total"] == 5 and section["correctness"]["passed"] == 1


def test_a_module_that_fails_to_import_fails_every_official_test(copies):
    reference, student = copies
    (student / "phase9_fake" / "__init__.py").write_text("raise ImportError('not written yet')\n")
    section = _grade(reference, student, gpu=True)
    scored = [t for t in section["tests"] if t["scored"]]
    assert len(scored) == 5 and all(t["outcome"] == "failed" for t in scored)
    assert "not written yet" in scored[0]["message"] and section["points"] == 0


def test_the_students_conftest_rubric_and_tests_stay_out_of_the_tree(copies):
    reference, student = copies
    (student / "phase9_fake" / "conftest.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(item, call):
            outcome = yield
            outcome.get_result().outcome = "passed"
        """))
    (student / "phase9_fake" / "rubric.json").write_text("{}")
    tree = grade_tests.assemble_tree(student, reference, grade_tests.tree_dir(reference, student))
    assert not (tree / "phase9_fake" / "conftest.py").exists() and not (tree / "phase9_fake" / "rubric.json").exists()
    assert (tree / "phase9_fake" / "test_fake.py").read_text() == FAKE_TESTS
    assert (tree / "utils" / "grade_bench.py").read_text() == (REPO_ROOT / "utils" / "grade_bench.py").read_text()
    assert _grade(reference, student, gpu=True)["correctness"]["passed"] == 3


def test_the_tree_keeps_its_build_cache(copies):
    reference, student = copies
    tree = grade_tests.tree_dir(reference, student)
    (tree / "build").mkdir(parents=True)
    (tree / "build" / "cached.so").write_text("x")
    (tree / "stale.py").write_text("x")
    grade_tests.assemble_tree(student, reference, tree)
    assert (tree / "build" / "cached.so").exists() and not (tree / "stale.py").exists()


def test_hidden_tests_are_official_and_collected_in_the_reference(copies, tmp_path):
    reference, student = copies
    hidden = tmp_path / "hidden" / "phase9_fake"
    hidden.mkdir(parents=True)
    (hidden / "test_fake.py").write_text("from phase9_fake import double, triple\n\n"
                                         "def test_double_hidden():\n    assert double(4) == 8\n\n"
                                         "def test_triple_hidden():\n    assert triple(4) == 12\n")
    section = _grade(reference, student, gpu=True, hidden=tmp_path / "hidden")
    hidden_tests = [t for t in section["tests"] if t["source"] == "hidden"]
    assert [(t["outcome"], t["scored"]) for t in hidden_tests] == [("passed", True)] * 2
    assert section["correctness"]["total"] == 7
    # A copy that breaks the hidden module's import fails its tests instead of dropping them.
    (student / "phase9_fake" / "__init__.py").write_text(FAKE_PHASE.split("def triple")[0])
    section = _grade(reference, student, gpu=True, hidden=tmp_path / "hidden")
    hidden_tests = [t for t in section["tests"] if t["source"] == "hidden" and t["scored"]]
    assert [t["outcome"] for t in hidden_tests] == ["failed"] * 2 and section["correctness"]["total"] == 7


def test_hidden_test_folders_per_phase(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "test_a.py").write_text("")
    assert [p.name for p in grade_tests.hidden_test_files(flat, "phase3_tiled", single_phase=True)] == ["test_a.py"]
    assert grade_tests.hidden_test_files(flat, "phase3_tiled", single_phase=False) == []
    (tmp_path / "nested" / "phase3").mkdir(parents=True)
    (tmp_path / "nested" / "phase3" / "test_b.py").write_text("")
    (tmp_path / "nested" / "phase4_coalesced").mkdir()
    assert [p.name for p in grade_tests.hidden_test_files(tmp_path / "nested", "phase3_tiled", True)] == ["test_b.py"]
    assert grade_tests.hidden_test_files(tmp_path / "nested", "phase5_fused", True) == []


def test_record_ids_are_dotted_module_paths():
    assert grade_tests.record_id("phase5_fused/fp32/test_fused.py::test_scale[teaching]") == \
        "phase5_fused.fp32.test_fused::test_scale[teaching]"


# ------------------------------------------------------------------------------------------------
# Without a GPU: no score


def test_without_a_gpu_nothing_is_scored(copies, tmp_path, monkeypatch, capsys):
    reference, _ = copies
    monkeypatch.setattr(grade, "KEPT", tmp_path / "kept")
    monkeypatch.setattr(grade, "gpu_available", lambda: False)
    monkeypatch.setattr(grade, "rubrics", lambda: {9: reference / "phase9_fake" / "rubric.json"})
    monkeypatch.setattr(grade, "lesson_tests", lambda number: [])
    monkeypatch.setattr(grade, "REPO_ROOT", reference)
    assert grade.main(["--phase", "9", "--reference", str(reference), "--student", str(reference),
                       "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "phase9_fake: not graded: no GPU" in out and not SCORE.search(out)
    doc = json.loads((tmp_path / "out" / "phase9_fake.json").read_text())
    assert doc["points"] is None and doc["phases"][0]["points"] is None
    assert all(p["points"] is None for p in doc["phases"][0]["parts"])
    assert dict(_outcomes(doc["phases"][0]))["test_needs_gpu"][0] == grade_rubric.NO_GPU
    md = (tmp_path / "out" / "phase9_fake.md").read_text()
    assert md.startswith("# Grade: phase9_fake: not graded: no GPU") and not SCORE.search(md)


@pytest.fixture
def two_fake_phases(tmp_path, monkeypatch):
    """A course of two phases (8 and 9) whose grading is a stand-in: each graded phase is appended to
    `graded` and scores `points[0]`; `commit[0]` is the environment stamp's commit."""
    graded, commit, points = [], ["c1"], [50.0]

    def fake_grade_phase(path, *args, **kwargs):
        graded.append(path.parent.name)
        return {"phase": path.parent.name, "title": path.parent.name, "points": points[0], "max": 100,
                "correctness": {"passed": 1, "total": 1, "counts": {}}}

    monkeypatch.setattr("utils.results.env_stamp", lambda: {**ENV, "commit": commit[0]})
    monkeypatch.setattr(grade, "KEPT", tmp_path / "kept")
    monkeypatch.setattr(grade, "gpu_available", lambda: True)
    monkeypatch.setattr(grade, "rubrics", lambda: {8: tmp_path / "phase8_a" / "rubric.json",
                                                   9: tmp_path / "phase9_b" / "rubric.json"})
    monkeypatch.setattr(grade, "load_rubric", lambda path: {})
    monkeypatch.setattr(grade, "lesson_tests", lambda number: [])
    monkeypatch.setattr(grade, "grade_phase", fake_grade_phase)
    monkeypatch.setattr(grade, "render_markdown", lambda report: "")
    return graded, commit, points


def test_resume_reuses_only_the_phases_graded_in_the_same_setting(tmp_path, two_fake_phases):
    """--resume takes a phase's kept section only when the GPU, commit, copies and hidden tests are
    those of the run that kept it; without --resume every phase is graded again."""
    graded, commit, _ = two_fake_phases

    def run(*extra):
        graded.clear()
        assert grade.main(["--all", "--out", str(tmp_path / "out"), *extra]) == 0
        return list(graded), json.loads((tmp_path / "out" / "all.json").read_text())

    assert run()[0] == ["phase8_a", "phase9_b"]
    (grade.KEPT / "phase9_b.json").unlink()             # as if the run had stopped during phase 9
    done, report = run("--resume")
    assert done == ["phase9_b"] and [s["phase"] for s in report["phases"]] == ["phase8_a", "phase9_b"]
    assert report["points"] == 100.0
    assert run("--resume")[0] == []                     # both kept
    assert run()[0] == ["phase8_a", "phase9_b"]         # no --resume: graded again
    commit[0] = "c2"                                    # another commit: nothing kept applies
    assert run("--resume")[0] == ["phase8_a", "phase9_b"]


def test_into_puts_one_phase_anew_into_the_record_each_section_with_its_stamp(tmp_path, two_fake_phases,
                                                                              monkeypatch):
    """--into: the phase graded replaces its section of an all-phase report (the others kept, in
    order), each section carries the stamp of the run that graded it, the totals are summed anew;
    refused without a GPU, with hidden tests or another reference, or into a report that does not exist."""
    graded, commit, points = two_fake_phases
    record = tmp_path / "record" / "all.json"
    assert grade.main(["--all", "--out", str(record.parent)]) == 0
    commit[0], points[0] = "c2", 80.0
    assert grade.main(["--phase", "9", "--into", str(record)]) == 0
    report = json.loads(record.read_text())
    assert graded[-1:] == ["phase9_b"] and [s["phase"] for s in report["phases"]] == ["phase8_a", "phase9_b"]
    assert [s["env"]["commit"] for s in report["phases"]] == ["c1", "c2"] and report["env"]["commit"] == "c2"
    assert report["points"] == 130.0 and report["max"] == 200
    assert (record.parent / "all.md").exists()
    section = {"title": "T", "points": 80.0, "max": 100, "rubric": "r", "scored": "s", "parts": [], "tests": [],
               "scripts": [], "benchmark_note": "", "measured": None, "speed": []}
    assert "Graded on none, torch x" in "\n".join(grade._phase_markdown(report["phases"][1] | section))
    assert "Graded on" not in "\n".join(grade._phase_markdown(section))
    for argv in (["--into", str(tmp_path / "none.json")], ["--into", str(record), "--hidden-tests", str(tmp_path)],
                 ["--into", str(record), "--reference", str(tmp_path)]):
        assert grade.main(["--phase", "9", *argv]) == 2
    monkeypatch.setattr(grade, "gpu_available", lambda: False)
    assert grade.main(["--phase", "9", "--into", str(record)]) == 2


def test_into_an_official_only_section_keeps_the_other_tests_with_their_stamps(tmp_path):
    """--official-only --into: the replaced section's not-scored tests stay in the record (those the
    new run did not run), each stamped with the run that ran it; the official ones are the new run's."""
    old_env, new_env = {"commit": "c1"}, {"commit": "c2"}
    def test(name, scored, outcome="passed"):
        return {"id": f"p.t::{name}", "scored": scored, "outcome": outcome}
    old = {"phase": "p", "points": 90.0, "max": 100,
           "tests": [test("official", True, "failed"), test("lesson", False), test("now_official", False)]}
    record = tmp_path / "all.json"
    record.write_text(json.dumps({"env": old_env, "phases": [old]}))
    new = {"phase": "p", "points": 100.0, "max": 100, "official_only": True,
           "tests": [test("official", True), test("now_official", True)]}
    merged = grade.merge_into(record, [new], new_env)["phases"][0]
    assert merged["env"] == new_env and merged["tests"] == [*new["tests"], {**test("lesson", False), "env": old_env}]
    full = grade.merge_into(record, [dict(new, official_only=False)], new_env)["phases"][0]
    assert full["tests"] == new["tests"]  # a run of every test replaces them all
    said = "\n".join(grade._phase_markdown({**merged, "title": "T", "rubric": "r", "scored": "s", "parts": [],
                                             "scripts": [], "benchmark_note": "", "measured": None, "speed": []}))
    assert "kept from the record's earlier run" in said


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message needs a machine without a GPU")
def test_command_line_of_a_course_phase_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "utils.grade", "--phase", "2", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "phase2_naive: not graded: no GPU" in proc.stdout and not SCORE.search(proc.stdout)


def test_another_reference_hands_over_to_its_own_grader(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(grade.subprocess, "call", lambda cmd, cwd, env: calls.append((cmd, cwd)) or 0)
    assert grade.main(["--phase", "3", "--reference", str(tmp_path), "--out", "out"]) == 0
    (cmd, cwd), = calls
    assert cwd == tmp_path and cmd[cmd.index("--student") + 1] == str(REPO_ROOT)
    assert cmd[cmd.index("--phase") + 1] == "3" and Path(cmd[cmd.index("--out") + 1]).is_absolute()


# ------------------------------------------------------------------------------------------------
# The timing worker's checks, on the CPU with stand-ins for CUDA


def _cpu_attention(B=1, H=2, S=16, D=8):
    shape = {"B": B, "H": H, "S": S, "D": D, "causal": False}
    sets = [grade_bench.ATTENTION.inputs(shape, torch.float32, "cpu") for _ in range(grade_bench.INPUT_SETS)]
    return shape, sets


def _measure(fn, shape, sets):
    def check(out, inputs):
        return grade_bench.rel_error(out, grade_bench.ATTENTION.reference(inputs, shape))

    return grade_bench.measure(lambda inputs: grade_bench.ATTENTION.call(fn, inputs, shape, {}), sets,
                               grade_bench.refresh, check, lambda run: (run(), 1.0), reps=10, rng=random.Random(0))


def test_timed_calls_get_fresh_inputs_and_a_cached_result_fails():
    shape, sets = _cpu_attention()
    ms, err, checked = _measure(peers.torch_naive, shape, sets)
    assert ms == 1.0 and err < 1e-6 and checked == grade_bench.SPOT_CHECKS
    first = {}

    def cached(q, k, v, is_causal=False):  # computes once, then returns what it computed
        return first.setdefault("out", peers.torch_naive(q, k, v, is_causal=is_causal))

    by_buffer = {}

    def cached_per_buffer(q, k, v, is_causal=False):  # one result per input buffer
        return by_buffer.setdefault(q.data_ptr(), peers.torch_naive(q, k, v, is_causal=is_causal))

    for cheat in (cached, cached_per_buffer):
        assert _measure(cheat, shape, sets)[1] > 1e-2, cheat.__name__


def test_the_kernel_check_refuses_work_done_by_library_kernels():
    regex = grade_rubric.load_rubric(RUBRICS[2])["benchmarks"][0]["kernels"]
    own = {"void naive_qk_kernel(float const*)": 40.0, "void naive_softmax_kernel(float const*)": 20.0,
           "void naive_av_kernel(float const*)": 40.0}
    assert grade_bench.own_share(own, regex) == 1.0
    assert grade_bench.own_share({**own, LIBRARY_KERNELS[0]: 5.0}, regex) == pytest.approx(100 / 105)
    sdpa = {LIBRARY_KERNELS[3]: 100.0, "void naive_qk_kernel(float const*)": 1.0}
    assert grade_bench.own_share(sdpa, regex) < grade_bench.KERNEL_SHARE
    assert grade_bench.own_share({}, regex) == 0.0  # a stored result runs no kernel


def test_an_api_that_calls_a_library_is_not_timed(monkeypatch):
    """run_benchmark on the CPU: a fake profile shows what the call launched."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    launched = {}
    monkeypatch.setattr(grade_bench, "kernel_times", lambda run: (run(), launched))
    bench = {**grade_rubric.load_rubric(RUBRICS[2])["benchmarks"][0], "call": "utils.peers:torch_naive",
             "shapes": [{"B": 1, "H": 2, "S": 16, "D": 8, "causal": True}]}
    launched.update({LIBRARY_KERNELS[0]: 90.0, "void naive_softmax_kernel(float const*)": 10.0})
    (shape,) = grade_bench.run_benchmark(bench, False, 5, timer=lambda run: (run(), 2.0), device="cpu")
    entry = shape["impls"]["impl"]
    assert entry["ms"] is None and "10%" in entry["error"] and "ampere_sgemm" in entry["error"]
    launched.clear()
    launched.update({"void naive_qk_kernel(float const*)": 1.0})
    (shape,) = grade_bench.run_benchmark(bench, True, 5, timer=lambda run: (run(), 2.0), device="cpu")
    assert shape["impls"]["impl"]["ms"] == 2.0 and shape["impls"]["impl"]["own_share"] == 1.0
    assert shape["impls"]["torch_naive"]["ms"] == 2.0  # peers are timed, not kernel-checked
    assert "sdpa_efficient" in shape["impls"] and shape["label"] == "B=1 H=2 S=16 D=8 causal float32"


def test_worker_command_line_writes_every_shape(monkeypatch, tmp_path):
    """main() on the CPU (stand-ins for the device, the timer and the profile): the JSON the grader reads."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(grade_bench, "kernel_times", lambda run: (run(), {"void naive_av_kernel(float const*)": 1.0}))
    on_cpu = grade_bench.run_benchmark
    monkeypatch.setattr(grade_bench, "run_benchmark", lambda *a, **kw: on_cpu(
        *a, **kw, device="cpu", timer=lambda run: (run(), 3.0)))
    bench = {**grade_rubric.load_rubric(RUBRICS[2])["benchmarks"][0], "call": "utils.peers:torch_naive",
             "shapes": [{"B": 1, "H": 1, "S": 8, "D": 4}, {"B": 1, "H": 1, "S": 9, "D": 4}]}
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"benchmarks": [bench], "peers": False, "reps": 5}))
    assert grade_bench.main([str(spec), str(out)]) == 0
    shapes = json.loads(out.read_text())["benchmarks"][bench["name"]]
    assert [s["label"] for s in shapes] == ["B=1 H=1 S=8 D=4 float32", "B=1 H=1 S=9 D=4 float32"]
    assert all(s["impls"]["impl"]["ms"] == 3.0 and s["impls"]["impl"]["checked"] == 3 for s in shapes)


# ------------------------------------------------------------------------------------------------
# On a GPU: the worker in its own process


@requires_gpu
def test_worker_times_phase2_and_sees_its_kernels():
    bench = {**grade_rubric.load_rubric(RUBRICS[2])["benchmarks"][0],
             "shapes": [{"B": 1, "H": 2, "S": 256, "D": 64, "causal": False}]}
    result = grade.run_worker(REPO_ROOT, [bench], True, 5)
    assert result["failure"] is None
    (shape,) = result["benchmarks"][bench["name"]]
    entry = shape["impls"]["impl"]
    assert entry["ms"] > 0 and entry["own_share"] >= grade_bench.KERNEL_SHARE and entry["rel_err"] < 2e-5
    assert any("naive_qk_kernel" in name for name in entry["kernels"])


@requires_gpu
def test_worker_refuses_an_api_that_calls_sdpa():
    bench = {**grade_rubric.load_rubric(RUBRICS[2])["benchmarks"][0], "call": "utils.peers:torch_naive",
             "shapes": [{"B": 1, "H": 2, "S": 256, "D": 64, "causal": False}]}
    (shape,) = grade_bench.run_benchmark(bench, False, 5)
    assert shape["impls"]["impl"]["ms"] is None and "below" in shape["impls"]["impl"]["error"]
