"""The README's results table, regenerated from the phases' results files (never typed by hand).

`python -m utils.report` rewrites the section between the results markers of README.md. The attention
rows come from phase 5's benchmark, which times every phase's kernel and the peers in one run on the
same inputs; the tensor-core rows from phase 5's tc benchmark; LayerNorm and MLP from phase 6.
"""

from __future__ import annotations

import sys

from utils import gpu_checks, grading_doc
from utils.build import REPO_ROOT
from utils.readme import env_line, fmt, update_readme
from utils.results import read_results

FP32_ATTENTION = REPO_ROOT / "phase5_fused" / "results" / "metrics.json"
TC_ATTENTION = REPO_ROOT / "phase5_fused" / "results" / "tc_metrics.json"
LAYER_NORM_MLP = REPO_ROOT / "phase6_layernorm_mlp" / "results" / "metrics.json"
BASELINE = REPO_ROOT / "phase1_baseline" / "results" / "baseline_metrics.json"
HEADLINE = {"B": 4, "H": 8, "Sq": 4096, "causal": False}


def _row(table, **match):
    found = [r for r in table if all(r.get(k) == v for k, v in match.items())]
    return found[0] if found else None


def attention_table(doc: dict, impls: list[str], peer: str, dtype: str, title: str) -> list[str]:
    lines = [f"**{title}** (B=4, H=8, S=4096, non-causal; {env_line(doc)})", "",
             f"| impl | D | ms | TFLOP/s | % of {peer}'s speed |", "|---|---|---|---|---|"]
    for D in (64, 128):
        base = _row(doc["rows"], impl=peer, op="attention", D=D, dtype=dtype, **HEADLINE)
        for impl in impls:
            r = _row(doc["rows"], impl=impl, op="attention", D=D, dtype=dtype, **HEADLINE)
            if r is None:
                continue
            share = f"{base['ms'] / r['ms']:.0%}" if base else "–"
            lines.append(f"| {impl} | {D} | {fmt(r['ms'])} | {fmt(r['tflops'])} | {share} |")
    return lines + [""]


def layer_norm_mlp_table(doc: dict) -> list[str]:
    lines = [f"**LayerNorm and MLP, FP32** ({env_line(doc)})", "",
             "| impl | op | shape | ms | GB/s or TFLOP/s | % of the torch peer's speed |", "|---|---|---|---|---|---|"]
    for rows_, hidden in ((65536, 1024), (65536, 4096)):
        ours = _row(doc["rows"], impl="phase6_layer_norm", op="layer_norm", rows=rows_, hidden=hidden, dtype="float32")
        torch_ = _row(doc["rows"], impl="torch_layer_norm", op="layer_norm", rows=rows_, hidden=hidden, dtype="float32")
        for r in (ours, torch_):
            if r:
                share = f"{torch_['ms'] / r['ms']:.0%}" if torch_ else "–"
                lines.append(f"| {r['impl']} | layer_norm | {rows_}x{hidden} | {fmt(r['ms'])} | {fmt(r['gbps'])} GB/s | {share} |")
    torch_mlp = _row(doc["rows"], impl="torch_mlp", op="mlp")
    for impl in ("phase6_mlp", "torch_mlp", "torch_mlp_compiled"):
        r = _row(doc["rows"], impl=impl, op="mlp")
        if r:
            share = f"{torch_mlp['ms'] / r['ms']:.0%}" if torch_mlp else "–"
            shape = f"{r['tokens']} tokens, {r['hidden']}→{r['inner']}→{r['hidden']}"
            lines.append(f"| {impl} | mlp | {shape} | {fmt(r['ms'])} | {fmt(r.get('tflops'))} TFLOP/s | {share} |")
    return lines + [""]


def readme_lines() -> list[str]:
    lines: list[str] = []
    if BASELINE.exists():
        doc = read_results(BASELINE)
        share = doc["profile"]["range_shares"]["attention"]
        shape = doc["profile"]["shape"]
        lines += [f"Phase 1: attention takes {share:.0%} of the baseline model's GPU time at batch "
                  f"{shape['batch']}, seq {shape['seq']} ({env_line(doc)})", ""]
    if FP32_ATTENTION.exists():
        lines += attention_table(read_results(FP32_ATTENTION),
                                 ["phase2_naive", "phase3_tiled_t16", "phase4_coalesced", "phase5_fused_teaching",
                                  "phase5_fused", "torch_naive", "sdpa_efficient"],
                                 "sdpa_efficient", "float32", "Attention, FP32: every phase in one run")
    if TC_ATTENTION.exists():
        lines += attention_table(read_results(TC_ATTENTION), ["phase5_fused_tc", "sdpa_flash", "sdpa_cudnn"],
                                 "sdpa_flash", "float16", "Attention, FP16 on tensor cores")
    if LAYER_NORM_MLP.exists():
        lines += layer_norm_mlp_table(read_results(LAYER_NORM_MLP))
    return lines or ["No results yet: run `make run` on a GPU."]


def main() -> int:
    update_readme(REPO_ROOT / "README.md", readme_lines(), source="the phases' results files",
                  script="utils/report.py")
    print("README.md results table regenerated from the results files")
    return gpu_checks.main() or grading_doc.main()


if __name__ == "__main__":
    sys.exit(main())
