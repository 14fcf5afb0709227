"""The test and sanitizer checklist lines, generated from the GPU-run records (CPU only)."""

from utils import gpu_checks

ENV = {"gpu": "GPU X", "commit": "abc1234", "date": "2026-01-02T03:04:05+00:00"}


def _grade(*outcomes, gpu=True):
    tests = [{"id": f"phase9_demo.test_a::test_{n}", "outcome": o} for n, o in enumerate(outcomes)]
    tests.append({"id": "phase8_other.test_b::test_x", "outcome": "failed"})  # another phase: ignored
    return {"env": ENV, "gpu_available": gpu, "no_gpu": not gpu, "phases": [{"tests": tests}]}


def test_tests_line_ticks_only_when_every_test_of_the_prefix_passed():
    assert gpu_checks.tests_line("pytest phase9_demo", "phase9_demo.", _grade("passed", "passed")).startswith(
        "- [x] `pytest phase9_demo` passes on the GPU: 2 of 2 tests passed (GPU X, commit abc1234, 2026-01-02")
    assert gpu_checks.tests_line("t", "phase9_demo.", _grade("passed", "skipped")).startswith("- [ ] `t` passes "
                                                                                             "on the GPU: 1 of 2")
    assert "no GPU run" in gpu_checks.tests_line("t", "phase9_demo.", _grade("passed", gpu=False))
    assert "no GPU run" in gpu_checks.tests_line("t", "phase9_demo.", None)


def test_sanitize_line_needs_both_tools_clean_on_every_module():
    runs = [{"module": "m", "tool": "memcheck", "clean": True}, {"module": "m", "tool": "racecheck", "clean": True}]
    assert gpu_checks.sanitize_line(("m",), {"env": ENV, "runs": runs}).startswith("- [x] ")
    assert gpu_checks.sanitize_line(("m",), {"env": ENV, "runs": runs[:1]}).startswith("- [ ] ")
    dirty = [dict(runs[0], clean=False), runs[1]]
    assert "1 of 2 runs clean" in gpu_checks.sanitize_line(("m",), {"env": ENV, "runs": dirty})
    assert "no sanitizer run" in gpu_checks.sanitize_line(("m",), None)


def test_every_listed_readme_has_the_markers():
    for readme in gpu_checks.READMES:
        text = (gpu_checks.REPO_ROOT / readme).read_text()
        assert (gpu_checks.BEGIN in text) or ("passes on the GPU" in text), readme


def test_sanitize_record_replaces_only_the_modules_run(tmp_path, monkeypatch):
    import json

    import torch

    from utils import results, sanitize

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(results, "env_stamp", lambda: ENV)
    path = tmp_path / "sanitize.json"
    old_env = dict(ENV, commit="old0000")
    old = [{"module": m, "tool": t, "clean": m == "a"} for m in ("a", "b") for t in sanitize.TOOLS]
    path.write_text(json.dumps({"env": old_env, "runs": old}))
    sanitize.record([{"module": "b", "tool": t, "clean": True} for t in sanitize.TOOLS], path)
    doc = json.loads(path.read_text())
    assert [(r["module"], r["clean"], r["env"]["commit"]) for r in doc["runs"]] == \
        [("a", True, "old0000")] * 2 + [("b", True, "abc1234")] * 2
    assert "commit abc1234" in gpu_checks.sanitize_line(("b",), doc)
    assert "commit old0000" in gpu_checks.sanitize_line(("a",), doc)


def test_results_lines_say_where_the_results_come_from_and_the_target(tmp_path):
    path = gpu_checks.REPO_ROOT / "phase9_demo" / "results" / "metrics.json"
    h100 = dict(ENV, gpu="NVIDIA H100 80GB HBM3")
    lines = gpu_checks.results_lines(path, {"env": h100, "target": {"rule": "2x phase 8", "met": False}})
    assert lines[0].startswith("- [x] `phase9_demo/results/metrics.json` and its plots from one run on the H100: "
                               "measured on NVIDIA H100 80GB HBM3, commit abc1234")
    assert lines[1] == "- [ ] target: 2x phase 8 — not met in that run."
    assert gpu_checks.results_lines(path, {"env": ENV})[0].startswith("- [ ] ")
    assert "no results committed" in gpu_checks.results_lines(path, None)[0]
