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
        for short, metric in METRICS.items():
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
            launch_skip: int = 0, timeout: float = 600, from_start: bool = True) -> list[dict]:
    """Profile the kernels `command` launches (optionally only names matching kernel_regex; with
    from_start=False only those inside the target's profiled_region())."""
    ncu = find_ncu()
    args = [ncu, "--clock-control", "none", "--csv", "--page", "raw",
            "--profile-from-start", "on" if from_start else "off",
            "--metrics", ",".join(METRICS.values()),
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
