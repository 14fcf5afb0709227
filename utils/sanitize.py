"""compute-sanitizer memcheck and racecheck over a phase's kernels.

`python -m utils.sanitize phase2_naive [phase5_fused.tc_sanitize_cases ...]` runs each tool on
`python -m <phase>.sanitize_cases` (or on the module named), a small module in the phase that calls
every kernel once on awkward sizes (S not a multiple of any tile, Sq != Sk, masks, causal). Exit code 1 if any tool
reports an error; the summary line of each run is printed. On a GPU, a run with both tools is
recorded in utils/results/sanitize.json, each run with its environment stamp: it replaces the
recorded runs of the modules it covered (utils.gpu_checks reads the file for the phase READMEs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from utils.build import REPO_ROOT

TOOLS = ("memcheck", "racecheck")
RECORD = REPO_ROOT / "utils" / "results" / "sanitize.json"


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
    runs = []
    for phase in args.phases or discover():
        for tool in args.tools:
            ok, detail = run_tool(sanitizer, tool, phase)
            runs.append({"module": target_module(phase), "tool": tool, "clean": ok, "summary": detail.splitlines()[0]})
            print(f"{phase:<22} {tool:<10} {'clean' if ok else 'ERRORS'}: {detail}", flush=True)
    if set(args.tools) == set(TOOLS):
        record(runs)
    return 0 if all(r["clean"] for r in runs) else 1


def record(runs: list[dict], path: Path = RECORD) -> None:
    """Record these runs (both tools per module), each with the environment stamp, on a GPU only:
    they replace the recorded runs of the same modules and keep those of the others."""
    import torch

    from utils.results import env_stamp

    if not torch.cuda.is_available():
        return
    env = env_stamp()
    modules = {r["module"] for r in runs}
    kept = []
    if path.exists():
        old = json.loads(path.read_text())
        kept = [dict(r, env=r.get("env", old["env"])) for r in old["runs"] if r["module"] not in modules]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "runs": kept + [dict(r, env=env) for r in runs]}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
