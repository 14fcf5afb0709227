"""JIT builds of the course's CUDA extensions.

`load_phase(phase, name, sources)` compiles a phase's .cu/.cpp files with
torch.utils.cpp_extension.load into build/<name>/ inside the repository and loads the result as a
library of torch ops (TORCH_LIBRARY registration): the ops appear as torch.ops.<name>.<op>.

Before building it checks the set-up and fails with one clear line when something is missing:
no CUDA toolkit, no ninja, a CPU-only torch, or a toolkit whose CUDA major version differs from
torch's. It sets CUDA_HOME and TORCH_CUDA_ARCH_LIST itself (the visible GPU's arch, or 9.0 when no
GPU is visible), so the kernels also compile on a machine without a GPU.

`python -m utils.build --all` builds every phase in parallel and shows each build as it starts and
finishes, with its time, and what is still building.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = REPO_ROOT / "build"
CSRC = Path(__file__).resolve().parent / "csrc"
STANDARD_CUDA_HOMES = ("/usr/local/cuda", "/opt/cuda")
# torch picks the C++ standard its headers need (C++17 or C++20 by version); we add only these.
NVCC_FLAGS = ["-O3", "-lineinfo"]
CXX_FLAGS = ["-O3"]
# Link the C++ runtime dynamically, the same copy torch uses. Some toolchains link libstdc++
# statically into shared objects; the extension then mixes its private iostream code with the
# process's locale objects and crashes the first time an error message formats a number
# (seen on the GPU box: a TORCH_CHECK that printed a size segfaulted).
LD_FLAGS = ["-l:libstdc++.so.6"]

# utils' own extension (the ceilings' micro-kernels); the lessons' are found by their load().
UTILS_EXTENSIONS = ("utils.ceilings",)


class BuildSetupError(RuntimeError):
    """The machine cannot build the course's kernels; the message says why in one line."""


def shown(path) -> str:
    """A path as the course prints it: relative to the repository when inside it (logs and stored
    notebook outputs then name no folder of the machine that ran them)."""
    path = Path(path).resolve()
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)


def _has_cudart(home: Path) -> bool:
    return any(any((home / lib).glob("libcudart.so*")) for lib in ("lib64", "lib"))


def find_cuda_home() -> Path:
    """The CUDA toolkit: CUDA_HOME, CUDA_PATH, the nvcc on PATH, then the standard locations.

    A toolkit counts only if it holds bin/nvcc and libcudart (an nvcc on PATH may be a wrapper
    script outside the toolkit, so its parent folder alone proves nothing).
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
        candidates.extend(_homes_named_in_wrapper(Path(nvcc)))
    candidates.extend(STANDARD_CUDA_HOMES)
    for candidate in candidates:
        if candidate and (Path(candidate) / "bin" / "nvcc").exists() and _has_cudart(Path(candidate)):
            return Path(candidate)
    raise BuildSetupError(
        "no CUDA toolkit found: install the CUDA toolkit (nvcc) or set CUDA_HOME to it"
    )


def _homes_named_in_wrapper(nvcc: Path) -> list[str]:
    """If nvcc is a small shell wrapper, the toolkit folders it execs."""
    try:
        if nvcc.stat().st_size > 4096:
            return []
        text = nvcc.read_text(errors="ignore")
    except OSError:
        return []
    return [m.group(1) for m in re.finditer(r"(/\S+?)/bin/nvcc\b", text)]


def nvcc_cuda_version(cuda_home: Path) -> str:
    out = subprocess.run(
        [str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=False
    ).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    if not match:
        raise BuildSetupError(f"could not read the CUDA version from {cuda_home}/bin/nvcc --version")
    return match.group(1)


def gpu_arch() -> str:
    """The visible GPU's compute capability as 'major.minor', or '9.0' (H100) without a GPU."""
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "9.0"


