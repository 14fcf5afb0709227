"""The renderer: declared tables and plots from a results file, between one kind of marker."""

import json

import pytest

from utils import plots, render
from utils.manifest import load_manifest, peer_row, rows_at

ENV = {"gpu": "Test GPU", "sms": 1, "torch": "2.x", "cuda": "13.0", "driver": "1", "date": "2026-01-02T00:00:00",
       "commit": "abc1234"}
ROWS = [
    {"impl": "ours", "op": "attention", "B": 1, "H": 2, "Sq": 128, "Sk": 128, "D": 64, "dtype": "float32",
     "causal": False, "ms": 2.0, "tflops": 1.5, "gbps": 1500.0},
    {"impl": "peer", "op": "attention", "B": 1, "H": 2, "Sq": 128, "Sk": 128, "D": 64, "dtype": "float32",
     "causal": False, "ms": 1.0, "tflops": 3.0, "gbps": 3000.0},
    {"impl": "peer", "op": "attention", "B": 1, "H": 2, "Sq": 256, "Sk": 256, "D": 64, "dtype": "float32",
     "causal": False, "ms": 4.0, "tflops": 3.0, "gbps": 1000.0},
]
DOC = {"env": ENV, "ceilings": {"dram_TBps": 3.0, "fp32_TFLOPs": 50.0}, "rows": ROWS,
       "ncu": {"kernels": {"ours": [{"dram_bytes": 1e6, "l2_bytes": 2e6}, {"dram_bytes": 3e6}]}}}


def make_folder(tmp_path, tables=(), plots_=(), readme_tables=None):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "metrics.json").write_text(json.dumps(DOC))
    names = readme_tables if readme_tables is not None else [t["name"] for t in tables]
    body = "".join(f"Hand-written text.\n\n<!-- table:{n} -->\nold\n<!-- /table:{n} -->\n\nmore.\n" for n in names)
    (tmp_path / "README.md").write_text("# Title\n\n" + body)
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "t", "tables": list(tables), "plots": list(plots_)}))
    return load_manifest(tmp_path)


def test_table_rows_columns_and_peer_ratio(tmp_path):
    table = {"name": "t1", "where": {"Sq": 128}, "sort": ["ms"], "bold": {"impl": "ours"},
             "columns": [{"key": "impl"}, {"key": "ms"}, {"speedup_over": "peer"},
                         {"key": "gbps", "scale": 1e-3, "share_of": "dram_TBps", "label": "% of copy"}]}
    manifest = make_folder(tmp_path, [table])
    render.render_tables(manifest)
    text = (tmp_path / "README.md").read_text()
    assert "| impl | ms | × peer | % of copy |" in text
    assert "| peer | 1 | 1 | 100% |" in text
    assert "| **ours** | 2 | 0.5 | 50% |" in text
    assert "| peer | 4 |" not in text                     # other S filtered out
    assert "old" not in text and "Hand-written text." in text and "more." in text
    assert "Test GPU" in text and "abc1234" in text       # the environment line


def test_rendering_twice_changes_nothing(tmp_path):
    manifest = make_folder(tmp_path, [{"name": "t1", "columns": [{"key": "impl"}, {"key": "ms"}]}])
    render.render_tables(manifest)
    first = (tmp_path / "README.md").read_text()
    render.render_tables(manifest)
    assert (tmp_path / "README.md").read_text() == first


def test_declared_table_without_markers_is_refused(tmp_path):
    manifest = make_folder(tmp_path, [{"name": "t1", "columns": [{"key": "impl"}]}], readme_tables=[])
    with pytest.raises(ValueError, match="t1"):
        render.render_tables(manifest)


def test_targets_table_says_met_or_not(tmp_path):
    targets = {"name": "goals", "kind": "targets", "targets": [
        {"name": "ours at peer speed", "where": {"impl": "ours", "Sq": 128}, "peer": "peer", "at_least": 1.0},
        {"name": "half of copy", "where": {"impl": "ours", "Sq": 128}, "key": "gbps", "scale": 1e-3,
         "format": "pct", "at_least": 0.4}]}
    manifest = make_folder(tmp_path, [targets])
    render.render_tables(manifest)
    text = (tmp_path / "README.md").read_text()
    assert "| ours at peer speed | 0.50x | ≥ 1.00x | no |" in text
    assert "| half of copy | 150% | ≥ 40% | yes |" in text


