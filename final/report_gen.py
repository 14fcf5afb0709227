"""The course's final report, generated from the results files (no number in it is typed by hand).

`python -m final.report_gen [--out DIR] [--no-figures]` redraws the figures (final.visualize) into
DIR/visualizations, then writes DIR/report.md (what worked and why, what did not, lessons, future
work, with tables and figure links) and DIR/report.pdf (the same content rendered with matplotlib:
text pages, then one page per figure). DIR defaults to final/. Every sentence that states a
comparison picks its wording from the numbers, so a new run cannot leave a stale claim behind.
Runs without a GPU.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

from final import visualize as viz
from utils.build import REPO_ROOT
from utils.readme import env_line, fmt

FINAL_DIR = Path(__file__).resolve().parent
S = viz.HEADLINE_S
CAPTIONS = {
    "complete_roofline.png": "Every kernel of every phase on one measured Roofline",
    "speedup_chart.png": f"Attention speed-up over phase 2 and share of the peer's speed, S={S}",
    "scaling_analysis.png": "Throughput and extra memory against sequence length",
    "memory_scaling.png": "Extra memory against sequence length: S×S buffers against O(S)",
    "component_breakdown.png": "Where the model's GPU time goes",
}


def _pct(x) -> str:
    return "–" if x is None else f"{x:.0%}"


def _x(x) -> str:
    return "–" if x is None else f"{x:.3g}x"


def _faster(ratio: float) -> str:
    """ratio = other_ms / our_ms: words for how our time compares."""
    if ratio >= 1.02:
        return f"{ratio:.2f}x faster than"
    if ratio <= 0.98:
        return f"{1 / ratio:.2f}x slower than"
    return "as fast as"


def _ncu_sum(doc, impl, key="dram_bytes"):
    kernels = (doc.get("ncu") or {}).get("kernels", {}).get(impl)
    return sum(k.get(key) or 0 for k in kernels) if kernels else None


# ------------------------------------------------------------------------------------------------
# Tables


def attention_fp32_table(p5: dict, D: int) -> list[str]:
    rows = viz.headline_rows(p5, D, "float32")
    base, peer = rows.get("phase2_naive"), rows.get(viz.FP32_PEER)
    errs = {}
    for x in p5["rows"]:  # the reference runs at the smaller S only: the largest error over all sizes
        if x["op"] == "attention" and x.get("D") == D and x.get("rel_err") is not None:
            errs[x["impl"]] = max(errs.get(x["impl"], 0.0), x["rel_err"])
    lines = [f"| impl | ms | TFLOP/s | x phase 2 | % of {viz.FP32_PEER} | extra MB | max rel. error (checked S) |",
             "|---|---|---|---|---|---|---|"]
    for impl in viz.FP32_PHASES + viz.FP32_PEERS:
        r = rows.get(impl)
        if r:
            lines.append(f"| {impl} | {fmt(r['ms'])} | {fmt(r['tflops'])} | {_x(base['ms'] / r['ms'] if base else None)} | "
                         f"{_pct(peer['ms'] / r['ms'] if peer else None)} | {fmt(r.get('extra_mb'))} | "
                         f"{fmt(errs.get(impl), 2)} |")
    return lines


def attention_fp16_table(tc: dict) -> list[str]:
    ceiling = tc["ceilings"].get("fp16_tc_TFLOPs")
    lines = [f"| impl | D | ms | TFLOP/s | % of the FP16 tensor-core ceiling | % of {viz.TC_PEER} | extra MB |",
             "|---|---|---|---|---|---|---|"]
    for D in (64, 128):
        rows = viz.headline_rows(tc, D, "float16")
        peer = rows.get(viz.TC_PEER)
        for impl in [viz.TC_IMPL] + viz.TC_PEERS:
            r = rows.get(impl)
            if r:
                lines.append(f"| {impl} | {D} | {fmt(r['ms'])} | {fmt(r['tflops'])} | "
                             f"{_pct(r['tflops'] / ceiling if ceiling else None)} | "
                             f"{_pct(peer['ms'] / r['ms'] if peer else None)} | {fmt(r.get('extra_mb'))} |")
    return lines


def model_table(docs: dict) -> tuple[list[str], str]:
    rows, doc, source = viz.model_rows(docs)
    if not rows:
        return [], ""
    shape = (doc.get("profile") or {}).get("shape") or {}
    B = shape.get("B", shape.get("batch", 8))
    S_ = shape.get("S", shape.get("seq", 1024))
    sel = [r for r in rows if r["B"] == B and r["S"] == S_]
    peer = {r.get("dtype", "float32"): r for r in sel if r["impl"] in ("torch_sdpa", "torch_sdpa_fp16")}
    lines = ["| impl | dtype | ms | tokens/s | extra MB | % of torch SDPA's speed (same dtype) |",
             "|---|---|---|---|---|---|"]
    for r in sel:
        p = peer.get(r.get("dtype", "float32"))
        lines.append(f"| {r['impl']} | {r.get('dtype', 'float32')} | {fmt(r['ms'])} | {fmt(r.get('tokens_per_s'))} | "
                     f"{fmt(r.get('extra_mb'))} | {_pct(p['ms'] / r['ms'] if p else None)} |")
    return lines, f"batch {B}, seq {S_}, from {source}"


# ------------------------------------------------------------------------------------------------
# Text


def worked(docs: dict) -> list[str]:
    p5, tc, p4, p6 = docs.get("phase5"), docs.get("tc"), docs.get("phase4"), docs.get("phase6")
    out = []
    if p5:
        r = viz.headline_rows(p5, 64, "float32")
        n2, n3, n4, f5 = (r.get(k) for k in ("phase2_naive", "phase3_tiled_t16", "phase4_coalesced", "phase5_fused"))
        if n2 and n3:
            l1_2 = ((p5.get("ncu") or {}).get("kernels", {}).get("phase2_naive") or [{}])[0].get("l1_bytes")
            l1_3 = ((p5.get("ncu") or {}).get("kernels", {}).get("phase3_tiled_t16") or [{}])[0].get("l1_bytes")
            why = (f" Nsight Compute shows why: the naive QK^T kernel moves {l1_2 / 1e9:,.0f} GB through L1, the tiled "
                   f"one {l1_3 / 1e9:,.0f} GB, because each element loaded into shared memory is used by a whole tile "
                   "of threads." if l1_2 and l1_3 else "")
            out.append(f"- **Shared-memory tiling (phase 3)** made attention {_faster(n2['ms'] / n3['ms'])} the naive "
                       f"kernels (S={S}, D=64: {fmt(n2['ms'])} ms to {fmt(n3['ms'])} ms).{why}")
        if n3 and n4:
            frac = ""
            if p4 and p4.get("matmul_vs_cublas"):
                parts = [f"{m['op']} D={m['D']}: {m['fraction']:.0%}" for m in p4["matmul_vs_cublas"]]
                frac = f" Its matmuls reach this share of cuBLAS's speed: {', '.join(parts)}."
            out.append(f"- **Coalesced float4 loads and register tiling (phase 4)** made it {_faster(n3['ms'] / n4['ms'])} "
                       f"phase 3: each thread computes a small block of outputs from registers, and every global load "
                       f"is a full 128-byte line.{frac}")
        if n4 and f5:
            b4, b5 = _ncu_sum(p5, "phase4_coalesced"), _ncu_sum(p5, "phase5_fused")
            traffic = (f" ncu measured {b4 / 1e9:.2f} GB of DRAM traffic for the three unfused kernels against "
                       f"{b5 / 1e9:.2f} GB for the fused one." if b4 and b5 else "")
            out.append(f"- **Fusion with the online softmax (phase 5)** removed the S×S buffers: extra memory at S={S} "
                       f"fell from {fmt(n4['extra_mb'])} MB (phase 4) to {fmt(f5['extra_mb'])} MB, and the kernel is "
                       f"{_faster(n4['ms'] / f5['ms'])} phase 4.{traffic} The fused kernel runs up to "
                       f"S={max(x['Sq'] for x in p5['rows'] if x['impl'] == 'phase5_fused')}; the run stops "
                       + ", ".join(f"{k} at S={v}" for k, v in (p5.get("max_s") or {}).items())
                       + " (their S×S buffers and time).")
            peer = r.get(viz.FP32_PEER)
            if peer:
                out.append(f"- At D=64 the fused FP32 kernel reaches {peer['ms'] / f5['ms']:.0%} of {viz.FP32_PEER}'s "
                           f"speed ({fmt(f5['tflops'])} TFLOP/s, {f5['tflops'] / p5['ceilings']['fp32_TFLOPs']:.0%} "
                           f"of the measured FP32 FFMA peak), with no tensor cores.")
    if tc:
        for s in (tc.get("summary") or []):
            if s["S"] == S and s["D"] == 64 and not s["causal"]:
                out.append(f"- **Tensor cores (phase 5, FP16)**: {fmt(s['tflops'])} TFLOP/s at S={S}, D=64, "
                           f"{s['fraction_of_phase5_fused']:.1f}x the FP32 fused kernel in the same run and "
                           f"{s['fraction_of_sdpa_flash']:.0%} of FlashAttention-2 (sdpa_flash): mma.sync on "
                           "register fragments, with the FP32 online softmax kept in registers.")
    if p6:
        ln = [x for x in p6["rows"] if x["impl"] == "phase6_layer_norm" and x["op"] == "layer_norm"]
        vs = (p6.get("targets") or {}).get("layer_norm_at_least_torch") or {}
        best = max(ln, key=lambda x: x["frac_copy"]) if ln else None
        if best:
            out.append(f"- **LayerNorm (phase 6)** is bandwidth-bound: one read, one write, the row kept in registers. "
                       f"It reaches {best['frac_copy']:.0%} of the copy bandwidth at {best['rows']}x{best['hidden']} "
                       f"({best['dtype']}) and is at least as fast as torch at {sum(bool(v) for v in vs.values())} "
                       f"of {len(vs)} FP32 shapes.")
    return out


def did_not(docs: dict) -> list[str]:
    p5, tc, p6, final = docs.get("phase5"), docs.get("tc"), docs.get("phase6"), docs.get("final")
    out = []
    if p5:
        r64, r128 = viz.headline_rows(p5, 64, "float32"), viz.headline_rows(p5, 128, "float32")
        t, n4 = r64.get("phase5_fused_teaching"), r64.get("phase4_coalesced")
        if t and n4:
            out.append(f"- **Fusion alone is not speed.** The teaching fused kernel (one query row per thread, "
                       f"the paper's loop as written) is {_faster(n4['ms'] / t['ms'])} phase 4's three unfused "
                       f"kernels at S={S}, D=64 ({fmt(t['tflops'])} against {fmt(n4['tflops'])} TFLOP/s): it saves "
                       "DRAM traffic but gives up the register tiling that made phase 4 fast.")
        f64, f128 = r64.get("phase5_fused"), r128.get("phase5_fused")
        p64, p128 = r64.get(viz.FP32_PEER), r128.get(viz.FP32_PEER)
        if f64 and f128 and p64 and p128:
            out.append(f"- **D=128 in FP32**: the fused kernel reaches {p128['ms'] / f128['ms']:.0%} of "
                       f"{viz.FP32_PEER} at D=128 against {p64['ms'] / f64['ms']:.0%} at D=64; "
                       f"at D=128 phase 4's unfused kernels run at {_pct(r128['phase4_coalesced']['ms'] / f128['ms']) if 'phase4_coalesced' in r128 else '–'} "
                       "of the fused kernel's speed. (For FP32 inputs sdpa_efficient uses tensor cores in 3xTF32, "
                       "which an FFMA kernel cannot match at large D.)")
        b5 = _ncu_sum(p5, "phase5_fused")
        f = f64
        if b5 and f:
            from utils import roofline

            minimum = roofline.attention_bytes(f["B"], f["H"], f["Sq"], f["Sk"], f["D"], 4)
            be = _ncu_sum(p5, "sdpa_efficient")
            peer_txt = f" ({viz.FP32_PEER}: {be / minimum:.0f}x)" if be else ""
            out.append(f"- **DRAM traffic above the minimum**: the fused kernel moves {b5 / minimum:.0f}x the minimum "
                       f"bytes{peer_txt}: each query block streams all of K and V, and what L2 does not keep comes "
                       "from DRAM again; the ncu bytes show how much did.")
    if tc:
        for s in (tc.get("summary") or []):
            if s["S"] == S and not s["causal"]:
                out.append(f"- **FP16, D={s['D']}**: {s['pct_of_fp16_tc']:.0f}% of the FP16 tensor-core ceiling and "
                           f"{s['fraction_of_sdpa_cudnn']:.0%} of cuDNN's attention, which uses Hopper's wgmma and TMA "
                           "where this kernel uses mma.sync (phase5_fused/README_tensor_cores.md).")
    if p6:
        tg = p6.get("targets") or {}
        mlp = viz._row(p6["rows"], impl="phase6_mlp", op="mlp")
        if mlp and "speedup_vs_torch_eager" in mlp:
            met = tg.get("mlp_ge_0p9_torch_eager")
            out.append(f"- **The fused MLP** runs at {mlp['speedup_vs_torch_eager']:.0%} of torch eager's speed "
                       f"(target 90%: {'met' if met else 'not met'}); its GEMMs reach "
                       + ", ".join(f"{k} {v:.0%}" for k, v in (tg.get("gemm_frac_cublas") or {}).items())
                       + " of cuBLAS, and the saved activation round trip does not make up the difference.")
        ln = tg.get("layer_norm_ge_90pct_copy") or {}
        if ln:
            out.append(f"- **LayerNorm at 90% of copy bandwidth**: met at {sum(bool(v) for v in ln.values())} of "
                       f"{len(ln)} FP32 shapes (" + ", ".join(k for k, v in ln.items() if v) + "); see "
                       "phase6_layernorm_mlp/README.md for the ncu evidence.")
    targets = (final or {}).get("targets") or {}
    if targets:
        for dtype, t in targets.items():
            if t.get("met") is None:
                out.append(f"- End-to-end target ({dtype}): not measured ({t.get('why', '')}).")
            else:
                out.append(f"- **End-to-end ({dtype})**: {t['impl']} is {_faster(t['speedup'])} {t['peer']} at batch "
                           f"{t.get('B')}, seq {t.get('S')} (target: at least as fast: {'met' if t['met'] else 'not met'})."
                           + ("" if t["met"] else _end_to_end_cause(final, t)))
    elif not final:
        out.append("- **End-to-end**: final/results/metrics.json is not produced yet (`python -m final.benchmark` on "
                   "a GPU); the OptimizedTransformer's speed against PyTorch SDPA is not in this report.")
    return out


def _end_to_end_cause(final: dict, t: dict) -> str:
    """Where a missed end-to-end target loses its time: the profiler's components of the two models
    and, for FP32, the same model with cuBLAS in the MLP (timed in the same run)."""
    by_impl = (final.get("profile") or {}).get("by_impl") or {}
    ours, peer = by_impl.get(t["impl"]), by_impl.get(t["peer"])
    if not (ours and peer):
        return ""
    parts = [f"{name} {ours['us'][name] / 1e3:.2f} ms against {peer['us'][name] / 1e3:.2f}"
             for name in ("attention", "layer_norm", "mlp", "other") if name in ours["us"] and name in peer["us"]]
    text = f" By component (torch.profiler, GPU time per forward): {'; '.join(parts)}."
    cublas = viz._row(final["rows"], impl="optimized_cublas_mlp", B=t.get("B"), S=t.get("S"))
    if cublas and t.get("peer_ms"):
        text += (f" The same model with cuBLAS in the MLP (optimized_cublas_mlp) runs at "
                 f"{t['peer_ms'] / cublas['ms']:.0%} of {t['peer']}'s speed: phase 6's GEMMs are the gap.")
    return text


def lessons(docs: dict) -> list[str]:
    p5 = docs.get("phase5")
    out = ["- **Time the peer in the same run.** Every ratio here is taken within one run on one GPU; numbers "
           "from different runs (even on the same GPU model) differ by more than some of the effects measured."]
    if p5:
        r = viz.headline_rows(p5, 64, "float32")
        tn, n4 = r.get("torch_naive"), r.get("phase4_coalesced")
        if tn and n4:
            out.append(f"- **Three good kernels are not enough.** Phase 4 is {_faster(tn['ms'] / n4['ms'])} "
                       "torch's explicit math (cuBLAS + softmax): both pay for the S×S round trips; only fusion "
                       "removes them.")
        errs = [x["rel_err"] for x in p5["rows"] if x.get("rel_err") is not None and x["impl"].startswith("phase")]
        if errs:
            out.append(f"- **Correctness first.** Every phase kernel timed in phase 5's run was also checked against "
                       f"the float64 reference: largest relative error {max(errs):.1e} over {len(errs)} shapes.")
    out += ["- **Minimum bytes against measured bytes.** The Roofline with both (filled and hollow markers) tells "
            "a kernel that is memory-bound by design from one that wastes traffic.",
            "- **Memory is a feature.** The unfused paths run out of memory (or time) long before the fused ones; "
            "the memory figure is as important as the speed one."]
    return out


FUTURE = [
    "- Hopper's asynchronous path for the FP16 kernel: TMA loads, wgmma, warp-specialized producer and consumer "
    "warps (FlashAttention-3); the gap to cuDNN says how much is left.",
    "- FP32 inputs on tensor cores (3xTF32, as sdpa_efficient does), for the D=128 gap.",
    "- The MLP's GEMMs on tensor cores (TF32 / FP16) with the bias + GELU epilogue kept.",
    "- The backward pass (recompute P from the saved logsumexp), and decoding (Sq=1 against a long KV cache, "
    "split-K over the keys).",
    "- Autotuning the tile sizes per GPU, instead of one choice measured on one GPU.",
]


def build_lines(docs: dict, fig_rel: str = "visualizations") -> list[str]:
    p5, tc, p6 = docs.get("phase5"), docs.get("tc"), docs.get("phase6")
    lines = ["# Final report: attention from PyTorch to fused CUDA kernels", "",
             "_Generated by final/report_gen.py from the phases' results files; do not edit by hand._", ""]
    p1 = docs.get("phase1")
    if p1:
        share = p1["profile"]["range_shares"]["attention"]
        sh = p1["profile"]["shape"]
        lines += [f"The starting point: in the phase 1 PyTorch model (batch {sh['batch']}, seq {sh['seq']}), "
                  f"attention takes {share:.0%} of the forward's GPU time. Six phases later:", ""]
    if p5:
        for D in (64, 128):
            lines += [f"**Attention, FP32, B=4, H=8, S={S}, D={D}, non-causal: every phase in one run**", ""]
            lines += attention_fp32_table(p5, D) + [""]
    if tc:
        lines += [f"**Attention, FP16 on tensor cores, B=4, H=8, S={S}, non-causal**", ""]
        lines += attention_fp16_table(tc) + [""]
    if p6:
        from utils.report import layer_norm_mlp_table

        lines += layer_norm_mlp_table(p6)
    table, where = model_table(docs)
    if table:
        lines += [f"**The whole model** ({where})", ""] + table + [""]
    lines += ["## What worked, and why", ""] + worked(docs) + [""]
    lines += ["## What did not (yet)", ""] + did_not(docs) + [""]
    lines += ["## Lessons", ""] + lessons(docs) + [""]
    lines += ["## Future work", ""] + FUTURE + [""]
    lines += ["## Figures", ""]
    for name in viz.FIGURES:
        lines += [f"![{CAPTIONS[name]}]({fig_rel}/{name})", ""]
    lines += ["## Where the numbers come from", ""]
    for name, rel in viz.SOURCES.items():
        if docs.get(name):
            lines.append(f"- `{rel}`: {env_line(docs[name])}")
    ceilings, cenv = viz.ceilings_for(docs)
    lines += ["", "Ceilings (utils/results/ceilings.json, measured on the same GPU model, "
              f"{cenv['date'][:10]}, commit {cenv['commit']}): "
              + ", ".join(f"{k} {fmt(v)}" for k, v in ceilings.items() if isinstance(v, float)) + "."]
    return lines


# ------------------------------------------------------------------------------------------------
# PDF


def _plain(text: str) -> str:
    text = re.sub(r"\*\*(.+?)\*\*", r"\1", text)
    text = re.sub(r"_(.+?)_", r"\1", text) if text.startswith("_") else text
    return text.replace("`", "")


def _table_text(rows: list[str]) -> list[str]:
    cells = [[_plain(c.strip()) for c in r.strip().strip("|").split("|")] for r in rows
             if not re.fullmatch(r"\|?[\s|:-]+\|?", r.strip())]
    widths = [max(len(row[i]) if i < len(row) else 0 for row in cells) for i in range(max(map(len, cells)))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in cells]


def render_pdf(lines: list[str], out_dir: Path, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages

    W, H, top, bottom, left = 8.27, 11.69, 0.95, 0.05, 0.06
    blocks, figures, i = [], [], 0
    while i < len(lines):  # (kind, text) blocks
        line = lines[i]
        if line.startswith("|"):
            table = []
            while i < len(lines) and lines[i].startswith("|"):
                table.append(lines[i])
                i += 1
            blocks += [("mono", t) for t in _table_text(table)] + [("gap", "")]
            continue
        m = re.match(r"!\[(.*)\]\((.*)\)", line)
        if m:
            figures.append((m.group(1), out_dir / m.group(2)))
        elif line.startswith("# "):
            blocks.append(("h1", line[2:]))
        elif line.startswith("## "):
            blocks.append(("h2", line[3:]))
        elif line.strip():
            indent = "   " if line.startswith("- ") else ""
            wrapped = textwrap.wrap(_plain(line), 118, subsequent_indent=indent)
            blocks += [("text", w) for w in wrapped]
        else:
            blocks.append(("gap", ""))
        i += 1
    style = {"h1": (14, "bold", "sans-serif", 0.034), "h2": (11.5, "bold", "sans-serif", 0.03),
             "text": (7.4, "normal", "sans-serif", 0.0135), "mono": (6.2, "normal", "monospace", 0.0118),
             "gap": (5, "normal", "sans-serif", 0.007)}
    path = Path(path)
    with PdfPages(path, metadata={"CreationDate": None, "Creator": "final/report_gen.py"}) as pdf:
        fig, y = None, 0.0
        for kind, text in blocks:
            size, weight, family, step = style[kind]
            if fig is None or y - step < bottom:
                if fig is not None:
                    pdf.savefig(fig)
                    plt.close(fig)
                fig, y = plt.figure(figsize=(W, H)), top
                if kind == "gap":
                    continue
            fig.text(left, y, text, fontsize=size, weight=weight, family=family, va="top")
            y -= step
        if fig is not None:
            pdf.savefig(fig)
            plt.close(fig)
        for caption, png in figures:
            if not png.exists():
                continue
            img = mpimg.imread(png)
            fig = plt.figure(figsize=(H, W))  # landscape page per figure
            ax = fig.add_axes([0.02, 0.02, 0.96, 0.90])
            ax.imshow(img)
            ax.axis("off")
            fig.text(0.5, 0.96, caption, ha="center", fontsize=12, weight="bold")
            pdf.savefig(fig)
            plt.close(fig)
    return path


def generate(out_dir: Path = FINAL_DIR, figures: bool = True, root: Path = REPO_ROOT) -> list[Path]:
    """Figures (unless figures=False), report.md and report.pdf under out_dir; the paths written."""
    out_dir = Path(out_dir)
    docs = viz.load_results(root)
    if not any(docs.values()):
        print("final.report_gen: no results files yet (they come from `make run` on a GPU)")
        return []
    written = viz.render_all(out_dir / "visualizations", root) if figures else []
    lines = build_lines(docs)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text("\n".join(lines).rstrip() + "\n")
    written += [md, render_pdf(lines, out_dir, out_dir / "report.pdf")]
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write final/report.md and report.pdf from the results")
    parser.add_argument("--out", type=Path, default=FINAL_DIR, help="folder (default final/); figures go in OUT/visualizations")
    parser.add_argument("--no-figures", action="store_true", help="use the figures already in OUT/visualizations")
    args = parser.parse_args(argv)
    for path in generate(args.out, figures=not args.no_figures):
        print(f"wrote {viz.display_path(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
