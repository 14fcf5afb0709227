"""The course's closing figures, drawn from the phases' committed results (never from typed numbers).

`python -m final.visualize [--out DIR]` writes into final/visualizations/ (or DIR):

- complete_roofline.png: every kernel of every phase on one measured Roofline (ceilings labelled):
  phase 1's PyTorch steps (ncu), the unfused kernels of phases 2-4 one by one, every attention
  implementation of phases 2-5 and the peers from phase 5's single run (with its ncu DRAM bytes),
  the FP16 tensor-core kernel and its peers (tc run), phase 6's LayerNorm, GEMM and MLP kernels;
- speedup_chart.png: each phase's attention speed-up over phase 2 and its share of the peer's speed
  at S=4096, D=64 and D=128;
- scaling_analysis.png: attention TFLOP/s and extra memory against S, and the model's tokens/s;
- memory_scaling.png: extra memory of attention against S beside the S x S score matrix, and the
  whole model's extra memory;
- component_breakdown.png: where the model's GPU time goes, from final/results/metrics.json when
  the end-to-end benchmark has written it, else from phase 1's profile (the title says which).

Each figure is stamped with the GPU, torch, CUDA, dates and commits of the results it uses. Same
results in, same bytes out (no timestamps in the files, fixed layout). Runs without a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from utils import roofline
from utils.build import REPO_ROOT
from utils.results import read_results

FINAL_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = FINAL_DIR / "visualizations"

# name -> results file, relative to the repository root
SOURCES = {
    "phase1": "phase1_baseline/results/baseline_metrics.json",
    "phase2": "phase2_naive/results/metrics.json",
    "phase3": "phase3_tiled/results/metrics.json",
    "phase4": "phase4_coalesced/results/coalesced_metrics.json",
    "phase5": "phase5_fused/results/metrics.json",
    "tc": "phase5_fused/results/tc_metrics.json",
    "phase6": "phase6_layernorm_mlp/results/metrics.json",
    "final": "final/results/metrics.json",
}
FIGURES = ("complete_roofline.png", "speedup_chart.png", "scaling_analysis.png", "memory_scaling.png",
           "component_breakdown.png")

HEADLINE_S = 4096
FP32_PHASES = ["phase2_naive", "phase3_tiled_t16", "phase4_coalesced", "phase5_fused_teaching", "phase5_fused"]
FP32_PEERS = ["torch_naive", "sdpa_math", "sdpa_efficient"]
FP32_PEER = "sdpa_efficient"
TC_IMPL, TC_PEERS = "phase5_fused_tc", ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch_naive"]
TC_PEER = "sdpa_flash"
COMPONENT_OPS = ("matmul_qk", "softmax", "matmul_av")
MODEL_COMPONENTS = ("attention", "layer_norm", "mlp", "other")
BREAKDOWN_KEYS = ("components", "breakdown", "component_ms", "component_shares")

PHASE_STYLE = {  # group -> (colour, marker)
    "phase 1: PyTorch eager": ("#7f7f7f", "P"),
    "phase 2: naive": ("#d62728", "o"),
    "phase 3: tiled": ("#ff7f0e", "s"),
    "phase 4: coalesced": ("#bcbd22", "D"),
    "phase 5: fused FP32": ("#2ca02c", "^"),
    "phase 5: fused FP16 tensor cores": ("#17becf", "v"),
    "phase 6: LayerNorm / MLP": ("#9467bd", "h"),
    "peers (PyTorch, cuBLAS, SDPA)": ("#000000", "*"),
}


# ------------------------------------------------------------------------------------------------
# Loading


def load_results(root: Path = REPO_ROOT) -> dict:
    """name -> results document (None where the file does not exist yet)."""
    docs = {}
    for name, rel in SOURCES.items():
        path = Path(root) / rel
        docs[name] = read_results(path) if path.exists() else None
    return docs


def ceilings_for(docs: dict) -> tuple[dict, dict]:
    """The ceilings the complete Roofline is drawn against, and the stamp of their measurement:
    utils/results/ceilings.json for the GPU of phase 5's run, else that run's own copy."""
    ref = docs.get("phase5") or next(d for d in docs.values() if d)
    cached = roofline.load_cached_ceilings(ref["env"]["gpu"])
    ceilings = cached or ref["ceilings"]
    return ceilings, ceilings.get("env", ref["env"])


def stamp(*docs) -> str:
    """One line naming where and when the results used by a figure were measured."""
    envs = [d["env"] if "env" in d and isinstance(d["env"], dict) and "gpu" in d["env"] else d
            for d in docs if d]
    gpus = sorted({e["gpu"] for e in envs})
    torches = sorted({f"torch {e['torch']}, CUDA {e['cuda']}" for e in envs})
    runs = sorted({(e["date"][:10], e["commit"]) for e in envs})
    dates = sorted({d for d, _ in runs})
    commits = sorted({c for _, c in runs})
    return (f"{' / '.join(gpus)}; {' / '.join(torches)}; measured {', '.join(dates)}; "
            f"commit {', '.join(commits)}")


def _row(rows, **match):
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return found[0] if found else None


def headline_rows(doc: dict, D: int, dtype: str, S: int = HEADLINE_S) -> dict:
    """impl -> the attention row at B=4, H=8, S, D, non-causal (as the README table takes them)."""
    out = {}
    for r in doc["rows"]:
        if (r["op"] == "attention" and r.get("D") == D and r.get("Sq") == S and r.get("Sk") == S
                and r.get("dtype") == dtype and not r.get("causal") and r.get("B") == 4 and r.get("H") == 8):
            out.setdefault(r["impl"], r)
    return out


# ------------------------------------------------------------------------------------------------
# Complete Roofline


def _point(group, label, flops, nbytes, ms, measured=None) -> dict:
    p = {"group": group, "label": label, "flops": float(flops), "bytes": float(nbytes), "ms": float(ms)}
    if measured:
        p["measured_bytes"] = float(measured)
    return p


def _component_model(r: dict) -> tuple[float, float]:
    """FLOPs and minimum bytes of one unfused kernel (QK^T, softmax or PV) of a row."""
    bh = r["B"] * r["H"]
    if r["op"] == "matmul_qk":
        return roofline.matmul_flops(r["Sq"], r["Sk"], r["D"], bh), roofline.matmul_bytes(r["Sq"], r["Sk"], r["D"], bh)
    if r["op"] == "matmul_av":
        return roofline.matmul_flops(r["Sq"], r["D"], r["Sk"], bh), roofline.matmul_bytes(r["Sq"], r["D"], r["Sk"], bh)
    return roofline.softmax_flops(bh * r["Sq"], r["Sk"]), roofline.softmax_bytes(bh * r["Sq"], r["Sk"])


def _same_shape(r: dict, shape: dict | None) -> bool:
    if not shape:
        return False
    S = shape.get("S", shape.get("Sq"))
    return r["B"] == shape.get("B") and r["H"] == shape.get("H") and r["Sq"] == S and r["D"] == shape.get("D")


def component_points(doc: dict, group_of, impls, S: int, D: int, ncu_bytes: dict) -> list[dict]:
    """The unfused kernels (QK^T, softmax, PV) of `impls` at S, D; ncu_bytes: (impl, op) -> bytes,
    used only when ncu profiled this very shape."""
    points = []
    for impl in impls:
        for op in COMPONENT_OPS:
            r = _row(doc["rows"], impl=impl, op=op, Sq=S, D=D, causal=False)
            if r is None:
                continue
            flops, nbytes = _component_model(r)
            measured = ncu_bytes.get((impl, op)) if _same_shape(r, ncu_bytes.get("shape")) else None
            points.append(_point(group_of(impl), f"{impl} {op} (S={S}, D={D})", flops, nbytes, r["ms"], measured))
    return points


def _group_of(impl: str) -> str:
    for prefix, group in (("phase2", "phase 2: naive"), ("phase3", "phase 3: tiled"), ("phase4", "phase 4: coalesced"),
                          ("phase5_fused_tc", "phase 5: fused FP16 tensor cores"), ("phase5", "phase 5: fused FP32"),
                          ("phase6", "phase 6: LayerNorm / MLP")):
        if impl.startswith(prefix):
            return group
    return "peers (PyTorch, cuBLAS, SDPA)"


def roofline_points_all(docs: dict) -> list[dict]:
    """Every kernel of every phase as a Roofline point (label, group, flops, bytes, ms, measured)."""
    from utils.attention_bench import roofline_points

    points: list[dict] = []
    p1 = docs.get("phase1")
    if p1 and isinstance(p1.get("ncu"), list):
        from phase1_baseline.profile_pytorch import PROFILE_SHAPE, step_models

        models = step_models()
        for r in p1["ncu"]:
            if r.get("step") in models and r.get("dram_bytes") and r.get("time_ns"):
                flops, nbytes = models[r["step"]]
                points.append(_point("phase 1: PyTorch eager", f"torch {r['step']} kernel, causal "
                                     f"(B={PROFILE_SHAPE['batch']}, S={PROFILE_SHAPE['seq']}, ncu time)",
                                     flops, nbytes, r["time_ns"] * 1e-6, r["dram_bytes"]))
    p2 = docs.get("phase2")
    if p2:
        ncu = p2.get("ncu") or {}
        nb = {(k.get("impl"), k.get("op")): k["dram_bytes"] for k in ncu.get("kernels", []) if k.get("dram_bytes")}
        nb["shape"] = ncu.get("shape")
        S = (ncu.get("shape") or {}).get("S", 2048)
        points += component_points(p2, _group_of, ["phase2_naive"], S, 64, nb)
    p4 = docs.get("phase4")
    if p4:
        ncu = p4.get("ncu") or {}
        nb = {"shape": ncu.get("shape")}
        for impl, recs in (ncu.get("records") or {}).items():
            if len(recs) == len(COMPONENT_OPS):  # launch order: QK^T, softmax, PV
                nb.update({(impl, op): rec.get("dram_bytes") for op, rec in zip(COMPONENT_OPS, recs)})
        S = (ncu.get("shape") or {}).get("S", HEADLINE_S)
        points += component_points(p4, _group_of, ["phase3_tiled_t16", "phase4_coalesced", "cublas"], S, 64, nb)
    p3 = docs.get("phase3")
    if p3:  # the tile-size sweep's other tiles (no ncu at this shape)
        points += component_points(p3, _group_of, ["phase3_tiled_t8", "phase3_tiled_t32"], HEADLINE_S, 64, {})
    p5 = docs.get("phase5")
    if p5:
        ncu_bytes = {impl: sum(k.get("dram_bytes") or 0 for k in kernels)
                     for impl, kernels in (p5.get("ncu") or {}).get("kernels", {}).items()}
        match = {"op": "attention", "Sq": HEADLINE_S, "D": 64, "causal": False, "dtype": "float32"}
        for p in roofline_points(p5["rows"], match, ncu_bytes):
            p["group"] = _group_of(p["label"])
            p["label"] = f"{p['label']} attention (S={HEADLINE_S}, D=64, FP32)"
            points.append(p)
    tc = docs.get("tc")
    if tc:
        kernels = (tc.get("ncu") or {}).get("kernels", {})
        ncu_bytes = {k.rsplit("_D", 1)[0]: v.get("dram_bytes") for k, v in kernels.items()
                     if k.endswith("_D64") and v.get("dram_bytes")}
        match = {"op": "attention", "Sq": HEADLINE_S, "D": 64, "causal": False, "dtype": "float16"}
        for p in roofline_points(tc["rows"], match, ncu_bytes):
            if p["label"] in (TC_IMPL, "sdpa_flash", "sdpa_cudnn"):
                p["group"] = _group_of(p["label"])
                p["label"] = f"{p['label']} attention (S={HEADLINE_S}, D=64, FP16)"
                points.append(p)
    p6 = docs.get("phase6")
    if p6:
        from phase6_layernorm_mlp.run import roofline_points as phase6_points

        from phase6_layernorm_mlp.run import HEADLINE_LN, MLP_SHAPE

        t, h, i = MLP_SHAPE["tokens"], MLP_SHAPE["hidden"], MLP_SHAPE["inner"]
        shapes = {"layer_norm": f"{HEADLINE_LN['rows']}x{HEADLINE_LN['hidden']}", "mlp": f"{t} tokens {h}-{i}-{h}",
                  "linear1": f"{t}x{i}x{h}", "linear2": f"{t}x{h}x{i}"}
        for p in phase6_points(p6):
            p["group"] = _group_of(p["label"])
            op = p["label"].rsplit("(", 1)[-1].rstrip(")")
            shape = shapes.get("layer_norm" if op.endswith("layer_norm") else op)
            if shape:
                p["label"] = f"{p['label'][:-1]}, {shape})"
            points.append(p)
    return points


def plot_complete_roofline(docs: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    points = roofline_points_all(docs)
    ceilings, ceilings_env = ceilings_for(docs)
    fig = plt.figure(figsize=(17, 9.5))
    ax = fig.add_axes([0.055, 0.08, 0.53, 0.80])
    side = fig.add_axes([0.60, 0.02, 0.39, 0.88])
    side.axis("off")
    bandwidth = ceilings["dram_TBps"] * 1e12
    xs_all = [p["flops"] / p["bytes"] for p in points] + [
        p["flops"] / p["measured_bytes"] for p in points if p.get("measured_bytes")]
    lo, hi = min([0.05] + [x / 3 for x in xs_all]), max([3000.0] + [x * 3 for x in xs_all])
    xs = [lo * (hi / lo) ** (t / 300) for t in range(301)]
    keys = [k for k in ("fp32_TFLOPs", "sgemm_TFLOPs", "tf32_tc_TFLOPs", "fp16_tc_TFLOPs") if k in ceilings]
    for n, key in enumerate(keys):
        peak = ceilings[key] * 1e12
        ax.plot(xs, [min(peak, bandwidth * x) / 1e12 for x in xs], color="black",
                linestyle=["-", "--", "-.", ":"][n % 4], linewidth=1.1)
        ridge = roofline.ridge_point(ceilings, key)
        text = f"{roofline.CEILING_LABELS.get(key, key)}: {ceilings[key]:.0f} TFLOP/s (ridge {ridge:.0f} FLOP/B)"
        if key == "sgemm_TFLOPs":  # just under the FFMA line: label it below, left of the ridge
            ax.annotate(text, (ridge * 0.9, peak / 1e12 / 1.08), ha="right", va="top", fontsize=8)
        else:
            ax.annotate(text, (hi / 1.15, peak / 1e12), ha="right", va="bottom", fontsize=8)
    x_label = lo * 4
    ax.annotate(f"DRAM (copy) {ceilings['dram_TBps']:.2f} TB/s", (x_label, bandwidth * x_label / 1e12 * 1.15),
                rotation=31, fontsize=8, va="bottom")
    legend_done = set()
    table = []
    for n, p in enumerate(points, start=1):
        colour, marker = PHASE_STYLE[p["group"]]
        x = p["flops"] / p["bytes"]
        y = p["flops"] / (p["ms"] * 1e-3) / 1e12
        label = p["group"] if p["group"] not in legend_done else None
        legend_done.add(p["group"])
        ax.scatter([x], [y], color=colour, marker=marker, s=42, zorder=3, label=label)
        if p.get("measured_bytes"):
            xm = p["flops"] / p["measured_bytes"]
            ax.scatter([xm], [y], facecolors="none", edgecolors=[colour], marker=marker, s=42, zorder=3)
            ax.plot([xm, x], [y, y], color=colour, linewidth=0.7, alpha=0.6)
        ax.annotate(str(n), (x, y), xytext=(4, 3), textcoords="offset points", fontsize=6.5, color=colour)
        table.append((n, p, y, x))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ymin = min([0.01] + [t[2] / 3 for t in table])
    ax.set_ylim(ymin, max(ceilings.get(k, 0) for k in keys) * 2.5)
    ax.set_xlabel("arithmetic intensity (FLOP per DRAM byte)")
    ax.set_ylabel("attained TFLOP/s")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7.5, loc="lower right")
    ax.text(0.01, 0.99, "filled: minimum bytes (each input read once, each output written once)\n"
            "hollow: DRAM bytes measured by Nsight Compute, same kernel, same time",
            transform=ax.transAxes, fontsize=7, va="top")
    side.text(0.0, 1.0, "#   kernel (FP32 unless said; B=4, H=8 unless said)   TFLOP/s   FLOP/B min / ncu",
              fontsize=7.2, family="monospace", weight="bold", va="top")
    for i, (n, p, y, x) in enumerate(table):
        colour = PHASE_STYLE[p["group"]][0]
        measured = f"{p['flops'] / p['measured_bytes']:.3g}" if p.get("measured_bytes") else "-"
        side.text(0.0, 1.0 - (i + 1.4) * (0.98 / max(len(table) + 1, 40)),
                  f"{n:>2}  {p['label'][:62]:<62} {y:>7.3g}  {x:>6.3g} / {measured}",
                  fontsize=6.3, family="monospace", color=colour, va="top")
    used = [d for d in (docs.get(k) for k in ("phase1", "phase2", "phase3", "phase4", "phase5", "tc", "phase6")) if d]
    fig.suptitle("Every kernel of the course on one measured Roofline (ceilings measured on the same GPU)\n"
                 f"{stamp(*used)}; ceilings measured {ceilings_env['date'][:10]}, commit {ceilings_env['commit']}",
                 fontsize=10)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------------
# Speed-up chart


def plot_speedup(docs: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    p5, tc = docs.get("phase5"), docs.get("tc")
    fig, axes = plt.subplots(2, 2, figsize=(14, 8.5))
    for row, D in enumerate((64, 128)):
        fp32 = headline_rows(p5, D, "float32") if p5 else {}
        fp16 = headline_rows(tc, D, "float16") if tc else {}
        base = fp32.get("phase2_naive")
        # FP16 rows come from another run: bridge to phase 2 through phase5_fused, timed in both runs
        bridge = None
        tc_fp32 = _row(tc["rows"], impl="phase5_fused", op="attention", Sq=HEADLINE_S, D=D, causal=False,
                       dtype="float32") if tc else None
        if tc_fp32 and "phase5_fused" in fp32:
            bridge = fp32["phase5_fused"]["ms"] / tc_fp32["ms"]
        names, values, colours, hatches = [], [], [], []
        if base:
            for impl in FP32_PHASES + FP32_PEERS:
                if impl in fp32:
                    names.append(impl)
                    values.append(base["ms"] / fp32[impl]["ms"])
                    colours.append(_colour(impl))
                    hatches.append("")
            if bridge and TC_IMPL in fp16:
                for impl in [TC_IMPL, "sdpa_flash", "sdpa_cudnn"]:
                    if impl in fp16:
                        names.append(f"{impl} (FP16)")
                        values.append(base["ms"] / (fp16[impl]["ms"] * bridge))
                        colours.append(_colour(impl))
                        hatches.append("//")
        ax = axes[row][0]
        _bars(ax, names, values, colours, hatches, "{:.3g}x")
        ax.set_yscale("log")
        ax.set_ylabel("speed-up over phase2_naive")
        ax.set_title(f"D={D}: speed-up over phase 2 (FP32 bars: one run; hatched FP16 bars: tc run, "
                     "scaled through phase5_fused timed in both)", fontsize=8.5)
        ax = axes[row][1]
        names, values, colours, hatches = [], [], [], []
        peer = fp32.get(FP32_PEER)
        if peer:
            for impl in FP32_PHASES + ["torch_naive", "sdpa_math"]:
                if impl in fp32:
                    names.append(impl)
                    values.append(peer["ms"] / fp32[impl]["ms"])
                    colours.append(_colour(impl))
                    hatches.append("")
        peer16 = fp16.get(TC_PEER)
        if peer16:
            for impl in [TC_IMPL, "sdpa_cudnn"]:
                if impl in fp16:
                    names.append(f"{impl} (FP16)")
                    values.append(peer16["ms"] / fp16[impl]["ms"])
                    colours.append(_colour(impl))
                    hatches.append("//")
        _bars(ax, names, values, colours, hatches, "{:.0%}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("speed relative to the peer (1 = peer)")
        ax.set_title(f"D={D}: FP32 against {FP32_PEER}, FP16 (hatched) against {TC_PEER}; same run each",
                     fontsize=8.5)
    fig.suptitle(f"Attention speed-ups, B=4, H=8, S={HEADLINE_S}, non-causal\n{stamp(*(d for d in (p5, tc) if d))}",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _bars(ax, names, values, colours, hatches, fmt):
    xs = list(range(len(names)))
    bars = ax.bar(xs, values, color=colours, hatch=None, edgecolor="white")
    for bar, hatch in zip(bars, hatches):
        if hatch:
            bar.set_hatch(hatch)
            bar.set_edgecolor("black")
    for x, v in zip(xs, values):
        ax.annotate(fmt.format(v), (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs)
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7.5)
    ax.grid(True, axis="y", alpha=0.3)
    if not names:
        ax.text(0.5, 0.5, "no results yet", ha="center", transform=ax.transAxes)


# ------------------------------------------------------------------------------------------------
# Scaling and memory


def _series(rows, impl, metric, D=64, dtype="float32"):
    pts = sorted((r["Sq"], r[metric]) for r in rows if r["impl"] == impl and r["op"] == "attention"
                 and r.get("D") == D and not r.get("causal") and r.get("dtype") == dtype
                 and r.get("Sq") == r.get("Sk") and r.get(metric) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def model_rows(docs: dict) -> tuple[list[dict], dict | None, str]:
    """End-to-end model rows: final/results when the benchmark has run, else phase 1's."""
    for name in ("final", "phase1"):
        doc = docs.get(name)
        rows = [r for r in doc["rows"] if r["op"] == "model"] if doc else []
        if rows:
            return rows, doc, SOURCES[name]
    return [], None, ""