def test_target_against_the_same_impl_on_another_problem(tmp_path):
    """`against`: the row's speed-up over the row of `where` with some fields changed (here the
    peer at S=128 over itself at S=256: 4 ms / 1 ms); a missing other row gives no value, not met."""
    targets = {"name": "goals", "kind": "targets", "targets": [
        {"name": "short over long", "where": {"impl": "peer", "Sq": 128}, "against": {"Sq": 256, "Sk": 256},
         "at_least": 4.0},
        {"name": "long over short", "where": {"impl": "peer", "Sq": 256}, "against": {"Sq": 128, "Sk": 128},
         "at_least": 1.0},
        {"name": "no such row", "where": {"impl": "ours", "Sq": 128}, "against": {"Sq": 256, "Sk": 256},
         "at_least": 1.0}]}
    manifest = make_folder(tmp_path, [targets])
    render.render_tables(manifest)
    text = (tmp_path / "README.md").read_text()
    assert "| short over long | 4.00x | ≥ 4.00x | yes |" in text
    assert "| long over short | 0.25x | ≥ 1.00x | no |" in text
    assert "| no such row | – | ≥ 1.00x | – |" in text


def test_a_target_value_that_rounds_to_its_bound_gets_more_digits():
    ratio, pct = {"format": "x"}, {"format": "pct"}
    assert render.measured_against(ratio, 0.9983, 1.0) == "0.998x"
    assert render.measured_against(ratio, 1.0004, 1.0) == "1.0004x"
    assert render.measured_against(ratio, 0.97, 1.0) == "0.97x"      # far enough: as formatted
    assert render.measured_against(ratio, 1.0, 1.0) == "1.00x"       # exactly the bound
    assert render.measured_against(pct, 0.7996, 0.8) == "79.96%"
    assert render.measured_against(pct, None, 0.8) == "–"


def test_target_on_a_share_of_a_ceiling(tmp_path):
    targets = {"name": "goals", "kind": "targets", "targets": [
        {"name": "90% of copy", "where": {"impl": "ours", "Sq": 128}, "key": "gbps", "scale": 1e-3,
         "share_of": "dram_TBps", "at_least": 0.9}]}
    manifest = make_folder(tmp_path, [targets])
    render.render_tables(manifest)
    assert "| 90% of copy | 50% | ≥ 90% | no |" in (tmp_path / "README.md").read_text()


def test_a_table_without_rows_says_so_instead_of_a_stamp(tmp_path):
    manifest = make_folder(tmp_path, [{"name": "t1", "where": {"Sq": 999}, "columns": [{"key": "impl"}]}])
    render.render_tables(manifest)
    text = (tmp_path / "README.md").read_text()
    assert "No rows yet: the run in metrics.json (commit abc1234) measured none of this table" in text
    assert "| impl |" not in text and "Test GPU" not in text


def test_missing_results_leave_a_note(tmp_path):
    manifest = make_folder(tmp_path, [{"name": "t1", "source": "results/none.json", "columns": [{"key": "impl"}]}])
    render.render_tables(manifest)
    assert "No results yet" in (tmp_path / "README.md").read_text()


def test_rows_at_flattens_records_by_impl():
    flat = rows_at(DOC, "ncu.kernels")
    assert [r["impl"] for r in flat] == ["ours", "ours"]
    assert rows_at({"a": {"x": {"t": 1}}}, "a") == [{"impl": "x", "t": 1}]


def test_peer_row_needs_the_same_problem():
    assert peer_row(ROWS, ROWS[0], "peer") is ROWS[1]
    assert peer_row(ROWS, {**ROWS[0], "Sq": 512}, "peer") is None


def test_plots_are_drawn(tmp_path):
    declared = [{"kind": "lines", "file": "results/lines.png", "title": "t", "where": {"op": "attention"},
                 "x": "Sq", "y": "tflops", "panels": ["D", "causal"], "logy": True},
                {"kind": "bars", "file": "results/bars.png", "title": "t", "group": ["Sq"], "y": "ms"},
                {"kind": "roofline", "file": "results/roof.png", "title": "t", "where": {"Sq": 128},
                 "ncu": {"levels": ["dram", "l2"]}}]
    manifest = make_folder(tmp_path, plots_=declared)
    drawn = plots.draw_all(manifest)
    assert [p.name for p in drawn] == ["lines.png", "bars.png", "roof.png"]
    assert all(p.stat().st_size > 1000 for p in drawn)
    assert plots.measured_bytes(declared[2], DOC) == {("ours",): {"dram": 4e6, "l2": 2e6}}


def test_no_two_implementations_share_a_colour():
    distinct = {name: c for name, c in plots.COLORS.items() if name not in plots.MODEL_ALIASES}
    assert len(set(distinct.values())) == len(distinct)
    assert all(plots.COLORS[m] == plots.COLORS[a] for m, a in plots.MODEL_ALIASES.items())
    assert not set(plots.COLORS.values()) & set(plots.FALLBACK)   # a named impl never yields its colour


