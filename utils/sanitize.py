"""compute-sanitizer memcheck and racecheck over the lessons' kernels.

`python -m utils.sanitize [LESSON or MODULE ...]` runs each tool on the modules a lesson's
manifest.json lists under `sanitize` (or on the module named; default: every lesson's), small
modules that call every kernel once on awkward sizes (S not a multiple of any tile, Sq != Sk,
masks, causal). Exit code 1 if any tool reports an error; the summary line of each run is printed.
On a GPU, a run with both tools is recorded in utils/results/sanitize.json, each run with its
environment stamp: it replaces the recorded runs of the modules it covered (the lessons' `checks`
tables are drawn from the file, utils.gpu_checks).
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


def target_modules(names: list[str]) -> list[str]:
    """The modules to run: a lesson's name means the modules its manifest lists under `sanitize`,
    any other name is a module; no name means every lesson's, in course order."""
    from utils.manifest import lessons

    declared = {m["name"]: m.get("sanitize", []) for m in lessons()}
    if not names:
        return [module for modules in declared.values() for module in modules]
    return [module for name in names for module in declared.get(name, [name])]


def run_tool(sanitizer: str, tool: str, module: str) -> tuple[bool, str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99"]
    if tool == "memcheck":
        cmd += ["--leak-check", "no"]
    cmd += [sys.executable, "-m", module]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    output = proc.stdout + proc.stderr
    summary = [line for line in output.splitlines() if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
    ok = proc.returncode == 0
    detail = summary[-1] if summary else f"exit {proc.returncode}"
    if not ok:
        detail += "\n" + "\n".join(output.strip().splitlines()[-30:])
    return ok, detail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compute-sanitizer memcheck + racecheck per lesson")
    parser.add_argument("names", nargs="*", help="lessons or modules (default: every lesson's)")
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    args = parser.parse_args(argv)
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found: it ships with the CUDA toolkit (bin/compute-sanitizer)")
        return 1
    runs = []
    for module in target_modules(args.names):
        for tool in args.tools:
            ok, detail = run_tool(sanitizer, tool, module)
            runs.append({"module": module, "tool": tool, "clean": ok, "summary": detail.splitlines()[0]})
            print(f"{module:<40} {tool:<10} {'clean' if ok else 'ERRORS'}: {detail}", flush=True)
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
