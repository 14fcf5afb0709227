"""The build helper's set-up checks: one clear line for each bad set-up (CPU only)."""


import pytest
import torch

from utils import build


def test_cpu_only_torch_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(build.BuildSetupError, match="CPU-only"):
        build.check_setup()


def test_missing_ninja_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build.sys, "executable", "/nonexistent/python")
    with pytest.raises(build.BuildSetupError, match="ninja"):
        build.check_setup()


def test_missing_toolkit_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build, "STANDARD_CUDA_HOMES", ())
    with pytest.raises(build.BuildSetupError, match="no CUDA toolkit"):
        build.find_cuda_home()


def fake_toolkit(root, release):
    (root / "bin").mkdir(parents=True)
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.0'\n")
    nvcc.chmod(0o755)
    return root


def test_toolkit_found_through_wrapper_script(monkeypatch, tmp_path):
    home = fake_toolkit(tmp_path / "cuda-13.0", "13.0")
    wrapper_dir = tmp_path / "bin"
    wrapper_dir.mkdir()
    (wrapper_dir / "nvcc").write_text(f"#!/bin/sh\nexec {home}/bin/nvcc \"$@\"\n")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: str(wrapper_dir / "nvcc"))
    assert build.find_cuda_home() == home


def test_major_version_mismatch_is_named(monkeypatch, tmp_path):
    home = fake_toolkit(tmp_path / "cuda", "12.4")
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(build.shutil, "which", lambda name: "/usr/bin/ninja" if name == "ninja" else None)
    with pytest.raises(build.BuildSetupError, match="CUDA 12.4 but torch was built with CUDA 13.0"):
        build.check_setup()


def test_arch_defaults_to_hopper_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build.gpu_arch() == "9.0"


def test_stale_torch_lock_is_removed(tmp_path):
    (tmp_path / "lock").write_text("")  # what a build killed halfway leaves behind
    with build._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_build_all_reports_failures(monkeypatch, capsys):
    monkeypatch.setattr(build, "check_setup", lambda: None)
    monkeypatch.setattr(build, "package_exists", lambda p: True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(build, "_build_one", lambda p, jobs: (p, 0.1, "" if p == "good" else "boom"))
    assert build.build_all(("good",)) is True
    assert build.build_all(("good", "bad")) is False
    assert "FAILED: boom" in capsys.readouterr().out


def test_extension_packages_are_the_packages_that_define_load():
    from utils.manifest import lessons

    found = build.extension_packages()
    assert found[0] == "utils.ceilings" and build.defines_load("utils.ceilings")
    assert not build.defines_load("utils.reference")
    # Every lesson whose folder holds kernels owns an extension, and nothing else is listed.
    with_kernels = [m["name"] for m in lessons() if any(m["_dir"].glob("*.cu"))]
    assert with_kernels and set(with_kernels) <= set(found)
    assert all(build.defines_load(p) for p in found)


def test_cuda_flags_reach_nvcc_of_that_extension_only(monkeypatch, tmp_path):
    """load_phase's cuda_flags are appended to the course's nvcc flags (a -gencode there replaces
    torch's TORCH_CUDA_ARCH_LIST targets); without them the flags are the course's own."""
    import torch.utils.cpp_extension as cpp_extension

    calls = []
    monkeypatch.setattr(build, "check_setup", lambda: tmp_path)
    monkeypatch.setattr(build, "BUILD_ROOT", tmp_path)
    monkeypatch.setattr(build, "_library_header_dirs", lambda: [])
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    gencode = "-gencode=arch=compute_90a,code=sm_90a"
    build.load_phase(tmp_path, "flags_a", ["x.cu"], cuda_flags=[gencode])
    build.load_phase(tmp_path, "flags_b", ["x.cu"])
    assert calls[0]["extra_cuda_cflags"] == [*build.NVCC_FLAGS, gencode]
    assert calls[1]["extra_cuda_cflags"] == build.NVCC_FLAGS
    assert build.NVCC_FLAGS == ["-O3", "-lineinfo"]  # the shared list is not modified
