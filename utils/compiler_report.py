"""Registers, shared memory and spills of a lesson's kernels from the compiler (ptxas -v), and the
theoretical occupancy their launch configuration allows. Needs the CUDA toolkit, not a GPU.

    report(folder, sources, kernel_ops, threads)   one record per kernel (phase 3's run.py stores
                                                   them in its results file)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# sm_90 (H100) per-SM limits, used when no GPU is visible to ask.
SM90_LIMITS = {"max_threads": 2048, "max_blocks": 32, "registers": 65536, "smem_bytes": 233472,
               "smem_reserved_per_block": 1024, "reg_alloc_unit": 256}


def ptxas_report(folder: Path, sources) -> list[dict]:
    """One record per kernel of the folder's sources: name (demangled), registers, smem_bytes, spill
    stores / loads."""
    from torch.utils.cpp_extension import include_paths

    from utils.build import CSRC, check_setup

    cuda_home = check_setup()
    includes = [f"-I{path}" for path in (CSRC, folder, *include_paths())]  # as the extension build has
    arch = os.environ["TORCH_CUDA_ARCH_LIST"].split(";")[0].replace(".", "").replace("+PTX", "")

    def compile_one(source: str) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [str(cuda_home / "bin" / "nvcc"), f"-arch=sm_{arch}", "-O3", "-std=c++20", "-c", "-Xptxas", "-v",
                 *includes, str(Path(folder) / source), "-o", str(Path(tmp) / "k.o")],
                capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source}:\n{proc.stderr[-2000:]}")
        return proc.stderr + proc.stdout

    with ThreadPoolExecutor(len(sources)) as pool:
        logs = list(pool.map(compile_one, sources))
    return [dict(rec, source=src) for src, log in zip(sources, logs) for rec in parse_ptxas(log)]


def parse_ptxas(log: str) -> list[dict]:
    """Records of a ptxas -v log: mangled and demangled name, registers, smem_bytes, spills, and the
    tile (the first integer template argument, if any) in `name` (`tiled_qk_kernel<16>`)."""
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


def report(folder: Path, sources, kernel_ops: dict, threads) -> list[dict]:
    """ptxas records of the folder's sources, each with its op (kernel_ops: name part -> op), its
    launch's thread count (threads(record) -> int) and the theoretical occupancy that allows."""
    records = ptxas_report(folder, sources)
    limits = sm_limits()
    for r in records:
        r["op"] = next((op for key, op in kernel_ops.items() if key in r["name"]), "?")
        r["threads"] = threads(r)
        r.update(theoretical_occupancy(r["threads"], r.get("registers", 0), r.get("smem_bytes", 0), limits))
    return records


def main(argv=None) -> int:
    """`python -m utils.compiler_report FOLDER`: registers, shared memory and spills of every kernel
    of the folder's .cu files (no GPU needed)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m utils.compiler_report FOLDER   (a lesson folder, e.g. phase3_tiled)")
        return 2
    folder = Path(args[0]).resolve()
    print(f"{'kernel':<40} {'regs':>5} {'smem B':>7} {'spill B':>8}")
    for r in ptxas_report(folder, sorted(p.name for p in folder.glob("*.cu"))):
        spills = r.get("spill_stores", 0) + r.get("spill_loads", 0)
        print(f"{r['name']:<40} {r.get('registers', 0):>5} {r.get('smem_bytes', 0):>7} {spills:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
