"""The grader (utils.grade) on the CPU: rubrics, JUnit parsing, scoring, reports, the no-GPU path."""

from __future__ import annotations

import json
import textwrap

import pytest

from utils import grade

PHASE_FOLDERS = [grade.REPO_ROOT / name for name in grade.PHASES.values()]
ENV = {"gpu": "none", "sms": 0, "torch": "x", "cuda": "none", "driver": "none", "date": "d", "commit": "c"}


# ------------------------------------------------------------------------------------------------
# Rubrics


@pytest.mark.parametrize("folder", PHASE_FOLDERS, ids=lambda p: p.name)
def test_every_phase_rubric_loads_and_totals_100(folder):
    rubric = grade.load_rubric(folder)
    assert rubric["phase"] == folder.name
    assert grade.rubric_max_points(rubric) == 100
    for bench in rubric["benchmarks"]:
        for part in bench["parts"]:
            assert part.get("source"), f"{part['name']}: say where the thresholds come from"


def test_previous_phase_parts_compare_with_an_earlier_phase():
    order = list(grade.PHASES.values())
    for n, folder in enumerate(PHASE_FOLDERS):
        rubric = grade.load_rubric(folder)
        for bench in rubric["benchmarks"]:
            assert bench["impl"].split("_")[0] == folder.name.split("_")[0], bench["impl"]  # its own kernel
            for part in bench["parts"]:
                if part["kind"] == "previous":
                    earlier = order[n - 1]
                    # phase 2's previous phase is phase 1, whose attention is PyTorch's (torch_naive)
                    assert part["against"].split("_")[0] == earlier.split("_")[0] or (
                        n == 1 and part["against"] == "torch_naive")


def test_issue_thresholds_are_in_the_rubrics():
    def part(phase, against):
        rubric = grade.load_rubric(grade.REPO_ROOT / phase)
        return next(p for b in rubric["benchmarks"] for p in b["parts"] if against in (p.get("against"), p.get("ceiling")))

    assert (part("phase3_tiled", "phase2_naive")["good"], part("phase3_tiled", "phase2_naive")["excellent"]) == (1.5, 2.0)
    assert part("phase4_coalesced", "phase3_tiled_t16")["excellent"] == 1.3
    assert part("phase5_fused", "phase4_coalesced")["excellent"] == 1.0
    assert part("phase6_layernorm_mlp", "dram_TBps")["excellent"] == 0.9
    assert grade.load_rubric(grade.REPO_ROOT / "phase1_baseline")["benchmarks"] == []


def test_bad_rubrics_are_reported():
    rubric = json.loads((grade.REPO_ROOT / "phase3_tiled" / "rubric.json").read_text())
    part = rubric["benchmarks"][0]["parts"][0]
    part["good"], part["excellent"] = 3.0, 2.0
    part["against"] = "phase9_magic"
    rubric["benchmarks"][0]["shapes"].append({"B": 1, "H": 1, "S": 0})
    rubric["benchmarks"][0]["flush"] = "sideways"
    problems = " ".join(grade.validate_rubric(rubric, "phase4_coalesced"))
    for words in ("thresholds must rise", "phase9_magic", "lacks positive integers", "the folder is", "sideways"):
        assert words in problems


# ------------------------------------------------------------------------------------------------
# JUnit parsing

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="3" tests="6">
 <testcase classname="phase3_tiled.test_tiled" name="test_ok" time="0.01"/>
 <testcase classname="phase3_tiled.test_tiled" name="test_wrong[S17]" time="0.2">
  <failure message="AssertionError: output: rel error 1.2e-01 (tol 2.0e-05)">traceback line 1
phase3_tiled/test_tiled.py:60: AssertionError</failure></testcase>
 <testcase classname="phase3_tiled.test_tiled" name="test_broken" time="0.0">
  <error message="failed on setup with &quot;NotImplementedError: TODO (tiled_qk.cu)&quot;">NotImplementedError</error></testcase>
 <testcase classname="phase3_tiled.test_tiled" name="test_gpu" time="0.0">
  <skipped type="pytest.skip" message="no CUDA GPU visible">phase3_tiled/test_tiled.py:54: no CUDA GPU visible</skipped></testcase>
 <testcase classname="phase3_tiled.test_tiled" name="test_big" time="0.0">
  <skipped type="pytest.skip" message="needs 12 GiB of free GPU memory">x</skipped></testcase>
 <testcase classname="phase3_tiled.test_tiled" name="test_known" time="0.0">
  <skipped type="pytest.xfail" message="known limitation"/></testcase>