def _model_series(rows, impl, B, metric, dtype=None):
    pts = sorted((r["S"], r[metric]) for r in rows if r["impl"] == impl and r["B"] == B
                 and (dtype is None or r.get("dtype") == dtype) and r.get(metric) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _model_impls(rows):
    return list(dict.fromkeys((r["impl"], r.get("dtype", "float32")) for r in rows))


def plot_scaling(docs: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    p5, tc = docs.get("phase5"), docs.get("tc")
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for impl in FP32_PHASES + FP32_PEERS:
        if p5:
            xs, ys = _series(p5["rows"], impl, "tflops")
            if xs:
                axes[0].plot(xs, ys, marker="o", label=f"{impl} FP32", color=_colour(impl))
            xs, ys = _series(p5["rows"], impl, "extra_mb")
            if xs:
                axes[1].plot(xs, [max(y, 1e-3) for y in ys], marker="o", label=f"{impl} FP32", color=_colour(impl))
    for impl in [TC_IMPL, "sdpa_flash", "sdpa_cudnn"]:
        if tc:
            xs, ys = _series(tc["rows"], impl, "tflops", dtype="float16")
            if xs:
                axes[0].plot(xs, ys, marker="v", linestyle="--", label=f"{impl} FP16", color=_colour(impl, fp16=True))
            xs, ys = _series(tc["rows"], impl, "extra_mb", dtype="float16")
            if xs:
                axes[1].plot(xs, [max(y, 1e-3) for y in ys], marker="v", linestyle="--", label=f"{impl} FP16",
                             color=_colour(impl, fp16=True))
    axes[0].set_ylabel("TFLOP/s (4·B·H·S²·D / time)")
    axes[0].set_yscale("log")
    axes[0].set_title("attention throughput, B=4, H=8, D=64, non-causal", fontsize=9)
    axes[1].set_ylabel("peak extra memory per call (MiB)")
    axes[1].set_yscale("log")
    axes[1].set_title("attention extra memory, B=4, H=8, D=64, non-causal", fontsize=9)
    rows, mdoc, source = model_rows(docs)
    batch = 8 if any(r["B"] == 8 for r in rows) else (rows[0]["B"] if rows else None)
    for impl, dtype in _model_impls(rows):
        xs, ys = _model_series(rows, impl, batch, "tokens_per_s", dtype)
        if xs:
            axes[2].plot(xs, ys, marker="o", label=f"{impl} {dtype}")
    axes[2].set_ylabel("tokens / s")
    axes[2].set_title(f"whole model forward, batch {batch} ({source})", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.suptitle(f"Scaling with sequence length\n{stamp(*(d for d in (p5, tc, mdoc) if d))}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _colour(impl: str, fp16: bool = False):
    palette = {"phase2_naive": "#d62728", "phase3_tiled_t16": "#ff7f0e", "phase4_coalesced": "#bcbd22",
               "phase5_fused_teaching": "#98df8a", "phase5_fused": "#2ca02c", "phase5_fused_tc": "#17becf",
               "torch_naive": "#7f7f7f", "sdpa_math": "#8c564b", "sdpa_efficient": "#1f77b4",
               "sdpa_flash": "#e377c2", "sdpa_cudnn": "#9467bd"}
    return palette.get(impl, "#000000")


def plot_memory(docs: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    p5 = docs.get("phase5")
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.2))
    ax = axes[0]
    all_s = []
    for impl in FP32_PHASES + FP32_PEERS:
        if p5:
            xs, ys = _series(p5["rows"], impl, "extra_mb")
            all_s += xs
            if xs:
                ax.plot(xs, [max(y, 1e-3) for y in ys], marker="o", label=impl, color=_colour(impl))
    if all_s:
        ss = sorted(set(all_s))
        ax.plot(ss, [4.0 * 4 * 8 * s * s / 2**20 for s in ss], "k--", linewidth=1,
                label="one S×S FP32 score matrix, B·H = 32 (4·B·H·S² bytes)")
        ax.plot(ss, [4.0 * 4 * 8 * s * 64 / 2**20 for s in ss], "k:", linewidth=1,
                label="the output itself (4·B·H·S·D bytes)")
    ax.set_title("attention: peak memory beyond the inputs, B=4, H=8, D=64, FP32", fontsize=9)
    ax.set_ylabel("MiB")
    ax = axes[1]
    rows, mdoc, source = model_rows(docs)
    for impl, dtype in _model_impls(rows):
        for B, style in zip(sorted({r["B"] for r in rows}), ("-", "--", ":", "-.")):
            xs, ys = _model_series(rows, impl, B, "extra_mb", dtype)
            if xs:
                ax.plot(xs, [max(y, 1e-3) for y in ys], marker="o", linestyle=style, label=f"{impl} {dtype} B={B}")
    ax.set_title(f"whole model forward: peak extra memory ({source})", fontsize=9)
    ax.set_ylabel("MiB")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.suptitle(f"Memory against sequence length: the unfused paths hold S×S, the fused ones O(S)\n"
                 f"{stamp(*(d for d in (p5, mdoc) if d))}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


# ------------------------------------------------------------------------------------------------
# Component breakdown


def _shares(components: dict) -> dict:
    """Normalize a component dict (times or shares) to shares of the total, adding 'other'."""
    values = {k: float(v) for k, v in components.items() if isinstance(v, (int, float)) and k != "total"}
    total = components.get("total")
    total = float(total) if isinstance(total, (int, float)) else sum(values.values())
    if total <= 0:
        return {}
    if total <= 1.0 + 1e-6 and all(v <= 1.0 for v in values.values()) and "total" not in components:
        total = 1.0 if sum(values.values()) <= 1.0 + 1e-6 else sum(values.values())
    shares = {k: v / total for k, v in values.items()}
    if "other" not in shares and sum(shares.values()) < 1.0 - 1e-6:
        shares["other"] = 1.0 - sum(shares.values())
    return shares


def final_breakdowns(doc: dict | None) -> list[tuple[str, dict]]:
    """(label, shares) for each model row of final/results that carries a component breakdown."""
    out = []
    if not doc:
        return out
    profile = doc.get("profile") or {}
    shape = profile.get("shape") or {}
    for impl, prof in (profile.get("by_impl") or {}).items():  # final.benchmark's profile section
        comps = prof.get("share") or prof.get("us")
        if isinstance(comps, dict):
            shares = _shares({k: v for k, v in comps.items() if v is not None})
            if shares:
                out.append((f"{impl} B={shape.get('B')} S={shape.get('S')}", shares))
    if out:
        return out
    for r in doc["rows"]:
        if r.get("op") != "model":
            continue
        for key in BREAKDOWN_KEYS:
            if isinstance(r.get(key), dict):
                shares = _shares(r[key])
                if shares:
                    out.append((f"{r['impl']} {r.get('dtype', '')} B={r.get('B')} S={r.get('S')}", shares))
                break
    for key in BREAKDOWN_KEYS:  # or a top-level section: a list of rows, or impl -> components
        section = doc.get(key)
        if isinstance(section, list):
            for r in section:
                comps = next((r[k] for k in BREAKDOWN_KEYS if isinstance(r.get(k), dict)), None)
                if comps:
                    out.append((f"{r.get('impl')} {r.get('dtype', '')} B={r.get('B')} S={r.get('S')}", _shares(comps)))
        elif isinstance(section, dict):
            for impl, comps in section.items():
                if isinstance(comps, dict):
                    out.append((str(impl), _shares(comps)))
    return [(label, shares) for label, shares in out if shares]


def phase1_breakdown(doc: dict) -> tuple[list[tuple[str, dict]], dict]:
    rs = doc["profile"]["range_shares"]
    top = {k: rs[k] for k in ("attention", "mlp", "layer_norm") if k in rs}
    top["other"] = max(0.0, 1.0 - sum(top.values()))
    steps = {k.split(".", 1)[1]: v for k, v in rs.items() if k.startswith("attention.")}
    return [("phase 1 PyTorch eager (explicit-math attention)", top)], steps


def plot_components(docs: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    final = docs.get("final")
    bars = final_breakdowns(final)
    steps = None
    if bars:
        used = final
        title = "Where the model's GPU time goes: torch.profiler ranges, end-to-end benchmark (final/results/metrics.json)"
    else:
        used = docs.get("phase1")
        bars, steps = phase1_breakdown(used) if used else ([], None)
        shape = used["profile"]["shape"] if used else {}
        title = ("Where the model's GPU time goes: phase 1 profile, batch "
                 f"{shape.get('batch')}, seq {shape.get('seq')} "
                 "(final/results/metrics.json not produced yet: end-to-end breakdown pending)")
    fig, axes = plt.subplots(1, 2 if steps else 1, figsize=(14 if steps else 11, 1.6 + 0.55 * max(len(bars), 3)),
                             squeeze=False)
    ax = axes[0][0]
    components = list(dict.fromkeys([c for c in MODEL_COMPONENTS] + [c for _, s in bars for c in s]))
    colours = {"attention": "#d62728", "layer_norm": "#9467bd", "mlp": "#1f77b4", "other": "#c7c7c7"}
    for i, (label, shares) in enumerate(bars):
        left = 0.0
        for comp in components:
            v = shares.get(comp, 0.0)
            if v <= 0:
                continue
            ax.barh(i, v, left=left, color=colours.get(comp), edgecolor="white",
                    label=comp if i == 0 or comp not in [c for _, s in bars[:i] for c in s] else None)
            if v > 0.04:
                ax.text(left + v / 2, i, f"{comp}\n{v:.0%}", ha="center", va="center", fontsize=7)
            left += v
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=7.5)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the forward's GPU time")
    handles, labels = ax.get_legend_handles_labels()
    by_label = dict(zip(labels, handles))
    ax.legend(by_label.values(), by_label.keys(), fontsize=7, loc="upper center", ncol=len(by_label),
              bbox_to_anchor=(0.5, -0.25 if len(bars) < 3 else -0.12))
    if steps:
        ax2 = axes[0][1]
        names = list(steps)
        ax2.barh(range(len(names)), [steps[n] for n in names], color="#d62728")
        for i, n in enumerate(names):
            ax2.text(steps[n], i, f" {steps[n]:.1%}", va="center", fontsize=7)
        ax2.set_yticks(range(len(names)))
        ax2.set_yticklabels([f"attention.{n}" for n in names], fontsize=7.5)
        ax2.invert_yaxis()
        ax2.set_xlabel("share of the forward's GPU time")
        ax2.set_title("the explicit-math attention, step by step", fontsize=9)
    fig.suptitle(f"{title}\n{stamp(used) if used else 'no results yet'}", fontsize=9.5)
    fig.tight_layout()
    return _save(fig, path)


# ------------------------------------------------------------------------------------------------


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version or date: same data, same bytes
    plt.close(fig)
    return path


def render_all(out_dir: Path = DEFAULT_OUT, root: Path = REPO_ROOT) -> list[Path]:
    """Draw every figure from the results under root into out_dir; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = load_results(root)
    if not any(docs.values()):
        print("final.visualize: no results files yet (they come from `make run` on a GPU)")
        return []
    out_dir = Path(out_dir)
    written = []
    with plt.style.context("default"):
        plt.rcParams["svg.hashsalt"] = "course"
        for name, fn in (("complete_roofline.png", plot_complete_roofline), ("speedup_chart.png", plot_speedup),
                         ("scaling_analysis.png", plot_scaling), ("memory_scaling.png", plot_memory),
                         ("component_breakdown.png", plot_components)):
            written.append(fn(docs, out_dir / name))
    return written


def display_path(path: Path) -> Path:
    """path relative to the repository when it lies inside it (for printing)."""
    try:
        return path.resolve().relative_to(REPO_ROOT)
    except ValueError:
        return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Draw the final figures from the committed results")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNGs (default final/visualizations)")
    args = parser.parse_args(argv)
    for path in render_all(args.out):
        print(f"wrote {display_path(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
