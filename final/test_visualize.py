"""final/'s tables and figures, and the top-level README's, drawn by the shared renderer from the
results files (no GPU): every declaration renders, a missing results file leaves a note, the targets
table judges the figure it names, and the benchmark's launch figures reach the rows it reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from final import benchmark as bm
from utils import plots, render
from utils.build import REPO_ROOT
from utils.manifest import load_manifest

FINAL = REPO_ROOT / "final"
ENV = {"gpu": "Test GPU", "sms": 1, "torch": "2.x", "cuda": "13.0", "driver": "1", "date": "2026-01-02T00:00:00",
       "commit": "abc1234"}


def rendered(folder: Path, tmp_path: Path) -> str:
    """The folder's README with its declared tables rendered, written to a copy (the README stays as it is)."""
    manifest = load_manifest(folder)
    copy = tmp_path / "README.md"
    shutil.copy(folder / manifest.get("readme", "README.md"), copy)
    render.render_tables({**manifest, "readme": str(copy)})
    return copy.read_text()


def fake_final(tmp_path: Path, doc: dict | None) -> dict:
    """final's manifest and README in a temporary folder, with `doc` as its results (none if None)."""
    shutil.copy(FINAL / "manifest.json", tmp_path / "manifest.json")
    shutil.copy(FINAL / "README.md", tmp_path / "README.md")
    if doc is not None:
        (tmp_path / "results").mkdir()
        (tmp_path / "results" / "metrics.json").write_text(json.dumps(doc))
    return load_manifest(tmp_path)


def model_row(impl: str, dtype: str, ms: float, **fields) -> dict:
    return {"impl": impl, "op": "model", "B": 8, "S": 1024, "dtype": dtype, "ms": ms,
            "tokens_per_s": 8192 / (ms * 1e-3), "extra_mb": 1.0, **fields}


def test_final_tables_render_from_the_committed_results(tmp_path):
    text = rendered(FINAL, tmp_path)
    for name in ("model", "targets", "breakdown", "grid"):
        body = text.split(f"<!-- table:{name} -->")[1].split(f"<!-- /table:{name} -->")[0]
        assert body.count("\n|") >= 3 and "final/results/metrics.json" in body, name
    assert "| FP16 optimized_fp16 ≥ torch_sdpa_fp16, wall time of one call (B=8, S=1024) |" in text
    assert "| FP16 optimized_fp16 ≥ torch_sdpa_fp16, GPU kernel time (profiler) |" in text


def test_top_level_tables_render(tmp_path):
    text = rendered(REPO_ROOT, tmp_path)
    for name in ("phase1_share", "attention_fp32", "attention_fp16", "attention_hopper", "attention_backward",
                 "layer_norm", "mlp"):
        assert f"<!-- table:{name} -->\n|" in text or f"<!-- table:{name} -->\n_No results yet" in text, name
    assert "results:begin" not in text


def test_targets_judge_the_figure_they_name(tmp_path):
    """Wall time says met, kernel time and CUDA-graph time say not met: each line its own verdict; a
    figure a run did not measure shows – (the committed results predate gpu_ms and graph_ms)."""
    rows = [model_row("torch_sdpa", "float32", 6.0, gpu_ms=5.0),
            model_row("optimized", "float32", 7.0, gpu_ms=5.5),
            model_row("torch_sdpa_fp16", "float16", 3.0, gpu_ms=0.8, graph_ms=0.9),
            model_row("optimized_fp16", "float16", 2.9, gpu_ms=1.0, graph_ms=1.1)]
    manifest = fake_final(tmp_path, {"env": ENV, "ceilings": {}, "rows": rows})
    render.render_tables(manifest)
    text = (tmp_path / "README.md").read_text()
    assert "| FP16 optimized_fp16 ≥ torch_sdpa_fp16, wall time of one call (B=8, S=1024) | 1.03x | ≥ 1.00x | yes |" in text
    assert "| FP16 optimized_fp16 ≥ torch_sdpa_fp16, GPU kernel time (profiler) | 0.80x | ≥ 1.00x | no |" in text
    assert "| FP16 optimized_fp16 ≥ torch_sdpa_fp16, CUDA graph replay | 0.82x | ≥ 1.00x | no |" in text
    assert "| **optimized** | float32 | 7 | 5.5 | – | – |" in text      # back-to-back and graph not measured


def test_missing_results_leave_notes_not_errors(tmp_path):
    manifest = fake_final(tmp_path, None)
    render.render_tables(manifest)
    text = (tmp_path / "README.md").read_text()
    assert text.count("_No results yet: ") == len(manifest["tables"])  # one note per table, naming its file
    assert text.count("_No results yet: metrics.json is written by a GPU run._") == len(
        [t for t in manifest["tables"] if "source" not in t])
    drawn = [plots.draw(plot, manifest) for plot in manifest["plots"] if "sources" not in plot]
    assert drawn and drawn == [None] * len(drawn)


def test_every_figure_is_drawn_the_same_twice(tmp_path):
    """Each declared figure of final/ is a PNG drawn from the results files (into a temporary
    folder), and the same results give the same bytes."""
    manifest = load_manifest(FINAL)
    for plot in manifest["plots"]:
        name = Path(plot["file"]).name
        first = plots.draw({**plot, "file": str(tmp_path / "a" / name)}, manifest)
        second = plots.draw({**plot, "file": str(tmp_path / "b" / name)}, manifest)
        if first is None:   # none of its results files written yet
            continue
        data = first.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        assert data == second.read_bytes(), name


def test_launch_figures_join_the_profile_shape_rows(monkeypatch):
    """The benchmark gives each row at the profile shape its kernel time (from the profile), its
    back-to-back time and its CUDA-graph time; a capture failure is noted, other shapes are left alone."""
    monkeypatch.setattr(bm, "DEVICE", "cpu")
    monkeypatch.setattr(bm, "back_to_back_ms", lambda fn: (fn(), 1.5)[1])

    def graph_ms(fn):
        if fn() == "torch_sdpa_fp16":
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.9

    monkeypatch.setattr(bm, "graph_ms", graph_ms)
    models = bm.Models([])
    monkeypatch.setattr(models, "get", lambda impl: lambda idx: impl)
    rows = [model_row("optimized_fp16", "float16", 2.9), model_row("torch_sdpa_fp16", "float16", 3.0),
            model_row("torch_sdpa_compiled", "float32", 6.0), {**model_row("optimized", "float32", 1.0), "S": 128}]
    profile = {"by_impl": {"optimized_fp16": {"total_gpu_us": 1060.0}, "torch_sdpa_fp16": {"total_gpu_us": 850.0}}}
    notes: list[str] = []
    bm.add_launch_figures(rows, profile, models, notes)
    fp16, peer, compiled, other = rows
    assert (fp16["gpu_ms"], fp16["b2b_ms"], fp16["graph_ms"]) == (pytest.approx(1.06), 1.5, 0.9)
    assert peer["gpu_ms"] == pytest.approx(0.85) and peer["graph_ms"] is None
    assert notes == ["torch_sdpa_fp16: CUDA graph capture failed: RuntimeError: operation not permitted when "
                     "stream is capturing"]
    assert compiled["gpu_ms"] is None and compiled["graph_ms"] is None   # not profiled, never captured
    assert "gpu_ms" not in other
