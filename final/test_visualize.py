"""final.visualize and final.report_gen run on the committed results (no GPU) and write non-empty,
deterministic files into a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from final import report_gen, visualize
from utils.build import REPO_ROOT

pytestmark = pytest.mark.skipif(not (REPO_ROOT / visualize.SOURCES["phase5"]).exists(),
                                reason="no committed phase 5 results to draw from")


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("final")
    written = report_gen.generate(out)
    assert {p.name for p in written} >= {*visualize.FIGURES, "report.md", "report.pdf"}
    return out


def test_every_figure_is_a_non_empty_png(report_dir):
    for name in visualize.FIGURES:
        data = (report_dir / "visualizations" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_same_results_same_bytes(report_dir, tmp_path):
    for path in visualize.render_all(tmp_path):
        assert path.read_bytes() == (report_dir / "visualizations" / path.name).read_bytes(), path.name


def test_report_sections_numbers_and_links(report_dir):
    text = (report_dir / "report.md").read_text()
    for section in ("## What worked, and why", "## What did not (yet)", "## Lessons", "## Future work", "## Figures"):
        assert section in text
    for name in visualize.FIGURES:
        assert f"(visualizations/{name})" in text
    docs = visualize.load_results()
    fused = visualize.headline_rows(docs["phase5"], 64, "float32")["phase5_fused"]
    from utils.readme import fmt

    assert f"| phase5_fused | {fmt(fused['ms'])} | {fmt(fused['tflops'])} |" in text  # read from the results
    assert docs["phase5"]["env"]["commit"] in text


def test_report_pdf(report_dir):
    data = (report_dir / "report.pdf").read_bytes()
    assert data.startswith(b"%PDF") and len(data) > 50_000
    assert b"/Count " in data  # a page tree: text pages, then one page per figure


def test_report_is_deterministic(report_dir, tmp_path):
    report_gen.generate(tmp_path, figures=False)
    assert (tmp_path / "report.md").read_text() == (report_dir / "report.md").read_text()


def test_roofline_has_every_phase():
    groups = {p["group"] for p in visualize.roofline_points_all(visualize.load_results())}
    assert {"phase 1: PyTorch eager", "phase 2: naive", "phase 3: tiled", "phase 4: coalesced",
            "phase 5: fused FP32", "phase 5: fused FP16 tensor cores", "phase 6: LayerNorm / MLP"} <= groups


def test_breakdown_read_from_the_end_to_end_benchmark_schema():
    """final.benchmark writes profile.by_impl.<impl>.share (attention, layer_norm, mlp, other)."""
    doc = {"rows": [], "profile": {"shape": {"B": 8, "S": 1024}, "by_impl": {
        "torch_eager": {"us": {"attention": 50.0, "layer_norm": 2.0, "mlp": 30.0, "other": 18.0},
                        "share": {"attention": 0.5, "layer_norm": 0.02, "mlp": 0.3, "other": 0.18}},
        "optimized": {"share": {"attention": 0.25, "layer_norm": 0.05, "mlp": 0.5, "other": None}}}}}
    bars = dict(visualize.final_breakdowns(doc))
    assert bars["torch_eager B=8 S=1024"] == pytest.approx({"attention": 0.5, "layer_norm": 0.02, "mlp": 0.3, "other": 0.18})
    assert sum(bars["optimized B=8 S=1024"].values()) == pytest.approx(1.0)


def test_no_results_writes_nothing(tmp_path):
    assert visualize.render_all(tmp_path / "v", root=tmp_path) == []
    assert report_gen.generate(tmp_path / "r", root=tmp_path) == []
