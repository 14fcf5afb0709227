"""Nsight Compute runs and CSV parsing into per-kernel records.

`profile(command, kernel_regex)` runs `ncu --clock-control none --csv --page raw` with the metric set
of a hierarchical Roofline and returns one record per profiled kernel launch: time, DRAM / L2 / L1
bytes, FP32 instruction counts (FLOPs = 2*FFMA + FADD + FMUL), tensor-pipe instructions, achieved
occupancy, global load sectors per request, shared-memory bank conflicts.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

from utils.build import REPO_ROOT

METRICS = {
    "time_ns": "gpu__time_duration.sum",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_bytes": "lts__t_bytes.sum",
    "l1_bytes": "l1tex__t_bytes.sum",
    "ffma": "sm__sass_thread_inst_executed_op_ffma_pred_on.sum",
    "fadd": "sm__sass_thread_inst_executed_op_fadd_pred_on.sum",
    "fmul": "sm__sass_thread_inst_executed_op_fmul_pred_on.sum",
    "hfma": "sm__sass_thread_inst_executed_op_hfma_pred_on.sum",
    "tensor_inst": "sm__inst_executed_pipe_tensor.sum",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "gld_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "gld_requests": "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "smem_ld_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "smem_st_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "registers": "launch__registers_per_thread",
    "clock_hz": "sm__cycles_elapsed.avg.per_second",
}

# Why warps wait (profile(..., stalls=True)): the share of active warps stalled for each reason
# (in % of active warp-cycles), how often a scheduler issues,
# and how busy the FMA and tensor pipes are. The reasons a kernel student meets first:
# long_scoreboard = waiting for global/local memory, short_scoreboard = shared memory or MUFU,
# mio_throttle = the shared-memory instruction queue is full, math_pipe_throttle = the pipe is busy,
# barrier = __syncthreads, wait = fixed-latency dependencies, not_selected = eligible but another
# warp issued (a healthy sign).
STALL_REASONS = ("long_scoreboard", "short_scoreboard", "mio_throttle", "math_pipe_throttle", "barrier", "wait",
                 "not_selected", "selected", "lg_throttle", "dispatch_stall", "no_instruction", "branch_resolving")
STALL_METRICS = {
    **{f"stall_{r}": f"smsp__warp_issue_stalled_{r}_per_warp_active.pct" for r in STALL_REASONS},
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "pipe_fma_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "pipe_tensor_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
}


class NcuUnavailable(RuntimeError):
    """ncu is missing or may not read the GPU's counters; the message says which."""


