"""lesson_main, the command line every lesson's run.py shares: what it runs in each case."""

from pathlib import Path

import pytest

from utils import kernel_bench


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(kernel_bench, "render", lambda folder: seen.append(("render", folder)))
    return seen


def measure_into(seen):
    def measure(args):
        seen.append(("measure", args.quick, args.no_ncu))
        return Path("results/metrics.json")
    return measure


def run(argv, seen, gpu, monkeypatch):
    monkeypatch.setattr(kernel_bench.torch.cuda, "is_available", lambda: gpu)
    return kernel_bench.lesson_main(argv, Path("lesson"), "test", measure_into(seen),
                                    lambda names: seen.append(("profile", names)))


def test_without_a_gpu_it_only_renders(calls, monkeypatch):
    assert run([], calls, False, monkeypatch) == 0
    assert calls == [("render", Path("lesson"))]


def test_on_a_gpu_it_measures_then_renders(calls, monkeypatch):
    assert run(["--no-ncu"], calls, True, monkeypatch) == 0
    assert calls == [("measure", False, True), ("render", Path("lesson"))]


def test_a_quick_run_is_not_rendered(calls, monkeypatch):
    assert run(["--quick"], calls, True, monkeypatch) == 0
    assert calls == [("measure", True, False)]


def test_the_profile_target_makes_only_the_profiled_calls(calls, monkeypatch):
    assert run(["--profile-target", "a,b"], calls, True, monkeypatch) == 0
    assert calls == [("profile", "a,b")]