</testsuite></testsuites>"""


def test_junit_outcomes_and_messages_without_gpu():
    tests = {t["id"].split("::")[1]: t for t in grade.parse_junit(JUNIT, gpu=False, source="phase")}
    assert tests["test_ok"]["outcome"] == "passed"
    assert tests["test_wrong[S17]"]["outcome"] == "failed"
    assert "rel error 1.2e-01" in tests["test_wrong[S17]"]["message"]
    assert tests["test_broken"]["outcome"] == "error"
    assert "NotImplementedError: TODO" in tests["test_broken"]["message"]
    assert tests["test_gpu"]["outcome"] == grade.NO_GPU
    assert tests["test_big"]["outcome"] == grade.NO_GPU  # names the GPU: not graded here
    assert tests["test_known"]["outcome"] == "xfailed"
    assert tests["test_ok"]["id"] == "phase3_tiled.test_tiled::test_ok"


def test_junit_skips_on_a_gpu_machine_stay_skips():
    tests = {t["id"].split("::")[1]: t for t in grade.parse_junit(JUNIT, gpu=True)}
    assert tests["test_gpu"]["outcome"] == "skipped"
    assert tests["test_big"]["message"] == "needs 12 GiB of free GPU memory"


# ------------------------------------------------------------------------------------------------
# Scoring


def _tests(*outcomes):
    return [{"id": f"t{n}", "source": "phase", "outcome": o, "message": "", "seconds": 0.0}
            for n, o in enumerate(outcomes)]


def test_correctness_points_and_gate():
    ok = grade.score_correctness(_tests("passed", "passed", "skipped", "passed"), 60)
    assert ok["points"] == pytest.approx(45) and ok["gate"]  # a skip earns nothing but does not close it
    failed = grade.score_correctness(_tests("passed", "failed", "passed", "passed"), 60)
    assert failed["points"] == pytest.approx(45) and not failed["gate"] and "failed" in failed["gate_reason"]
    no_gpu = grade.score_correctness(_tests("passed", grade.NO_GPU, grade.NO_GPU, grade.NO_GPU), 60)
    assert no_gpu["points"] == pytest.approx(15) and not no_gpu["gate"]
    assert not grade.score_correctness([], 60)["gate"]


def test_levels_at_their_edges():
    part = {"minimum": 1.2, "good": 1.5, "excellent": 2.0}
    assert grade.level_for(1.19, part) is None
    assert grade.level_for(1.2, part) == "minimum"
    assert grade.level_for(1.99, part) == "good"
    assert grade.level_for(2.0, part) == "excellent"
    assert grade.level_for(None, part) is None and grade.level_for(float("nan"), part) is None
    assert grade.aggregate([2.0, 8.0], "geomean") == pytest.approx(4.0)
    assert grade.aggregate([2.0, 8.0], "min") == 2.0
    assert grade.aggregate([2.0, float("inf")]) is None


PHASE3 = grade.load_rubric(grade.REPO_ROOT / "phase3_tiled")
OPEN = {"gate": True, "gate_reason": "every test that ran passed"}


def _measured(ms_by_shape):
    """phase 3's benchmark measured: one {impl: ms} per rubric shape."""
    return {"attention FP32": [{"label": f"shape{n}", "bytes": 1.0, "impls": {k: {"ms": v} for k, v in ms.items()}}
                               for n, ms in enumerate(ms_by_shape)]}