def find_ncu() -> str:
    candidates = [shutil.which("ncu")]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates.append(str(Path(cuda_home) / "bin" / "ncu"))
    candidates.extend(str(p) for p in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu")))
    for c in candidates:
        if c and Path(c).exists():
            return c
    raise NcuUnavailable("ncu (Nsight Compute) not found: install it or put it on PATH")


def parse_csv(text: str) -> list[dict]:
    """ncu --csv --page raw output: header row, units row, one row per kernel (numbers with
    thousands separators). Returns records with our short metric names."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        return []
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    header, body = table[0], table[1:]
    if body and body[0] and body[0][0] == "":  # the units row
        body = body[1:]
    records = []
    for row in body:
        raw = dict(zip(header, row))
        record = {"kernel": raw.get("Kernel Name", ""), "id": raw.get("ID", "")}
        for short, metric in {**METRICS, **STALL_METRICS}.items():
            if metric in raw:
                record[short] = _number(raw[metric])
        _derive(record)
        records.append(record)
    return records


def _number(text: str):
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def _derive(r: dict) -> None:
    """Derived quantities: FP32 FLOPs, DRAM bytes, rates, sectors per request."""
    if r.get("ffma") is not None:
        r["fp32_flops"] = 2 * r["ffma"] + (r.get("fadd") or 0) + (r.get("fmul") or 0)
    if r.get("dram_read_bytes") is not None:
        r["dram_bytes"] = r["dram_read_bytes"] + (r.get("dram_write_bytes") or 0)
    t = r.get("time_ns")
    if t:
        if "dram_bytes" in r:
            r["dram_GBps"] = r["dram_bytes"] / t
        if "fp32_flops" in r:
            r["fp32_GFLOPs"] = r["fp32_flops"] / t
    if r.get("gld_requests"):
        r["sectors_per_request"] = r["gld_sectors"] / r["gld_requests"]


def profiled_region():
    """Context manager for the profiled part of a target run with from_start=False: only kernels
    launched inside it are profiled (cudaProfilerStart / cudaProfilerStop)."""
    import torch

    return torch.cuda.profiler.profile()


def profile(command: list[str], kernel_regex: str | None = None, launch_count: int = 50,
            launch_skip: int = 0, timeout: float = 600, from_start: bool = True, stalls: bool = False) -> list[dict]:
    """Profile the kernels `command` launches (optionally only names matching kernel_regex; with
    from_start=False only those inside the target's profiled_region()). stalls=True adds
    STALL_METRICS; if this ncu rejects one of them, the profile is taken without them and every
    record says so under "stalls_unavailable"."""
    try:
        return _run_ncu(command, {**METRICS, **STALL_METRICS} if stalls else METRICS, kernel_regex,
                        launch_count, launch_skip, timeout, from_start)
    except NcuUnavailable as exc:
        if not stalls or "ERR_NVGPUCTRPERM" in str(exc):
            raise
        records = _run_ncu(command, METRICS, kernel_regex, launch_count, launch_skip, timeout, from_start)
        for r in records:
            r["stalls_unavailable"] = str(exc).splitlines()[-1][:200]
        return records


def _run_ncu(command, metrics: dict, kernel_regex, launch_count, launch_skip, timeout, from_start) -> list[dict]:
    ncu = find_ncu()
    args = [ncu, "--clock-control", "none", "--csv", "--page", "raw",
            "--profile-from-start", "on" if from_start else "off",
            "--metrics", ",".join(metrics.values()),
            "--launch-count", str(launch_count), "--launch-skip", str(launch_skip)]
    if kernel_regex:
        args += ["--kernel-name", f"regex:{kernel_regex}"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(args + command, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO_ROOT, check=False)
    output = proc.stdout + proc.stderr
    if "ERR_NVGPUCTRPERM" in output or "permission" in output.lower() and "counter" in output.lower():
        raise NcuUnavailable("ncu may not read the GPU performance counters on this machine "
                             "(ERR_NVGPUCTRPERM): run as root or allow profiling for all users")
    records = parse_csv(proc.stdout)
    if not records:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise NcuUnavailable(f"ncu produced no kernel records (exit {proc.returncode}):\n{tail}")
    return records


def top_stalls(record: dict, count: int = 3) -> list[tuple[str, float]]:
    """The `count` largest stall reasons of a record (name, % of active warps), "selected" excluded."""
    stalls = [(k[len("stall_"):], v) for k, v in record.items()
              if k.startswith("stall_") and k != "stall_selected" and isinstance(v, (int, float))]
    return sorted(stalls, key=lambda kv: -kv[1])[:count]


def stall_summary(record: dict) -> str:
    """One line for a README: issue rate, pipes, and the top stall reasons."""
    if "stalls_unavailable" in record:
        return f"stall counters unavailable ({record['stalls_unavailable']})"
    parts = []
    for key, label in (("issue_active_pct", "issue slots busy"), ("pipe_fma_pct", "FMA pipe"),
                       ("pipe_tensor_pct", "tensor pipe")):
        if record.get(key) is not None:
            parts.append(f"{label} {record[key]:.0f}%")
    stalls = top_stalls(record)
    if stalls:
        parts.append("top stalls (% of active warps): " + ", ".join(f"{n} {v:.0f}" for n, v in stalls))
    return "; ".join(parts) if parts else "no stall counters in this profile"


def profile_python(module_and_args: list[str], kernel_regex: str | None = None, **kwargs) -> list[dict]:
    """Profile `python -m module args...` with this interpreter."""
    return profile([sys.executable, "-m", *module_and_args], kernel_regex, **kwargs)


def summarize(records: list[dict]) -> str:
    """A small text table of the most telling metrics, one line per kernel."""
    cols = ("time_ns", "dram_GBps", "fp32_GFLOPs", "occupancy_pct", "sectors_per_request",
            "smem_ld_conflicts", "smem_st_conflicts", "registers")
    lines = ["kernel".ljust(48) + "".join(c.rjust(20) for c in cols)]
    for r in records:
        name = r["kernel"].split("(")[0][:46]
        lines.append(name.ljust(48) + "".join(_fmt(r.get(c)).rjust(20) for c in cols))
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if abs(value) < 1e6 else f"{value:,.3g}"
