"""Registers, shared memory and spills of phase 3's kernels from the compiler (ptxas -v), and the
theoretical occupancy they allow. Needs the CUDA toolkit, not a GPU.

`python -m phase3_tiled.compiler_report` prints the table; run.py stores it in metrics.json.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("tiled_qk.cu", "block_softmax.cu", "tiled_av.cu")
KERNEL_OPS = {"tiled_qk_kernel": "matmul_qk", "block_softmax_kernel": "softmax",
              "tiled_av_kernel": "matmul_av"}

# sm_90 (H100) per-SM limits, used when no GPU is visible to ask.
SM90_LIMITS = {"max_threads": 2048, "max_blocks": 32, "registers": 65536, "smem_bytes": 233472,
               "smem_reserved_per_block": 1024, "reg_alloc_unit": 256}


def ptxas_report(sources=SOURCES) -> list[dict]:
    """One record per kernel: name (demangled), registers, smem_bytes, spill stores / loads."""
    from utils.build import CSRC, check_setup

    cuda_home = check_setup()
    arch = os.environ["TORCH_CUDA_ARCH_LIST"].split(";")[0].replace(".", "").replace("+PTX", "")

    def compile_one(source: str) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [str(cuda_home / "bin" / "nvcc"), f"-arch=sm_{arch}", "-O3", "-c", "-Xptxas", "-v",
                 f"-I{CSRC}", f"-I{HERE}", str(HERE / source), "-o", str(Path(tmp) / "k.o")],
                capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source}:\n{proc.stderr[-2000:]}")
        return proc.stderr + proc.stdout

    with ThreadPoolExecutor(len(sources)) as pool:
        logs = list(pool.map(compile_one, sources))
    return [dict(rec, source=src) for src, log in zip(sources, logs) for rec in parse_ptxas(log)]


def parse_ptxas(log: str) -> list[dict]:
    records: list[dict] = []
    current: dict | None = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = {"mangled": m.group(1), "kernel": demangle(m.group(1))}
            records.append(current)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current["smem_bytes"] = int(s.group(1)) if s else 0
    for r in records:
        name = re.search(r"(\w+_kernel)", r["kernel"])
        t = re.search(r"ILi(\d+)E", r["mangled"])
        r["tile"] = int(t.group(1)) if t else None
        r["name"] = (name.group(1) if name else r["kernel"]) + (f"<{r['tile']}>" if r["tile"] else "")
        r["op"] = next((op for key, op in KERNEL_OPS.items() if key in r["name"]), "?")
        # Launch configuration: T x T threads for the tiled matmuls, up to 256 for the softmax.
        r["threads"] = r["tile"] ** 2 if r["tile"] else 256
    return records


def demangle(name: str) -> str:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt:
        return name
    out = subprocess.run([cxxfilt, name], capture_output=True, text=True, check=False).stdout.strip()
    return out or name


def sm_limits() -> dict:
    """Per-SM limits of the visible GPU (torch's device properties), else sm_90's."""
    limits = dict(SM90_LIMITS)
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            limits["max_threads"] = getattr(p, "max_threads_per_multi_processor", limits["max_threads"])
            limits["registers"] = getattr(p, "regs_per_multiprocessor", limits["registers"])
            limits["smem_bytes"] = getattr(p, "shared_memory_per_multiprocessor", limits["smem_bytes"])
    except ImportError:
        pass
    return limits


def theoretical_occupancy(threads: int, registers: int, smem_bytes: int, limits: dict | None = None) -> dict:
    """Resident blocks per SM and active warps / max warps, from the per-SM limits."""
    lim = limits or sm_limits()
    warps = -(-threads // 32)
    unit = lim["reg_alloc_unit"]
    regs_per_warp = -(-registers * 32 // unit) * unit
    by = {
        "threads": lim["max_threads"] // (warps * 32),
        "blocks": lim["max_blocks"],
        "registers": (lim["registers"] // regs_per_warp) // warps if regs_per_warp else lim["max_blocks"],
        "shared_memory": lim["smem_bytes"] // (smem_bytes + lim["smem_reserved_per_block"]),
    }
    blocks = min(by.values())
    limiter = min(by, key=by.get)
    return {"blocks_per_sm": blocks, "limited_by": limiter,
            "occupancy_pct": 100.0 * blocks * warps / (lim["max_threads"] // 32)}


def report() -> list[dict]:
    """ptxas records with the theoretical occupancy of each kernel's launch configuration."""
    records = ptxas_report()
    limits = sm_limits()
    for r in records:
        r.update(theoretical_occupancy(r["threads"], r.get("registers", 0), r.get("smem_bytes", 0), limits))
    return records


def main() -> None:
    print(f"{'kernel':<26} {'threads':>7} {'regs':>5} {'smem B':>7} {'spills':>7} {'blocks/SM':>9} {'occ %':>6} limit")
    for r in report():
        spills = r.get("spill_stores", 0) + r.get("spill_loads", 0)
        print(f"{r['name']:<26} {r['threads']:>7} {r.get('registers', 0):>5} "
              f"{r.get('smem_bytes', 0):>7} {spills:>7} {r['blocks_per_sm']:>9} {r['occupancy_pct']:>6.1f} "
              f"{r['limited_by']}")


if __name__ == "__main__":
    main()
