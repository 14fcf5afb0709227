"""The timing helpers' arguments, head start and turns (CPU), both L2 flushes and what the events time (GPU)."""

import pytest
import torch

import time

from utils.bench import FLUSHES, MAX_HEAD_START_S, SPIN_CLOCK_HZ, head_start_cycles, time_cuda, time_in_turns
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


def test_time_in_turns_takes_one_sample_of_every_fn_per_round(monkeypatch):
    """The samples alternate between the fns (a drift of the GPU moves them alike), every fn gets
    its own median, and the rounds stop early (at 5 at least) once max_seconds per fn is spent."""
    from utils import bench

    order, ms = [], {"a": 2.0, "b": 4.0}
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "timed_call", lambda fn: (None, ms[fn()]))
    fns = {name: (lambda name=name: order.append(name) or name) for name in ms}
    medians = bench.time_in_turns(fns, warmup=0, reps=30, flush_l2=False, max_seconds=0.001, gpu_only=False)
    assert medians == ms
    assert order == ["a", "b"] * 5


@requires_gpu
def test_time_in_turns_times_each_fn_on_its_own():
    x = torch.randn(1 << 22, device="cuda")
    medians = time_in_turns({"one": lambda: x * 2, "eight": lambda: [x * 2 for _ in range(8)]}, reps=7)
    assert list(medians) == ["one", "eight"] and 0 < medians["one"] < medians["eight"]


def test_attention_rows_are_timed_together_and_leave_out_what_rejects_the_inputs(monkeypatch, capsys):
    """try_attention_rows: the implementations that run are timed in one time_in_turns call, each
    row carries its own median and error; one that rejects the inputs is left out, by name."""
    from utils import attention_bench

    timed = []

    def fake_turns(fns, **timing):
        timed.append(list(fns))
        return {name: 2.0 + i for i, name in enumerate(fns)}

    def rejects(q, k, v, causal):
        raise ValueError("D=7 is not supported")

    monkeypatch.setattr(attention_bench, "time_in_turns", fake_turns)
    monkeypatch.setattr(attention_bench, "peak_extra_mb", lambda fn: 0.0)
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    impls = {"same": lambda q, k, v, causal: q, "rejects": rejects, "twice": lambda q, k, v, causal: 2 * q}
    rows = attention_bench.try_attention_rows(impls, q, q, q, False, ref=q)
    assert timed == [["same", "twice"]] and list(rows) == ["same", "twice"]
    assert rows["same"]["ms"] == 2.0 and rows["twice"]["ms"] == 3.0
    assert rows["same"]["rel_err"] == 0.0 and rows["twice"]["rel_err"] > 0.5
    assert "rejects: skipped at S=5 (D=7 is not supported)" in capsys.readouterr().out


def test_grouped_rows_time_every_implementation_at_every_H_kv_in_the_same_turns(monkeypatch, capsys):
    """grouped_rows: one time_in_turns call over every (implementation, H_kv) pair, in that order;
    each row carries its H_kv, its median and the bytes of its K/V heads; a pair that rejects the
    inputs is left out, by name and H_kv."""
    from utils import attention_bench

    timed = []

    def fake_turns(fns, **timing):
        timed.append(list(fns))
        return {name: 2.0 + i for i, name in enumerate(fns)}

    def only_whole_heads(q, k, v, causal):
        if k.shape[1] != q.shape[1]:
            raise ValueError("one K/V head per query head")
        return q

    monkeypatch.setattr(attention_bench, "time_in_turns", fake_turns)
    monkeypatch.setattr(attention_bench, "peak_extra_mb", lambda fn: 0.0)
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64)
    kv = {H_kv: (torch.randn(1, H_kv, 5, 8, dtype=torch.float64),) * 2 for H_kv in (4, 1)}
    impls = {"grouped": lambda q, k, v, causal: q, "whole": only_whole_heads}
    rows = attention_bench.grouped_rows(impls, q, kv, False)
    assert timed == [[("grouped", 4), ("grouped", 1), ("whole", 4)]]
    assert [(r["impl"], r["H_kv"], r["ms"], r["op"]) for r in rows] == [
        ("grouped", 4, 2.0, "attention_gqa"), ("grouped", 1, 3.0, "attention_gqa"), ("whole", 4, 4.0, "attention_gqa")]
    traffic = [r["gbps"] * r["ms"] for r in rows]  # bytes, up to a constant
    assert traffic[0] > traffic[1] and traffic[0] == pytest.approx(traffic[2])  # K/V of H_kv heads only
    assert "whole (H_kv=1): skipped at S=5 (one K/V head per query head)" in capsys.readouterr().out


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