def check_setup() -> Path:
    """Verify torch, ninja and the toolkit agree; set CUDA_HOME and TORCH_CUDA_ARCH_LIST."""
    try:
        import torch
    except ImportError as exc:
        raise BuildSetupError("torch is not installed: run `make test` or `make run` to set it up") from exc
    if torch.version.cuda is None:
        raise BuildSetupError(
            f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch to compile kernels"
        )
    if shutil.which("ninja") is None and not (Path(sys.executable).parent / "ninja").exists():
        raise BuildSetupError("ninja not found: `pip install ninja` (torch's JIT builds need it)")
    cuda_home = find_cuda_home()
    toolkit = nvcc_cuda_version(cuda_home)
    if toolkit.split(".")[0] != torch.version.cuda.split(".")[0]:
        raise BuildSetupError(
            f"nvcc is CUDA {toolkit} but torch was built with CUDA {torch.version.cuda}: "
            "install a toolkit of the same major version, or a matching torch"
        )
    os.environ["CUDA_HOME"] = str(cuda_home)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", gpu_arch())
    venv_bin = str(Path(sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    return cuda_home


def toolkit_available() -> bool:
    try:
        check_setup()
    except BuildSetupError:
        return False
    return True


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """An OS file lock, released by the kernel even if the build is killed.

    torch's own lock file ('lock' in the build folder) outlives a killed build and makes the next
    build wait forever; holding this lock, no other build of ours runs, so a leftover torch lock
    is stale and is removed.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".course_build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_phase(phase_dir: str | Path, name: str, sources: list[str], verbose: bool = False,
               cuda_flags: list[str] | None = None) -> None:
    """Build (if needed) and load one extension; its ops become torch.ops.<name>.*.

    phase_dir: the folder holding `sources`; name: the extension and op namespace, unique in the
    course. Includes: the phase folder and utils/csrc (common.cuh, attention_mask.cuh, ...).
    cuda_flags: extra nvcc flags of this extension only. A -gencode/-arch flag among them replaces
    the TORCH_CUDA_ARCH_LIST targets (torch adds its own only when none is given), e.g.
    ["-gencode=arch=compute_90a,code=sm_90a"] for kernels that need Hopper's wgmma and TMA.
    """
    cuda_home = check_setup()
    import torch.utils.cpp_extension as cpp_extension

    # cpp_extension reads CUDA_HOME once, at its import; make sure it uses the toolkit we found.
    cpp_extension.CUDA_HOME = str(cuda_home)

    phase_dir = Path(phase_dir)
    build_dir = BUILD_ROOT / name
    with _build_lock(build_dir):
        cpp_extension.load(
            name=name,
            sources=[str(phase_dir / s) for s in sources],
            extra_include_paths=[str(CSRC), str(phase_dir), *_library_header_dirs()],
            extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=[*NVCC_FLAGS, *(cuda_flags or [])],
            extra_ldflags=LD_FLAGS,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )


# Extension name -> torch.ops.<name>, for every extension op_loader has loaded in this process.
LOADED_OPS: dict = {}


def op_loader(phase_dir: str | Path, name: str, sources: list[str], register_fakes=None,
              cuda_flags: list[str] | None = None):
    """A phase package's load(): the first call builds and loads the extension and registers the
    ops' fake implementations (register_fakes, for torch.compile); every call returns torch.ops.<name>.
    cuda_flags: extra nvcc flags of this extension (load_phase).
    Importing the package builds nothing (LOADED_OPS stays without the name).

    torch.compile traces load() as a dict lookup; the build itself cannot be traced, so it is marked
    assume_constant_result: the compiler runs it eagerly, once, when it first meets it."""
    import torch

    @torch.compiler.assume_constant_result
    def build_and_register() -> bool:
        load_phase(phase_dir, name, sources, cuda_flags=cuda_flags)
        if register_fakes is not None:
            register_fakes()
        LOADED_OPS[name] = getattr(torch.ops, name)
        return True

    def load():
        ops = LOADED_OPS.get(name)
        if ops is None:
            build_and_register()
            ops = getattr(torch.ops, name)
        return ops

    return load


def _library_header_dirs() -> list[str]:
    """Header folders of the CUDA libraries pip installed beside torch (cuSPARSE, cuBLAS, ...),
    for toolkits installed without them: ATen/cuda/CUDAContext.h includes cusparse.h."""
    if (Path(os.environ["CUDA_HOME"]) / "include" / "cusparse.h").exists():
        return []
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    return [str(p) for p in sorted(site.glob("nvidia/*/include")) if (p / "cusparse.h").exists()]


def _build_one(package: str, jobs: int) -> tuple[str, float, str]:
    """Build one package's extension in a fresh interpreter; return (package, seconds, error). A
    failed build's log goes to stderr."""
    start = time.perf_counter()
    env = dict(os.environ, MAX_JOBS=str(jobs))
    proc = subprocess.run(
        [sys.executable, "-c", f"import {package} as p; p.load()"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False,
    )
    error = "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]
    if proc.returncode != 0:
        sys.stderr.write(f"--- {package} build log ---\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}\n")
    return package, time.perf_counter() - start, error


def module_file(package: str, root: Path = REPO_ROOT) -> Path:
    """The file of a dotted package or module name (a package's __init__.py)."""
    path = root / package.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def package_exists(package: str) -> bool:
    return module_file(package).exists()


def defines_load(package: str) -> bool:
    """Whether a package's module defines a top-level load() (read, not imported)."""
    path = module_file(package)
    if not path.exists():
        return False
    body = ast.parse(path.read_text()).body
    named = {n.name for n in body if isinstance(n, ast.FunctionDef)}
    named |= {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return "load" in named


def extension_packages() -> list[str]:
    """Every package that owns a CUDA extension (its load() builds it): utils.ceilings, then each
    package of the course (a folder with __init__.py, one or two levels down) that defines load()."""
    found = [*REPO_ROOT.glob("*/__init__.py"), *REPO_ROOT.glob("*/*/__init__.py")]
    names = sorted(".".join(p.parent.relative_to(REPO_ROOT).parts) for p in found)
    return [*UTILS_EXTENSIONS, *(n for n in names if not n.startswith("utils") and defines_load(n))]


def build_all(packages=None) -> bool:
    """Build the given packages' extensions (default: every one) in parallel. Prints a line when a
    build starts and when it finishes (in the order they finish, with its time and how many are
    left), and what is still building: on a terminal a status line redrawn every second, in a log a
    line every minute (utils.progress). True if all built."""
    from utils.progress import Progress, duration, remaining

    check_setup()
    present = [p for p in (extension_packages() if packages is None else packages) if package_exists(p)]
    workers = max(1, min(len(present), os.cpu_count() or 1))
    jobs = max(1, (os.cpu_count() or 1) // workers)
    print(f"building {len(present)} extensions, {workers} at a time, "
          f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}", flush=True)
    progress = Progress()
    running: dict[str, float] = {}  # package -> when its build started (written by the pool's threads)

    def build(package: str):
        running[package] = time.perf_counter()
        progress.line(f"  {package:<24} building")
        try:
            return _build_one(package, jobs)
        finally:
            running.pop(package, None)

    ok, finished = True, 0
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        pending = {pool.submit(build, p) for p in present}
        while pending:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in done:
                package, seconds, error = future.result()
                finished += 1
                ok &= not error
                status = "ok" if not error else f"FAILED: {error}"
                left = remaining(finished, len(present), time.perf_counter() - start)
                progress.line(f"  {package:<24} {seconds:7.1f} s  {status}  [{finished}/{len(present)}"
                              f"{', ' + left if left else ''}]")
            now = time.perf_counter()
            if pending and running:
                progress.heartbeat(f"  building {', '.join(f'{p} ({duration(now - t)})' for p, t in list(running.items()))}"
                                   f", {finished}/{len(present)} done, {duration(now - start)}")
    progress.close()
    print(f"all builds: {time.perf_counter() - start:.1f} s", flush=True)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="build every phase's extension")
    parser.add_argument("packages", nargs="*", help="packages to build (names of lessons' packages)")
    args = parser.parse_args(argv)
    if not args.all and not args.packages:
        parser.error("name packages to build, or --all")
    try:
        return 0 if build_all(None if args.all else args.packages) else 1
    except BuildSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
