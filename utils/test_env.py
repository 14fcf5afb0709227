"""utils/env.sh, the set-up script: which interpreter it picks, and what it says before installing (CPU;
nothing is installed: every case stops before pip)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from utils.build import REPO_ROOT

CORE = "import torch, ninja, numpy, matplotlib, pytest"


def course_copy(tmp_path: Path) -> Path:
    """The files env.sh reads (itself, pyproject.toml, utils.build) in a fresh folder."""
    (tmp_path / "utils").mkdir(parents=True)
    for rel in ("utils/env.sh", "utils/build.py", "utils/__init__.py", "pyproject.toml"):
        shutil.copy(REPO_ROOT / rel, tmp_path / rel)
    return tmp_path


def env_sh(root: Path, bin_dir: Path | None = None, *args: str, **env) -> subprocess.CompletedProcess:
    """Run the copy's env.sh (bin_dir first on PATH), without the caller's COURSE_* settings."""
    base = {k: v for k, v in os.environ.items() if k not in ("COURSE_PYTHON", "COURSE_TORCH")}
    if bin_dir is not None:
        base["PATH"] = f"{bin_dir}{os.pathsep}{base['PATH']}"
    return subprocess.run(["sh", str(root / "utils" / "env.sh"), *args], capture_output=True, text=True,
                          env={**base, **env}, timeout=120)


def python3_without_torch(tmp_path: Path) -> Path:
    """A `python3` first on PATH that runs this interpreter but fails the core-dependency check, as
    a fresh machine's python3 would (so env.sh goes on to set up .venv)."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    script = bin_dir / "python3"
    script.write_text(f'#!/bin/sh\ncase "$*" in *"{CORE}"*) exit 1 ;; esac\nexec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return bin_dir


def test_the_course_python_file_names_the_interpreter(tmp_path):
    root = course_copy(tmp_path / "kit")
    (root / ".course-python").write_text(sys.executable + "\n")
    proc = env_sh(root, COURSE_TORCH="none")  # (were the file passed over, the set-up would stop at once)
    assert proc.returncode == 0 and proc.stdout.strip() == sys.executable and not (root / ".venv").exists()


def test_a_stale_course_python_file_is_passed_over(tmp_path):
    root = course_copy(tmp_path / "kit")
    (root / ".course-python").write_text("/nonexistent/python\n")
    # on to the set-up, which an invalid COURSE_TORCH stops before anything is installed
    proc = env_sh(root, python3_without_torch(tmp_path), COURSE_TORCH="tpu")
    assert proc.returncode == 2 and proc.stdout == "" and not (root / ".venv").exists()
    assert "COURSE_TORCH must be cuda or cpu, got 'tpu'" in proc.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the choice without a GPU")
def test_the_plan_without_a_gpu_follows_the_toolkit(tmp_path):
    """Without a GPU: torch's CUDA build where a toolkit compiles the kernels (they need its CUDA
    libraries), the CPU-only build where nothing can compile them; said with the size, before
    anything is installed (--plan stops there)."""
    from utils.build import toolkit_available

    if toolkit_available():
        with_toolkit = env_sh(course_copy(tmp_path / "a"), None, "--plan")
        assert with_toolkit.returncode == 0 and with_toolkit.stdout == ""
        assert "torch's CUDA build from PyPI (no GPU, but the CUDA toolkit in" in with_toolkit.stderr
        assert "GB installed" in with_toolkit.stderr and "ninja numpy matplotlib pytest" in with_toolkit.stderr
    # no toolkit: none in the environment, on PATH or in the standard places (a copy of utils.build
    # that knows none)
    root = course_copy(tmp_path / "b")
    build = root / "utils" / "build.py"
    build.write_text(build.read_text().replace('STANDARD_CUDA_HOMES = ("/usr/local/cuda", "/opt/cuda")',
                                               "STANDARD_CUDA_HOMES = ()"))
    bin_dir = python3_without_torch(tmp_path)
    bare = env_sh(root, None, "--plan", PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", CUDA_HOME="",
                  CUDA_PATH="")
    assert bare.returncode == 0 and bare.stdout == "" and not (root / ".venv").exists(), bare.stderr
    assert "torch's CPU-only build from https://download.pytorch.org/whl/cpu (no GPU and no CUDA toolkit" in bare.stderr
    forced = env_sh(root, None, "--plan", PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", CUDA_HOME="",
                    CUDA_PATH="", COURSE_TORCH="cuda")
    assert "torch's CUDA build from PyPI (COURSE_TORCH=cuda)" in forced.stderr