def test_speed_points_by_level_and_minimum_over_shapes():
    measured = _measured([{"phase3_tiled_t16": 1.0, "phase2_naive": 8.0, "torch_naive": 0.25},
                          {"phase3_tiled_t16": 4.0, "phase2_naive": 7.0, "torch_naive": 0.5}])
    parts = {p["against"]: p for p in grade.score_benchmarks(PHASE3, measured, OPEN, gpu=True)}
    prev = parts["phase2_naive"]
    assert prev["values"] == [8.0, 1.75] and prev["value"] == 1.75 and prev["level"] == "good"
    assert prev["points"] == pytest.approx(30 * grade.LEVEL_FRACTION["good"])
    peer = parts["torch_naive"]
    assert peer["value"] == pytest.approx(0.125) and peer["level"] == "minimum"
    assert peer["points"] == pytest.approx(10 * grade.LEVEL_FRACTION["minimum"])


def test_no_speed_points_for_a_wrong_kernel_or_without_gpu():
    measured = _measured([{"phase3_tiled_t16": 1.0, "phase2_naive": 9.0, "torch_naive": 0.5}] * 2)
    closed = {"gate": False, "gate_reason": "1 correctness test(s) failed"}
    for p in grade.score_benchmarks(PHASE3, measured, closed, gpu=True):
        assert p["points"] == 0 and "correctness test(s) failed" in p["status"]
    for p in grade.score_benchmarks(PHASE3, None, OPEN, gpu=False):
        assert p["points"] == 0 and p["status"] == grade.NO_GPU


def test_a_kernel_that_failed_on_the_benchmark_earns_nothing():
    measured = _measured([{"phase3_tiled_t16": None, "phase2_naive": 8.0, "torch_naive": 0.5}] * 2)
    measured["attention FP32"][0]["impls"]["phase3_tiled_t16"]["error"] = "wrong result on the benchmark shape"
    for p in grade.score_benchmarks(PHASE3, measured, OPEN, gpu=True):
        assert p["points"] == 0 and "wrong result" in p["status"]


def test_ceiling_fraction():
    rubric = grade.load_rubric(grade.REPO_ROOT / "phase6_layernorm_mlp")
    bench = rubric["benchmarks"][0]
    part = next(p for p in bench["parts"] if p["metric"] == "ceiling_fraction")
    # 4e9 bytes in 1 ms = 4 TB/s against a 5 TB/s ceiling
    shapes = [{"label": "s", "bytes": 4e9, "impls": {bench["impl"]: {"ms": 1.0}}}]
    values, why = grade.part_values(bench, part, shapes, {"dram_TBps": 5.0})
    assert why is None and values == [pytest.approx(0.8)]


# ------------------------------------------------------------------------------------------------
# Reports and the no-GPU path (a fake phase folder, so that it stays fast)


@pytest.fixture()
def fake_phase(tmp_path):
    folder = tmp_path / "phase9_fake"
    folder.mkdir()
    rubric = json.loads((grade.REPO_ROOT / "phase3_tiled" / "rubric.json").read_text())
    rubric["phase"] = "phase9_fake"
    (folder / "rubric.json").write_text(json.dumps(rubric))
    (folder / "test_fake.py").write_text(textwrap.dedent("""
        import pytest

        def test_passes():
            assert 1 + 1 == 2

        def test_fails():
            assert 1 == 2, "one is not two"

        @pytest.mark.skipif(True, reason="no CUDA GPU visible")
        def test_needs_gpu():
            pass
        """))
    hidden = tmp_path / "hidden" / "phase9_fake"
    hidden.mkdir(parents=True)
    # Hidden tests import the course's packages from the repository root (as the phase's tests do),
    # and may share a file name with the phase's tests.
    (hidden / "test_fake.py").write_text(textwrap.dedent("""
        from utils.testing import rel_error
        import torch

        def test_hidden_sees_the_course():
            assert rel_error(torch.ones(3), torch.ones(3)) == 0.0
        """))
    return folder, tmp_path / "hidden"


