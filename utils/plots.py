"""The plots a manifest declares, drawn from results files (utils/MANIFEST.md lists each kind).

    lines     one field against another, a line per series, a panel per value of `panels`
    bars      one field per row, grouped by `group`, a bar per series
    roofline  the rows at their FLOP/byte models (a colour per impl; `label_by` fields written beside each point), under the measured ceilings; ncu's DRAM, L2 and
              L1 bytes per impl move each point to its measured intensity at that level

Every implementation has one colour across the course (COLORS, then a stable fallback), every
figure carries its environment stamp, and legends sit outside the axes so that no point hides.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from utils import roofline
from utils.manifest import field, load_doc, matches, rows_at

# One colour per implementation, wherever it is drawn; the end-to-end models share the colour of the
# attention they run (MODEL_ALIASES), and no other two implementations share one.
COLORS = {
    "torch_naive": "#7f7f7f", "sdpa_math": "#bcbd22", "sdpa_efficient": "#17becf", "sdpa_flash": "#1f77b4",
    "sdpa_cudnn": "#9467bd", "cublas": "#8c564b", "torch_layer_norm": "#525252", "torch_mlp": "#bd9e39",
    "torch_mlp_compiled": "#e7cb94", "torch_eager": "#7f7f7f", "torch_sdpa": "#1f77b4",
    "torch_sdpa_compiled": "#aec7e8",
    "phase2_naive": "#d62728", "phase3_tiled_t8": "#ffbb78", "phase3_tiled_t16": "#ff7f0e",
    "phase3_tiled_t32": "#e377c2", "phase4_coalesced": "#2ca02c", "phase5_fused_teaching": "#98df8a",
    "phase5_fused": "#006400", "phase5_fused_tc": "#000080", "phase6_layer_norm": "#e7ba52",
    "phase6_mlp": "#8ca252", "optimized": "#006400", "optimized_fp16": "#a55194", "torch_sdpa_fp16": "#e7969c",
    "optimized_cublas_mlp": "#b5cf6b",
    "phase5_fused_hopper": "#ff00ff", "phase5_fused_hopper_v1_wgmma_tma": "#fdae6b",
    "phase5_fused_hopper_v2_warp_specialized": "#9e9ac8", "phase5_fused_hopper_v3_intra_overlap": "#c49c94",
    "phase5_fused_hopper_v4_pingpong": "#ad494a", "phase5_fused_hopper_v5_tiles": "#4d9221",
    "phase5_fused_hopper_v6_persistent": "#c51b7d", "phase5_fused_hopper_v7_split_tail": "#01665e",
    "phase5_fused_hopper_v8_stream_k": "#8073ac",
    "phase5_fused_bwd": "#74c476", "phase5_fused_bwd_tc": "#6baed6",
    "phase5_decode": "#d94801", "phase5_decode_paged": "#fdd0a2", "phase5_decode_cuda_cores": "#a63603",
}
MODEL_ALIASES = {"torch_eager": "torch_naive", "torch_sdpa": "sdpa_flash", "optimized": "phase5_fused"}
FALLBACK = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354"]
LEVEL_STYLE = {"dram": ("o", "DRAM"), "l2": ("s", "L2"), "l1": ("^", "L1/shared")}
CEILING_LABELS = {"fp32_TFLOPs": "FP32 FFMA peak", "sgemm_TFLOPs": "cuBLAS SGEMM",
                  "tf32_tc_TFLOPs": "TF32 tensor cores", "fp16_tc_TFLOPs": "FP16 tensor cores",
                  "bf16_tc_TFLOPs": "BF16 tensor cores"}


def color(impl: str) -> str:
    for name in sorted(COLORS, key=len, reverse=True):   # phase5_fused_tc_D64 -> phase5_fused_tc
        if impl == name or impl.startswith(name + "_"):
            return COLORS[name]
    return FALLBACK[zlib.crc32(impl.encode()) % len(FALLBACK)]


def figure_colors(names) -> dict:
    """color() of each series of one figure, except that a fallback colour already taken in the
    figure moves to a free one half the palette away (neighbours look alike), so that two series
    never share a colour (S=4096 and 16384)."""
    out: dict = {}
    for name in names:
        c = color(name)
        if c in FALLBACK and c in out.values():
            start = (FALLBACK.index(c) + len(FALLBACK) // 2) % len(FALLBACK)
            c = next((f for f in FALLBACK[start:] + FALLBACK[:start] if f not in out.values()), c)
        out[name] = c
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def stamp(env: dict | list[dict]) -> str:
    """Where and when the results were measured; for several results files, each GPU, torch and CUDA
    once, the dates and the commits."""
    if isinstance(env, list):
        def each(key: str, n: int | None = None) -> str:
            return "/".join(sorted({e[key][:n] for e in env}))
        return f"{each('gpu')}, torch {each('torch')}, CUDA {each('cuda')}, {each('date', 10)}, commits {each('commit')}"
    return f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date'][:10]}, commit {env['commit']}"


def series_name(row: dict, keys) -> str:
    keys = [keys] if isinstance(keys, str) else keys
    return " ".join(str(row.get(k)) for k in keys)


def panel_order(key_values: tuple) -> tuple:
    """Panels in the order of their values: numbers by value (D=64 before D=128), then the rest as text."""
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in key_values)


def panel_title(key_values: tuple, keys: list[str]) -> str:
    parts = []
    for k, v in zip(keys, key_values):
        parts.append(("causal" if v else "non-causal") if k == "causal" else f"{k}={v}")
    return ", ".join(parts)


def draw_lines(plot: dict, rows: list[dict], env: dict, path: Path) -> None:
    plt = _pyplot()
    panels_by = plot.get("panels", [])
    panels = sorted({tuple(r.get(k) for k in panels_by) for r in rows}, key=panel_order) or [()]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 2.2, 4.2), squeeze=False)
    colors = figure_colors(dict.fromkeys(series_name(r, plot.get("series", "impl")) for r in rows))
    for ax, key in zip(axes[0], panels):
        subset = [r for r in rows if tuple(r.get(k) for k in panels_by) == key]
        for name in dict.fromkeys(series_name(r, plot.get("series", "impl")) for r in subset):
            pts = sorted((r[plot["x"]], r[plot["y"]]) for r in subset
                         if series_name(r, plot.get("series", "impl")) == name and r.get(plot["y"]) is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3.5, label=name,
                    color=colors[name])
        ax.set_xscale("log", base=2) if plot.get("logx", True) else None
        ax.set_yscale("log") if plot.get("logy", False) else None
        ax.set_xlabel(plot.get("xlabel", plot["x"]))
        ax.set_ylabel(plot.get("ylabel", plot["y"]))
        ax.set_title(panel_title(key, panels_by), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    _finish(fig, plt, plot["title"], env, path, right=1 - 2.0 / fig.get_figwidth())


def draw_bars(plot: dict, rows: list[dict], env: dict, path: Path) -> None:
    plt = _pyplot()
    groups = list(dict.fromkeys(series_name(r, plot["group"]) for r in rows))
    series = bar_series(plot, rows)
    colors = figure_colors(series)
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) + 3), 4.4))
    for n, name in enumerate(series):
        xs, ys = [], []
        for g, group in enumerate(groups):
            found = [r for r in rows if series_name(r, plot["group"]) == group
                     and series_name(r, plot.get("series", "impl")) == name and r.get(plot["y"]) is not None]
            if found:
                xs.append(g + (n - (len(series) - 1) / 2) * width)
                ys.append(found[0][plot["y"]] * plot.get("scale", 1))
        ax.bar(xs, ys, width, label=name, color=colors[name])
    ax.set_xticks(range(len(groups)), groups, rotation=30 if len(groups) > 4 else 0, ha="right" if len(groups) > 4 else "center",
                  fontsize=8)
    ax.set_xlabel(plot.get("xlabel", " ".join([plot["group"]] if isinstance(plot["group"], str) else plot["group"])))
    ax.set_ylabel(plot.get("ylabel", plot["y"]))
    ax.set_yscale("log") if plot.get("logy", False) else None
    if "hline" in plot:   # named in the legend, so that no bar hides its label
        ax.axhline(plot["hline"]["y"], color="black", linestyle="--", linewidth=1, label=plot["hline"]["label"])
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _finish(fig, plt, plot["title"], env, path)


def bar_series(plot: dict, rows: list[dict]) -> list[str]:
    """The series of a bar plot that have at least one value (a field not measured yet gets no bar
    and no legend entry)."""
    return list(dict.fromkeys(series_name(r, plot.get("series", "impl")) for r in rows if r.get(plot["y"]) is not None))


def draw_roofline(plot: dict, rows: list[dict], env: dict, path: Path, doc: dict) -> None:
    """Each row at its analytic intensity (filled, the minimum bytes) and, where ncu measured the
    impl's bytes, at its measured intensity per memory level (hollow, joined to the filled one)."""
    plt = _pyplot()
    ceilings = doc["ceilings"]
    points = []
    for r in rows:
        model = roofline.row_model(r)
        if model is None or not r.get("ms"):
            continue
        flops, nbytes = model
        points.append((r["impl"], r, flops, nbytes, r["ms"]))
    fig, ax = plt.subplots(figsize=(10.5, 6))
    intensities = [f / b for _, _, f, b, _ in points] + [
        f / m for _, row, f, _, _ in points for m in row.get("ncu_bytes", {}).values() if m]
    bandwidth = ceilings["dram_TBps"] * 1e12
    lo, hi = x_range(plot, intensities, bandwidth)
    xs = [lo * (hi / lo) ** (t / 200) for t in range(201)]
    for n, key in enumerate(k for k in plot.get("ceilings", ["fp32_TFLOPs", "sgemm_TFLOPs"]) if k in ceilings):
        peak = ceilings[key] * 1e12
        ax.plot(xs, [min(peak, bandwidth * x) / 1e12 for x in xs], linestyle=["-", "--", "-.", ":"][n % 4],
                color="black", linewidth=1.1)
        ax.annotate(f"{CEILING_LABELS.get(key, key)} {ceilings[key]:.0f} TFLOP/s", (hi, peak / 1e12), ha="right",
                    va="bottom" if n % 2 == 0 else "top", fontsize=8)
    top = max(ceilings.get(k, 0) for k in plot.get("ceilings", ["fp32_TFLOPs"])) * 1e12
    for level, key in (("dram", "dram_TBps"), ("l2", "l2_TBps"), ("l1", "l1_TBps")):
        if ceilings.get(key):   # the memory roofs the ceilings file has: DRAM, and L2 and L1/shared once measured
            slope = ceilings[key] * 1e12
            if level != "dram":   # the DRAM roof is drawn with the compute ceilings above
                ax.plot(xs, [min(top, slope * x) / 1e12 for x in xs], color="gray", linewidth=0.9, linestyle=":")
            x_at = max(lo, plot.get("ymin", 0) * 1e12 / slope) * 1.5   # where the roof is in view
            ax.annotate(f"{LEVEL_STYLE[level][1]} {ceilings[key]:.1f} TB/s", (x_at, slope * x_at / 1e12), fontsize=7,
                        va="bottom", rotation=0)
    labelled = set()
    for name, row, flops, nbytes, ms in points:
        y = flops / (ms * 1e-3) / 1e12
        c = color(name)
        ax.scatter([flops / nbytes], [y], color=c, zorder=3, s=30, label=None if name in labelled else name)
        labelled.add(name)
        detail = series_name(row, [k for k in row.get("label_by", plot.get("label_by", [])) if k in row])
        if detail:
            ax.annotate(detail, (flops / nbytes, y), xytext=(4, 3), textcoords="offset points", fontsize=7, color=c)
        for level, level_bytes in row.get("ncu_bytes", {}).items():
            if level_bytes:
                marker = LEVEL_STYLE[level][0]
                ax.scatter([flops / level_bytes], [y], facecolors="none", edgecolors=[c], marker=marker, zorder=3, s=30)
                ax.plot([flops / level_bytes, flops / nbytes], [y, y], color=c, linewidth=0.6, alpha=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    if plot.get("ymin"):
        ax.set_ylim(bottom=plot["ymin"])
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    levels = sorted({lv for r in rows for lv, b in r.get("ncu_bytes", {}).items() if b}, key=list(LEVEL_STYLE).index)
    if levels:
        key = "; ".join(f"{LEVEL_STYLE[lv][0]} {LEVEL_STYLE[lv][1]}" for lv in levels)
        ax.text(0.01, 0.99, f"filled: minimum bytes; hollow (ncu bytes): {key}", transform=ax.transAxes,
                fontsize=7, va="top")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _finish(fig, plt, plot["title"], env, path)


def x_range(plot: dict, intensities: list[float], bandwidth: float) -> tuple[float, float]:
    """The intensities a Roofline spans: every point with room around it; with `ymin` (TFLOP/s, the
    floor of the plot, which spreads points of close speeds apart), no further left than where the
    DRAM roof meets half of it, unless a point lies there."""
    lo = min([0.05] + [i / 3 for i in intensities])
    if plot.get("ymin"):
        lo = max(lo, min([plot["ymin"] * 1e12 / bandwidth / 2] + [i / 3 for i in intensities]))
    return lo, max([2000.0] + [i * 3 for i in intensities])


def ncu_key(plot: dict, record: dict) -> tuple:
    """Which ncu records belong to a row: those that agree on the fields of `ncu.by` (impl)."""
    return tuple(record.get(k) for k in plot.get("ncu", {}).get("by", ["impl"]))


def row_ncu_key(plot: dict, row: dict) -> tuple:
    """A results row's ncu_key; with `ncu.name`, the name its records are stored under, a format of
    the row's fields ("{impl}_D{D}": records named phase5_fused_tc_D64)."""
    name = plot.get("ncu", {}).get("name")
    return (name.format(**row),) if name else ncu_key(plot, row)


def measured_bytes(plot: dict, doc: dict) -> dict:
    """ncu_key -> {level: bytes summed over its kernels} from the declared ncu records."""
    spec = plot.get("ncu")
    if not spec:
        return {}
    fields = {"dram": "dram_bytes", "l2": "l2_bytes", "l1": "l1_bytes"}   # as utils.ncu derives them
    out: dict = {}
    for r in rows_at(doc, spec.get("rows", "ncu.kernels")):
        if not matches(r, spec.get("where", {})) or "impl" not in r:
            continue
        per = out.setdefault(ncu_key(plot, r), {})
        for level in spec.get("levels", ["dram"]):
            value = r.get(fields[level])
            if value is not None:
                per[level] = per.get(level, 0.0) + value
    return out


def _finish(fig, plt, title: str, env: dict, path: Path, right: float | None = None) -> None:
    fig.suptitle(f"{title}\n{stamp(env)}", fontsize=9)
    fig.tight_layout(rect=(0, 0, right or 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def draw(plot: dict, manifest: dict) -> Path | None:
    """Draw one declared plot; None where its results file does not exist yet or holds none of its
    rows (a plot declared before the run that measures it: an empty figure says nothing)."""
    parts = loaded_sources(plot, manifest)
    if not any(part_rows for part_rows, _ in parts):
        return None
    doc = parts[0][1]   # the first results file's ceilings
    env = doc["env"] if len(parts) == 1 else [d["env"] for _, d in parts]
    plot, rows = melted(plot, [r for part_rows, _ in parts for r in part_rows])
    path = manifest["_dir"] / plot["file"]
    plot = with_ceiling_line(plot, doc["ceilings"])
    if plot["kind"] == "roofline":
        draw_roofline(plot, rows, env, path, doc)
    else:
        {"lines": draw_lines, "bars": draw_bars}[plot["kind"]](plot, rows, env, path)
    return path


def loaded_sources(plot: dict, manifest: dict) -> list[tuple[list[dict], dict]]:
    """(rows, document) per results file a plot reads: its `source`, or each of its `sources` (each
    {"source", "rows", "where", "ncu", "label_by"}; the plot's `where` applies to all). A roofline's
    ncu bytes are attached to each row as `ncu_bytes` ({level: bytes}), a source's `label_by` as
    `label_by`. Files not written yet are left out."""
    parts = []
    for spec in plot.get("sources", [plot]):
        doc, _ = load_doc(manifest, spec.get("source"))
        if doc is None:
            continue
        rows = [r for r in rows_at(doc, spec.get("rows", plot.get("rows", "rows")))
                if matches(r, plot.get("where", {})) and matches(r, spec.get("where", {}))]
        measured = measured_bytes(spec, doc)
        labels = {"label_by": spec["label_by"]} if "label_by" in spec else {}
        parts.append(([{**r, "ncu_bytes": measured.get(row_ncu_key(spec, r), {}), **labels} for r in rows], doc))
    return parts


def melted(plot: dict, rows: list[dict]) -> tuple[dict, list[dict]]:
    """A `y` that lists several fields ("us.attention", "us.mlp") draws one series per field: each
    row becomes one row per field, named by the field's last part."""
    if not isinstance(plot.get("y"), list):
        return plot, rows
    out = [{**r, "field": key.rsplit(".", 1)[-1], "value": field(r, key)} for r in rows for key in plot["y"]]
    return {**plot, "y": "value", "series": "field", "ylabel": plot.get("ylabel", ", ".join(plot["y"]))}, out


def with_ceiling_line(plot: dict, ceilings: dict) -> dict:
    """A bar plot's `hline` may name a measured ceiling ({"ceiling", "scale", "label"}) instead of a `y`."""
    line = plot.get("hline", {})
    if "ceiling" not in line:
        return plot
    y = ceilings[line["ceiling"]] * line.get("scale", 1)
    return {**plot, "hline": {"y": y, "label": f"{line.get('label', line['ceiling'])} {y:,.4g}"}}


def draw_all(manifest: dict) -> list[Path]:
    return [p for p in (draw(plot, manifest) for plot in manifest.get("plots", [])) if p is not None]