def test_one_colour_per_implementation():
    assert plots.color("phase5_fused_tc_D64") == plots.color("phase5_fused_tc")
    assert plots.color("optimized_fp16") != plots.color("optimized")   # a model in FP16 is another impl
    assert sorted([(128,), (64,), ("x",), (8,)], key=plots.panel_order) == [(8,), (64,), (128,), ("x",)]
    assert plots.color("phase5_fused") != plots.color("phase5_fused_tc")
    assert plots.color("something_new") == plots.color("something_new")


def test_every_course_manifest_renders_its_tables(tmp_path):
    """Each manifest of the course has a marker for each declared table, and rendering the committed
    results into a copy of its README works."""
    from utils.manifest import manifests

    for path in manifests():
        manifest = load_manifest(path.parent)
        readme = manifest["_dir"] / manifest.get("readme", "README.md")
        copy = tmp_path / path.parent.name
        copy.mkdir()
        (copy / "README.md").write_text(readme.read_text())
        manifest["readme"] = str(copy / "README.md")
        render.render_tables(manifest)


def test_kernel_names_are_shortened_in_their_column():
    ncu = "void phase6::<unnamed>::layer_norm_cached_kernel<float, 4, 8, 1>(const T1 *, T1 *, int)"
    profiler = ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>"
                "(int, float, float const*)")
    assert render.kernel_name(ncu) == "layer_norm_cached_kernel<float, 4, 8, 1>"
    assert render.kernel_name(profiler) == "vectorized_layer_norm_kernel<float, float, false>"
    assert render.kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    assert render.formatted({"format": "kernel", "max_chars": 12}, ncu) == "`layer_norm_…`"
    assert render.formatted({"key": "tile", "max_chars": 5}, "registers") == "regi…"


def test_a_dict_of_values_reads_as_records():
    assert rows_at({"p": {"shares": {"a": 0.5, "b": 0.25}}}, "p.shares") == [
        {"impl": "a", "value": 0.5}, {"impl": "b", "value": 0.25}]


def test_a_list_of_wheres_accepts_any():
    from utils.manifest import matches

    where = [{"op": "mlp"}, {"op": "layer_norm", "rows": 8}]
    assert matches({"op": "mlp", "tokens": 4}, where) and matches({"op": "layer_norm", "rows": 8}, where)
    assert not matches({"op": "layer_norm", "rows": 4}, where)


def test_peer_row_agrees_on_model_and_gemm_shapes():
    rows = [{"impl": "peer", "op": "model", "B": 1, "S": 128, "ms": 1.0},
            {"impl": "peer", "op": "model", "B": 1, "S": 256, "ms": 2.0},
            {"impl": "peer", "op": "linear1", "M": 8, "N": 16, "K": 4, "ms": 3.0}]
    assert peer_row(rows, {"impl": "ours", "op": "model", "B": 1, "S": 256}, "peer") is rows[1]
    assert peer_row(rows, {"impl": "ours", "op": "linear1", "M": 8, "N": 16, "K": 8}, "peer") is None


def test_bar_line_at_a_measured_ceiling(tmp_path):
    plot = {"kind": "bars", "file": "results/bars.png", "title": "t", "group": ["Sq"], "y": "gbps",
            "hline": {"ceiling": "dram_TBps", "scale": 1000, "label": "DRAM copy, GB/s"}}
    assert plots.with_ceiling_line(plot, DOC["ceilings"])["hline"] == {"y": 3000.0, "label": "DRAM copy, GB/s 3,000"}
    manifest = make_folder(tmp_path, plots_=[plot])
    assert [p.name for p in plots.draw_all(manifest)] == ["bars.png"]


def test_speedup_on_another_field_and_dotted_keys(tmp_path):
    """A speed-up (column or target) may compare another field than ms; a dotted key reads a
    nested field."""
    doc = {"env": ENV, "ceilings": {}, "rows": [
        {"impl": "ours", "op": "model", "B": 8, "S": 64, "ms": 2.0, "gpu_ms": 1.0, "us": {"mlp": 500.0}},
        {"impl": "peer", "op": "model", "B": 8, "S": 64, "ms": 1.0, "gpu_ms": 2.0, "us": {"mlp": 250.0}}]}
    table = {"name": "t1", "columns": [{"key": "impl"}, {"speedup_over": "peer", "format": "x"},
                                       {"speedup_over": "peer", "key": "gpu_ms", "label": "gpu", "format": "x"},
                                       {"key": "us.mlp", "scale": 1e-3, "label": "mlp ms"},
                                       {"key": "us.none", "label": "none"}]}
    targets = {"name": "goals", "kind": "targets", "targets": [
        {"name": "wall", "where": {"impl": "ours"}, "peer": "peer", "at_least": 1.0},
        {"name": "kernels", "where": {"impl": "ours"}, "peer": "peer", "key": "gpu_ms", "at_least": 1.0},
        {"name": "graph", "where": {"impl": "ours"}, "peer": "peer", "key": "graph_ms", "at_least": 1.0}]}
    manifest = make_folder(tmp_path, [table, targets])
    (tmp_path / "results" / "metrics.json").write_text(json.dumps(doc))
    render.render_tables(manifest)
    text = (tmp_path / "README.md").read_text()
    assert "| ours | 0.50x | 2.00x | 0.5 | – |" in text
    assert "| wall | 0.50x | ≥ 1.00x | no |" in text and "| kernels | 2.00x | ≥ 1.00x | yes |" in text
    assert "| graph | – | ≥ 1.00x | – |" in text           # a field not measured yet