def test_grade_a_phase_without_gpu_and_write_the_report(fake_phase, tmp_path, capsys):
    folder, hidden = fake_phase
    section = grade.grade_phase(folder, gpu=False, hidden_dir=hidden, single_phase=False)
    outcomes = {t["id"].split("::")[-1]: (t["outcome"], t["source"]) for t in section["tests"]}
    assert outcomes == {"test_passes": ("passed", "phase"), "test_fails": ("failed", "phase"),
                        "test_needs_gpu": (grade.NO_GPU, "phase"),
                        "test_hidden_sees_the_course": ("passed", "hidden")}
    failed = next(t for t in section["tests"] if t["outcome"] == "failed")
    assert "one is not two" in failed["message"]
    assert section["points"] == pytest.approx(60 * 2 / 4)  # 2 of 4 tests pass; no speed without a GPU
    assert section["max"] == 100
    assert all(p["status"] == grade.NO_GPU for p in section["speed"])

    report = grade.build_report([section], gpu=False, env=ENV)
    json_path, md_path = grade.write_report(report, tmp_path / "out", "phase9_fake")
    doc = json.loads(json_path.read_text())
    assert doc["env"] == ENV and doc["points"] == pytest.approx(30) and doc["no_gpu"] == grade.NO_GPU_LINE
    md = md_path.read_text()
    assert md.startswith("# Grade: phase9_fake — 30.0 / 100 points")
    assert grade.NO_GPU_LINE in md and "one is not two" in md and "**failed**" in md
    assert "1 test(s) not graded: no GPU" in md and "test_hidden_sees_the_course" in md


def test_command_line_without_gpu_says_so_once(fake_phase, tmp_path, monkeypatch, capsys):
    folder, _ = fake_phase
    monkeypatch.setattr(grade, "gpu_available", lambda: False)
    assert grade.main(["--phase", str(folder), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.count("No CUDA GPU visible") == 1
    assert (tmp_path / "out" / "phase9_fake.md").exists() and (tmp_path / "out" / "phase9_fake.json").exists()


def test_hidden_test_folders_per_phase(tmp_path):
    folder = grade.REPO_ROOT / "phase3_tiled"
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "test_a.py").write_text("")
    assert [p.name for p in grade.hidden_test_files(flat, folder, single_phase=True)] == ["test_a.py"]
    assert grade.hidden_test_files(flat, folder, single_phase=False) == []
    (tmp_path / "nested" / "phase3").mkdir(parents=True)
    (tmp_path / "nested" / "phase3" / "test_b.py").write_text("")
    (tmp_path / "nested" / "phase4_coalesced").mkdir()
    assert [p.name for p in grade.hidden_test_files(tmp_path / "nested", folder, True)] == ["test_b.py"]
    assert grade.hidden_test_files(tmp_path / "nested", grade.REPO_ROOT / "phase5_fused", True) == []


def test_benchmark_path_with_cpu_stand_ins(monkeypatch):
    """run_benchmark's checks and bookkeeping, with CPU stand-ins for CUDA (tensors, sync, timer)
    and for the phase kernels: a wrong kernel is caught before it is timed."""
    import torch

    from utils import bench, peers, testing

    randn, random_qkv = testing.randn, testing.random_qkv
    monkeypatch.setattr(testing, "randn", lambda *s, **kw: randn(*s, **{**kw, "device": "cpu"}))
    monkeypatch.setattr(testing, "random_qkv", lambda *a, **kw: random_qkv(*a, **{**kw, "device": "cpu"}))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "time_cuda", lambda fn, **kw: 2.0 if fn() is not None else None)
    wrong = lambda q, k, v, is_causal=False: peers.torch_naive(q, k, v, is_causal=is_causal) + 1  # noqa: E731
    monkeypatch.setattr(grade, "_attention_impl",
                        lambda name: wrong if name == "phase2_naive" else peers.torch_naive)
    spec = {"name": "attention FP32", "op": "attention", "dtype": "float32", "impl": "phase3_tiled_t16",
            "shapes": [{"B": 1, "H": 2, "S": 33, "D": 16, "causal": True}],
            "parts": PHASE3["benchmarks"][0]["parts"]}
    (shape,) = grade.run_benchmark(spec)
    assert shape["label"] == "B=1 H=2 S=33 D=16 causal float32" and shape["bytes"] > 0 and shape["flops"] > 0
    assert shape["impls"]["phase3_tiled_t16"]["ms"] == 2.0 and shape["impls"]["torch_naive"]["ms"] == 2.0
    assert shape["impls"]["phase2_naive"]["ms"] is None
    assert "wrong result" in shape["impls"]["phase2_naive"]["error"]
