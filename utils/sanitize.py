"""compute-sanitizer memcheck and racecheck over a phase's kernels.

`python -m utils.sanitize phase2_naive [phase5_fused.tc_sanitize_cases ...]` runs each tool on
`python -m <phase>.sanitize_cases` (or on the module named), a small module in the phase that calls
every kernel once on awkward sizes (S not a multiple of any tile, Sq != Sk, masks, causal). Exit code 1 if any tool
reports an error; the summary line of each run is printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from utils.build import REPO_ROOT

TOOLS = ("memcheck", "racecheck")


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = Path(cuda_home) / "bin" / "compute-sanitizer"
    return str(path) if path.exists() else None


def target_module(name: str) -> str:
    """A phase package means its sanitize_cases module; a module name is taken as it is."""
    return name if "sanitize" in name else f"{name}.sanitize_cases"


def discover() -> list[str]:
    """Every sanitize-cases module of the course, as module names."""
    found = sorted(REPO_ROOT.glob("*/sanitize_cases.py")) + sorted(REPO_ROOT.glob("*/*_sanitize_cases.py"))
    return [".".join(p.relative_to(REPO_ROOT).with_suffix("").parts) for p in found]


def run_tool(sanitizer: str, tool: str, phase: str) -> tuple[bool, str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99"]
    if tool == "memcheck":
        cmd += ["--leak-check", "no"]
    cmd += [sys.executable, "-m", target_module(phase)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    output = proc.stdout + proc.stderr
    summary = [line for line in output.splitlines() if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
    ok = proc.returncode == 0
    detail = summary[-1] if summary else f"exit {proc.returncode}"
    if not ok:
        detail += "\n" + "\n".join(output.strip().splitlines()[-30:])
    return ok, detail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compute-sanitizer memcheck + racecheck per phase")
    parser.add_argument("phases", nargs="*", help="phases or modules (default: every one found)")
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    args = parser.parse_args(argv)
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found: it ships with the CUDA toolkit (bin/compute-sanitizer)")
        return 1
    all_ok = True
    for phase in args.phases or discover():
        for tool in args.tools:
            ok, detail = run_tool(sanitizer, tool, phase)
            all_ok &= ok
            print(f"{phase:<22} {tool:<10} {'clean' if ok else 'ERRORS'}: {detail}", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
