"""The `checks` table, drawn from the GPU-run records of the grader and the sanitizer (CPU only)."""

import json

import torch

from utils import gpu_checks, render, results, sanitize
from utils.manifest import lessons, load_manifest, manifests

ENV = {"gpu": "GPU X", "commit": "abc1234", "date": "2026-01-02T03:04:05+00:00"}


def _grade(*outcomes, gpu=True):
    tests = [{"id": f"phase9_demo.test_a::test_{n}", "outcome": o} for n, o in enumerate(outcomes)]
    tests.append({"id": "phase9_demo.test_b.TestK::test_k", "outcome": "passed"})   # a class's test
    tests.append({"id": "phase9_demo_other.test_c::test_x", "outcome": "failed"})  # another lesson
    return {"env": ENV, "gpu_available": gpu, "no_gpu": not gpu, "phases": [{"tests": tests}]}


def _row(path, record):
    """The one row of a path whose tests come from one run."""
    (line,) = gpu_checks.tests_rows(path, record)
    return line


def _sanitized(*runs):
    return {"env": ENV, "runs": [{"module": m, "tool": t, "clean": c} for m, t, c in runs]}


def test_tests_row_counts_the_tests_under_the_path_in_a_gpu_run():
    assert _row("phase9_demo", _grade("passed", "passed")) == \
        "| pytest phase9_demo | 3 of 3 passed | GPU X | abc1234 | 2026-01-02 |"
    assert "| 1 of 2 passed, 1 skipped |" in _row("phase9_demo/test_a.py", _grade("passed", "skipped"))
    assert "| 2 of 3 passed, 1 failed |" in _row("phase9_demo/", _grade("passed", "failed"))
    assert _row("phase9_demo", _grade("passed", gpu=False)) == \
        "| pytest phase9_demo | not recorded on a GPU yet | – | – | – |"
    assert "not recorded on a GPU yet" in _row("phase9_demo", None)
    assert "not recorded on a GPU yet" in _row("phase9_unrecorded", _grade("passed"))


def test_tests_row_takes_the_stamp_of_the_section_that_holds_the_tests():
    """A section put into the record by a later run (utils.grade --into) has its own stamp."""
    record = _grade("passed")
    later = {"gpu": "GPU Y", "commit": "def5678", "date": "2026-02-03T00:00:00+00:00"}
    record["phases"].insert(0, {"env": later, "tests": [{"id": "phase8_x.test_y::test_z", "outcome": "passed"}]})
    assert _row("phase8_x", record).endswith("| GPU Y | def5678 | 2026-02-03 |")
    assert _row("phase9_demo", record).endswith("| GPU X | abc1234 | 2026-01-02 |")


def test_tests_rows_give_one_row_per_run_latest_first():
    """Tests kept from an earlier run (an --official-only regrade) carry their own stamp: a path whose
    tests come from two runs gets a row for each."""
    record = _grade("passed", "failed")
    later = {"gpu": "GPU Y", "commit": "def5678", "date": "2026-02-03T00:00:00+00:00"}
    record["phases"][0]["env"] = later
    for t in record["phases"][0]["tests"][1:]:
        t["env"] = ENV
    assert gpu_checks.tests_rows("phase9_demo", record) == [
        "| pytest phase9_demo | 1 of 1 passed | GPU Y | def5678 | 2026-02-03 |",
        "| pytest phase9_demo | 1 of 2 passed, 1 failed | GPU X | abc1234 | 2026-01-02 |"]


def test_sanitize_row_gives_each_tools_verdict():
    clean = _sanitized(("m", "memcheck", True), ("m", "racecheck", True), ("n", "memcheck", False))
    assert gpu_checks.sanitize_row("m", clean) == \
        "| compute-sanitizer m | memcheck clean, racecheck clean | GPU X | abc1234 | 2026-01-02 |"
    assert "| memcheck errors, racecheck not run |" in gpu_checks.sanitize_row("n", clean)
    assert "| not recorded on a GPU yet | – |" in gpu_checks.sanitize_row("o", clean)
    assert "not recorded on a GPU yet" in gpu_checks.sanitize_row("m", None)


def test_sanitize_record_replaces_only_the_modules_run(tmp_path, monkeypatch):
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
    assert "| abc1234 |" in gpu_checks.sanitize_row("b", doc)
    assert "| old0000 |" in gpu_checks.sanitize_row("a", doc)


def test_the_renderer_fills_the_checks_table_from_the_manifest(tmp_path, monkeypatch):
    records = {gpu_checks.GRADE_RECORD: _grade("passed"), gpu_checks.SANITIZE_RECORD: _sanitized(
        ("phase9_demo.sanitize_cases", "memcheck", True), ("phase9_demo.sanitize_cases", "racecheck", True))}
    monkeypatch.setattr(gpu_checks, "load_record", records.get)
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"name": "phase9_demo", "tests": ["phase9_demo"], "sanitize": ["phase9_demo.sanitize_cases"]}))
    (tmp_path / "README.md").write_text("Hand-written.\n\n<!-- table:checks -->\nold\n<!-- /table:checks -->\n")
    assert render.render_tables(load_manifest(tmp_path)) == ["checks"]
    assert (tmp_path / "README.md").read_text() == (
        "Hand-written.\n\n<!-- table:checks -->\n"
        "| check | result | GPU | commit | date |\n|---|---|---|---|---|\n"
        "| pytest phase9_demo | 2 of 2 passed | GPU X | abc1234 | 2026-01-02 |\n"
        "| compute-sanitizer phase9_demo.sanitize_cases | memcheck clean, racecheck clean | GPU X | abc1234 | 2026-01-02 |\n"
        "\n_utils/results/grade/all.json, utils/results/sanitize.json._\n<!-- /table:checks -->\n")
    assert gpu_checks.checks_lines({"tests": ["phase9_demo"]})[-1] == "_utils/results/grade/all.json._"


def test_every_checks_table_has_a_manifest_with_checks():
    """The old generated checklists are gone, and each `checks` marker stands in a README that a
    manifest with tests or sanitizer modules renders."""
    rendered = {}
    for path in manifests():
        manifest = load_manifest(path.parent)
        readme = manifest["_dir"] / manifest.get("readme", "README.md")
        rendered[readme] = bool(manifest.get("tests") or manifest.get("sanitize"))
    root = gpu_checks.REPO_ROOT
    readmes = [*root.glob("README*.md"), *root.glob("*/README*.md"), *root.glob("*/*/README*.md")]
    assert not [p for p in readmes if "<!-- gpu-checks:begin -->" in p.read_text()]
    placed = [p for p in readmes if "<!-- table:checks -->" in p.read_text()]
    assert placed and all(rendered.get(p) for p in placed), placed


def test_sanitizer_targets_come_from_the_manifests():
    declared = {m["name"]: m.get("sanitize", []) for m in lessons()}
    every = sanitize.target_modules([])
    assert every == [module for modules in declared.values() for module in modules] and every
    name = next(n for n, modules in declared.items() if modules)
    assert sanitize.target_modules([name, "some.module"]) == [*declared[name], "some.module"]