def test_plots_read_several_sources_and_several_fields(tmp_path):
    """`sources` gather rows from several results files (a missing one is left out) under one stamp;
    a `y` listing several fields draws a series per field."""
    manifest = make_folder(tmp_path)
    other = {**DOC, "env": {**ENV, "commit": "def5678"}, "rows": [{**ROWS[0], "impl": "theirs", "op": "softmax"}]}
    (tmp_path / "results" / "other.json").write_text(json.dumps(other))
    sources = [{"source": "results/metrics.json", "ncu": {"levels": ["dram"]}},
               {"source": "results/other.json", "label_by": ["op"]}, {"source": "results/missing.json"}]
    roof = {"kind": "roofline", "file": "results/roof.png", "title": "t", "where": {"Sq": 128}, "sources": sources}
    parts = plots.loaded_sources(roof, manifest)
    assert [[r["impl"] for r in rows] for rows, _ in parts] == [["ours", "peer"], ["theirs"]]
    assert parts[0][0][0]["ncu_bytes"] == {"dram": 4e6} and parts[1][0][0]["ncu_bytes"] == {}
    assert "label_by" not in parts[0][0][0] and parts[1][0][0]["label_by"] == ["op"]   # a source's own labels
    assert plots.stamp([d["env"] for _, d in parts]).endswith("commits abc1234/def5678")
    bars = {"kind": "bars", "file": "results/bars.png", "title": "t", "group": "impl", "y": ["ms", "gbps"], "logy": True}
    plot, rows = plots.melted(bars, ROWS[:2])
    assert [(r["impl"], r["field"], r["value"]) for r in rows][:2] == [("ours", "ms", 2.0), ("ours", "gbps", 1500.0)]
    assert plot["series"] == "field" and plot["y"] == "value"
    assert plots.bar_series(*plots.melted({**bars, "y": ["ms", "none"]}, ROWS[:2])) == ["ms"]   # no empty series
    manifest = {**manifest, "plots": [roof, bars]}
    assert [p.name for p in plots.draw_all(manifest)] == ["roof.png", "bars.png"]
    assert plots.draw({**roof, "sources": [{"source": "results/missing.json"}]}, manifest) is None
    assert plots.draw({**bars, "where": {"impl": "not measured yet"}}, manifest) is None   # no empty figure


def test_ncu_records_named_by_a_format_of_the_row(tmp_path):
    """`ncu.name` matches records stored under a name made of the row's fields (impl_D64)."""
    manifest = make_folder(tmp_path)
    doc = {**DOC, "ncu": {"kernels": {"ours_D64": {"dram_bytes": 5e6}, "ours_D128": {"dram_bytes": 7e6}}}}
    (tmp_path / "results" / "metrics.json").write_text(json.dumps(doc))
    roof = {"kind": "roofline", "file": "results/roof.png", "title": "t", "where": {"Sq": 128},
            "ncu": {"name": "{impl}_D{D}", "levels": ["dram"]}}
    [(rows, _)] = plots.loaded_sources(roof, manifest)
    assert {r["impl"]: r["ncu_bytes"] for r in rows} == {"ours": {"dram": 5e6}, "peer": {}}


def test_series_of_one_figure_never_share_a_fallback_colour():
    assert plots.color("4096") == plots.color("16384")   # the hashed fallback collides here
    colors = plots.figure_colors(["4096", "16384", "phase5_fused"])
    assert colors["4096"] != colors["16384"] and colors["phase5_fused"] == plots.color("phase5_fused")
    assert colors["4096"] == plots.color("4096")            # the first keeps its course-wide colour


def test_roofline_floor_narrows_the_intensities():
    """`ymin` cuts the empty left part of a Roofline (where the DRAM roof is under the floor), never a point."""
    assert plots.x_range({}, [100.0, 2000.0], 3e12) == (0.05, 6000.0)
    lo, _ = plots.x_range({"ymin": 10}, [100.0, 2000.0], 3e12)
    assert lo == pytest.approx(10e12 / 3e12 / 2)
    assert plots.x_range({"ymin": 10}, [1.0], 3e12)[0] <= 1.0 / 3
