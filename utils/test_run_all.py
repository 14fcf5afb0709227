"""The full GPU job: its steps found through the manifests, its parts, progress and archive (CPU only)."""

import tarfile
import time

from utils import run_all
from utils.manifest import lessons


def _names(path):
    with tarfile.open(path) as tar:
        return [m.name for m in tar.getmembers() if m.isfile()]


def _steps(argv, gpu):
    return [name for name, _ in run_all.plan(run_all.parse(["--no-build", *argv]), gpu)]


def test_archive_holds_only_results_written_since_the_start(tmp_path):
    measured = next(m for m in lessons() if (m["_dir"] / m["results"]).exists())
    results = (measured["_dir"] / measured["results"]).relative_to(run_all.REPO_ROOT).as_posix()
    everything = _names(run_all.archive(tmp_path / "all"))
    assert results in everything and "utils/results/ceilings.json" in everything
    later = _names(run_all.archive(tmp_path / "none", since=time.time() + 3600))
    assert not [n for n in later if "/results/" in n]


def test_the_parts_cover_every_lesson_run_once():
    runs = run_all.lesson_runs()
    assert runs and runs == [r for m in lessons() if "run" in m for r in run_all.runs_of(m)]
    assert "final.train" in runs  # a manifest may name several modules
    assert all(m.get("part") in run_all.parts() for m in lessons() if "run" in m)
    assert sorted(r for part in run_all.parts() for r in run_all.lesson_runs(part)) == sorted(runs)
    assert sum(s.get("grade", False) for s in run_all.PART_STEPS.values()) == 1
    assert sum(s.get("sanitize", False) for s in run_all.PART_STEPS.values()) == 1


def test_without_a_gpu_the_job_only_renders_and_executes_the_notebook():
    assert _steps([], gpu=False) == ["render", "notebook"]
    building = [name for name, _ in run_all.plan(run_all.parse([]), gpu=False)]
    assert "build" not in building   # nothing will run a kernel: compiling every extension would be wasted
    assert _steps(["--tests", "utils", "--sanitize", "--grade"], gpu=False) == ["tests", "render", "notebook"]


def test_on_a_gpu_each_lesson_runs_in_course_order_then_the_renderer_and_the_notebook():
    assert _steps(["--tests", "--sanitize", "--grade"], gpu=True) == \
        ["tests", "sanitize", "grade", "ceilings", *run_all.lesson_runs(), "render", "notebook"]


def test_a_part_runs_its_lessons_and_its_job_wide_steps_without_rendering():
    graded = run_all.parse(["--part", "1"])
    assert graded.grade and not graded.sanitize and graded.no_bench
    assert graded.tests == run_all.ungraded_tests() and graded.tests[-1] == "utils"
    assert _steps(["--part", "1"], gpu=True) == ["tests", "grade"]
    part = next(p for p in run_all.parts() if p not in run_all.PART_STEPS and run_all.lesson_runs(p))
    assert _steps(["--part", str(part)], gpu=True) == ["ceilings", *run_all.lesson_runs(part)]


def test_each_step_is_numbered_and_timed(capsys):
    done = run_all.run_steps([("first", lambda: True), ("second", lambda: False)])
    assert [(name, ok) for name, ok, _ in done] == [("first", True), ("second", False)]
    out = capsys.readouterr().out
    assert "=== step 1 of 2: first" in out and "=== step 2 of 2: second FAILED in " in out
