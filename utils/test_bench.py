"""The timing helper's arguments and head start (CPU), both L2 flushes and what the events time (GPU)."""

import pytest
import torch

import time

from utils.bench import FLUSHES, MAX_HEAD_START_S, SPIN_CLOCK_HZ, head_start_cycles, time_cuda
from utils.testing import requires_gpu


def test_unknown_flush_is_named():
    with pytest.raises(ValueError, match="flush must be one of"):
        time_cuda(lambda: None, flush="invalidate")


def test_head_start_is_twice_the_host_time_capped():
    assert head_start_cycles(1e-4) == int(2e-4 * SPIN_CLOCK_HZ)
    assert head_start_cycles(-1.0) == 0
    assert head_start_cycles(10.0) == int(MAX_HEAD_START_S * SPIN_CLOCK_HZ)


@requires_gpu
def test_gpu_only_keeps_the_host_time_out_of_the_events():
    """A call that spends 2 ms on the host before a tiny kernel: the events see the kernel alone with
    the head start, and the host's 2 ms without it."""
    x = torch.zeros(1024, device="cuda")

    def slow_host_call():
        time.sleep(0.002)
        x.add_(1)

    assert time_cuda(slow_host_call, reps=7, flush_l2=False) < 0.5
    assert time_cuda(slow_host_call, reps=7, flush_l2=False, gpu_only=False) > 1.5


@requires_gpu
@pytest.mark.parametrize("flush", FLUSHES)
def test_both_flushes_time_a_kernel(flush):
    x = torch.randn(1 << 20, device="cuda")
    assert time_cuda(lambda: x * 2, reps=5, flush=flush) > 0


def test_sweep_prints_each_config_with_the_count_and_the_time_left(capsys):
    from utils.bench import sweep

    def run_one(config):
        if config["S"] == 2:
            raise torch.cuda.OutOfMemoryError("too big")
        return {"impl": "x", "S": config["S"]}

    assert sweep([{"S": 1}, {"S": 2}, {"S": 3}], run_one, "demo") == [{"impl": "x", "S": 1}, {"impl": "x", "S": 3}]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("]")[0] for line in lines] == ["[demo 1/3, 0 s, about 0 s left", "[demo 2/3, 0 s, about 0 s left",
                                                      "[demo 3/3, 0 s"]
    assert lines[0].endswith("] S=1") and lines[1].endswith("] S=2: out of memory, skipped") and "\r" not in "".join(lines)


def test_the_budgeted_sweep_counts_every_panel_as_one_sweep(monkeypatch, capsys):
    """sweep_with_budget measures one config at a time; its progress counts all panels' configs."""
    from utils import attention_bench, kernel_bench

    def fake(impls, configs, desc="attention", count=None):
        return attention_bench.sweep(configs, lambda c: [{"impl": n, "ms": 1.0} for n in impls], desc, count)

    monkeypatch.setattr(attention_bench, "benchmark_attention", fake)
    panels = [{"D": 64, "causal": c, "seq_lens": [128, 256], "impls": {"a": None}} for c in (False, True)]
    assert len(kernel_bench.sweep_with_budget(panels, {})) == 4
    tags = [line.split(",")[0] for line in capsys.readouterr().out.splitlines()]
    assert tags == ["[attention 1/4", "[attention 2/4", "[attention 3/4", "[attention 4/4"]


def test_numbered_versions_count_from_one_and_skip_what_did_not_run():
    from utils.attention_bench import numbered_versions

    rows = numbered_versions([{"ms": 4.0}, {"ms": 2.0}, None, {"ms": 1.0}], ["a", "b", "c", "d"])
    assert [(r["version"], r["adds"]) for r in rows] == [(1, "a"), (2, "b"), (4, "d")]
    assert "speedup_over_previous" not in rows[0] and rows[1]["speedup_over_previous"] == 2.0
    assert "speedup_over_previous" not in rows[2]  # its predecessor did not run
