"""The walkthrough notebook runs so it cannot rot: executed with nbclient in a fresh kernel, on its CPU
path everywhere and on its GPU path where there is a GPU; and it is committed with the outputs of a run.

COURSE_NOTEBOOK_CPU=1 makes the notebook take its CPU path even on a GPU box (its GPU cells build every
extension, which takes minutes). Skipped, with the reason, where nbclient or ipykernel is missing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from utils.testing import requires_gpu

NOTEBOOK = Path(__file__).resolve().parent / "walkthrough.ipynb"


def _execute(monkeypatch, cpu_path: bool, timeout: int) -> tuple[str, float]:
    """Run every cell in a fresh kernel (raises CellExecutionError, naming the cell, on any error);
    the text the cells printed and the seconds it took."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install nbclient)")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install ipykernel)")
    if cpu_path:
        monkeypatch.setenv("COURSE_NOTEBOOK_CPU", "1")
    else:
        monkeypatch.delenv("COURSE_NOTEBOOK_CPU", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    return outputs, seconds


def test_walkthrough_notebook_executes_cpu_path(monkeypatch):
    outputs, seconds = _execute(monkeypatch, cpu_path=True, timeout=180)
    assert "CPU path" in outputs and "relative error" in outputs
    assert "course_roofline.png" in outputs, "the figures were not redrawn"
    assert seconds < 120, f"the notebook's CPU path took {seconds:.0f} s"


@requires_gpu
def test_walkthrough_notebook_executes_gpu_path(monkeypatch):
    """What a student with a GPU sees: the extensions built, the FP32 kernel's tests and a short phase 3
    sweep run, and every CUDA mode of the unified API checked against the float64 reference."""
    outputs, _ = _execute(monkeypatch, cpu_path=False, timeout=900)
    assert "CPU path" not in outputs and "no GPU" not in outputs
    assert "passed" in outputs, "the notebook's pytest run printed no result"
    for mode in ("naive", "tiled", "coalesced", "fused", "auto"):
        assert f"{mode:<10} relative error" in outputs, f"mode {mode} was not checked"
    assert "course_roofline.png" in outputs, "the figures were not redrawn"


def test_notebook_is_committed_with_the_outputs_of_its_run():
    """A student who opens the notebook sees what it computes (`make run` re-executes it: utils.notebook):
    every code cell has its outputs, the figures among them, and no output names a path of the
    machine that ran it."""
    import json

    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("outputs") for c in code), "a code cell has no stored output: run python -m utils.notebook"
    assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"])
    stored = json.dumps([c["outputs"] for c in code])
    assert not any(root in stored for root in ("/home/", "/work/", "/tmp/", "/opt/", "/usr/")), "a machine's path"
    assert "\\u001b" not in stored, "terminal colour codes in a stored output"
    assert not any(o.get("output_type") == "error" for c in code for o in c["outputs"])
