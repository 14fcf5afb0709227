"""The walkthrough notebook runs (CPU path) so it cannot rot: executed with nbclient in a fresh kernel;
and it is committed with the outputs of a run.

COURSE_NOTEBOOK_CPU=1 makes the notebook take its CPU path even on a GPU box (its GPU cells build every
extension, which takes minutes). Skipped, with the reason, where nbclient or ipykernel is missing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent / "walkthrough.ipynb"


def test_walkthrough_notebook_executes_cpu_path(monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install nbclient)")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install ipykernel)")
    monkeypatch.setenv("COURSE_NOTEBOOK_CPU", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    seconds = time.perf_counter() - start
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "CPU path" in outputs and "relative error" in outputs
    assert "course_roofline.png" in outputs, "the figures were not redrawn"
    assert seconds < 120, f"the notebook's CPU path took {seconds:.0f} s"


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
    assert "/home/" not in stored and "/work/" not in stored and "/tmp/" not in stored
    assert not any(o.get("output_type") == "error" for c in code for o in c["outputs"])
