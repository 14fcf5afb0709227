"""`python -m phase3_tiled.run [--quick]`: benchmark, profile and plot phase 3 on the GPU.

1. Attention forward at B=4, H=8, D in {64, 128}, causal and not, S from 128 to 4096 (8192 at
   D=64), beside torch_naive, sdpa_math, sdpa_efficient and phase2_naive, all timed in the same
   run. The
   default tile (phase3_tiled_t16) runs in every panel; tiles 8 and 32 in the non-causal panels
   (the tile-size sweep; causal changes no work in these kernels). Each kernel of ours is
   measured at a larger S only while one call is predicted under its budget (BUDGETS_MS), which
   keeps the run under 2 minutes: phase2_naive stops first.
2. Each kernel on its own (matmul_qk, softmax, matmul_av) for every tile, beside cuBLAS and
   torch.softmax (and phase 2's kernels at S=1024).
3. The compiler report (registers, shared memory, theoretical occupancy: compiler_report.py) and
   Nsight Compute on one attention call per tile at the headline shape (achieved occupancy, bank
   conflicts, sectors per request, DRAM bytes).
4. results/metrics.json, results/tiled_roofline.png, results/speed_vs_seq.png,
   results/tile_size_comparison.png, and the generated results section of README.md.
Without a GPU it regenerates the plots and the README section from results/metrics.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from phase2_naive import run as common
from phase2_naive.run import HEADLINE
from utils.readme import env_line, fmt, update_readme

HERE = Path(__file__).resolve().parent
NAME = "phase3_tiled"
TILES = (8, 16, 32)
IMPLS = {t: f"{NAME}_t{t}" for t in TILES}
DEFAULT_IMPL = IMPLS[16]
SEQ_LENS = {64: (128, 256, 512, 1024, 2048, 4096, 8192), 128: (128, 256, 512, 1024, 2048, 4096)}
QUICK_SEQ_LENS = {64: (128, 256, 512, 1024, 2048)}
BUDGETS_MS = {"phase2_naive": 100.0, IMPLS[8]: 100.0, IMPLS[16]: 300.0, IMPLS[32]: 100.0}
KERNEL_SHAPES = ((1024, 64), (4096, 64), (4096, 128))
KERNEL_OPS = {"tiled_qk_kernel": "matmul_qk", "block_softmax_kernel": "softmax",
              "tiled_av_kernel": "matmul_av"}
TARGET = {"rule": "phase3_tiled_t16 attention at least 2x faster than phase2_naive at S >= 1024, D=64",
          "min_speedup": 2.0, "min_S": 1024, "D": 64}


def tiled_impl(tile: int):
    import phase3_tiled as ph

    ph.load()
    return lambda q, k, v, causal: ph.attention(q, k, v, is_causal=causal, tile=tile)


def impl_factories() -> dict:
    factories = {IMPLS[t]: (lambda t=t: tiled_impl(t)) for t in TILES}
    factories["phase2_naive"] = common.phase2_impl
    return factories


# ------------------------------------------------------------------------------------------------


def target_check(rows: list[dict]) -> dict:
    """Speed-up of the default tile over phase 2 wherever both were measured (S >= 1024, D=64)."""
    pairs = []
    for r in rows:
        if (r["impl"] == DEFAULT_IMPL and r["op"] == "attention" and r["D"] == TARGET["D"]
                and r["Sq"] >= TARGET["min_S"]):
            base = [b for b in rows if b["impl"] == "phase2_naive" and b["op"] == "attention"
                    and all(b[k] == r[k] for k in ("B", "H", "Sq", "Sk", "D", "causal"))]
            if base:
                pairs.append({"S": r["Sq"], "causal": r["causal"], "phase2_ms": base[0]["ms"],
                              "phase3_ms": r["ms"], "speedup": base[0]["ms"] / r["ms"]})
    met = all(p["speedup"] >= TARGET["min_speedup"] for p in pairs) if pairs else None
    return {**TARGET, "pairs": pairs, "met": met}


def plot_tiles(doc: dict, path: Path) -> None:
    """Left: attention TFLOP/s against S per tile (non-causal, D=64 solid, D=128 dashed).
    Right: time of each kernel per tile at the largest per-kernel shape with D=64."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {IMPLS[8]: "tab:blue", IMPLS[16]: "tab:orange", IMPLS[32]: "tab:green"}
    for impl, color in colors.items():
        for D, style in ((64, "-"), (128, "--")):
            pts = sorted((r["Sq"], r["tflops"]) for r in rows if r["impl"] == impl and r["op"] == "attention"
                         and r["D"] == D and not r["causal"])
            if pts:
                left.plot(*zip(*pts), style, marker="o", color=color, label=f"{impl} D={D}")
    left.set_xscale("log", base=2)
    left.set_xlabel("sequence length S")
    left.set_ylabel("attention TFLOP/s")
    left.set_title("attention forward, B=4 H=8, non-causal", fontsize=10)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7)

    kernel = [r for r in rows if r["op"] != "attention" and r["impl"] in colors and r["D"] == 64]
    if kernel:
        S = max(r["Sq"] for r in kernel)
        ops = ("matmul_qk", "softmax", "matmul_av")
        width = 0.25
        for n, (impl, color) in enumerate(colors.items()):
            ms = [next((r["ms"] for r in kernel if r["impl"] == impl and r["op"] == op and r["Sq"] == S), 0.0)
                  for op in ops]
            right.bar([x + (n - 1) * width for x in range(len(ops))], ms, width, color=color, label=impl)
        right.set_xticks(range(len(ops)), ops)
        right.set_ylabel("ms")
        right.set_title(f"each kernel, B=4 H=8 S={S} D=64", fontsize=10)
        right.grid(True, axis="y", alpha=0.3)
        right.legend(fontsize=7)
    e = doc["env"]
    fig.suptitle(f"Phase 3 tile size T = 8, 16, 32 — {e['gpu']}, torch {e['torch']}, {e['date'][:10]}, "
                 f"{e['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compiler_table(records: list[dict]) -> list[str]:
    if not records:
        return ["compiler report not available", ""]
    lines = ["| kernel | threads/block | registers | shared mem B | spills B | blocks/SM | "
             "theoretical occupancy % | limited by |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        spills = r.get("spill_stores", 0) + r.get("spill_loads", 0)
        lines.append(f"| {r['name']} | {r['threads']} | {r.get('registers')} | {r.get('smem_bytes')} | "
                     f"{spills} | {r['blocks_per_sm']} | {fmt(r['occupancy_pct'])} | {r['limited_by']} |")
    return lines + [""]


def target_lines(target: dict) -> list[str]:
    if not target.get("pairs"):
        return [f"Target ({target['rule']}): no pair of rows measured.", ""]
    lines = [f"Target: {target['rule']} — **{'met' if target['met'] else 'NOT met'}**.", "",
             "| S | causal | phase2_naive ms | phase3_tiled_t16 ms | speed-up |", "|---|---|---|---|---|"]
    for p in target["pairs"]:
        lines.append(f"| {p['S']} | {p['causal']} | {fmt(p['phase2_ms'])} | {fmt(p['phase3_ms'])} | "
                     f"{fmt(p['speedup'])} |")
    return lines + [""]


def render(doc: dict, results: Path) -> None:
    from utils.attention_bench import plot_speed_vs_seq
    from utils.roofline import plot_roofline

    env = doc["env"]
    attention = [r for r in doc["rows"] if r["op"] == "attention"]
    plot_speed_vs_seq(attention, results / "speed_vs_seq.png", "Phase 3: tiled kernels vs phase 2 and PyTorch", env)
    plot_tiles(doc, results / "tile_size_comparison.png")
    h = HEADLINE
    points = common.roofline_points_with_kernels(doc, [DEFAULT_IMPL])
    plot_roofline(points, doc["ceilings"], results / "tiled_roofline.png",
                  f"Phase 3 Roofline: attention B={h['B']} H={h['H']} S={h['S']} D={h['D']}, "
                  f"and each kernel of {DEFAULT_IMPL}", env=env)
    lines = [env_line(doc), "",
             *common.attention_table(common.headline_rows(attention), "Attention forward at the headline shape"),
             *target_lines(doc.get("target", {"rule": TARGET["rule"]})),
             "**Each kernel on its own**", "", *common.kernel_table(doc["rows"]),
             "**Compiler report** (ptxas -v; occupancy from the per-SM limits)", "",
             *compiler_table(doc.get("compiler", [])),
             "**Nsight Compute**", "", *common.ncu_table(doc.get("ncu", {})),
             "Plots: [speed vs S](results/speed_vs_seq.png), [tile sizes](results/tile_size_comparison.png), "
             "[Roofline](results/tiled_roofline.png)."]
    update_readme(HERE / "README.md", lines)


def render_quick(doc: dict, results: Path) -> None:
    from utils.attention_bench import plot_speed_vs_seq

    plot_speed_vs_seq([r for r in doc["rows"] if r["op"] == "attention"], results / "speed_vs_seq.png",
                      "Phase 3 (quick run)", doc["env"])
    plot_tiles(doc, results / "tile_size_comparison.png")


def main(argv=None) -> int:
    args = common.parse_args(argv, "Phase 3 benchmark, compiler report, ncu profile and plots")
    if args.profile_target:
        common.profile_target(args.profile_target, impl_factories())
        return 0
    results = HERE / "results" / ("quick" if args.quick else "")
    metrics = results / "metrics.json"
    if not torch.cuda.is_available():
        return common.regenerate_without_gpu(HERE / "results" / "metrics.json", HERE / "results", render)

    from utils.results import read_results, write_results
    from utils.roofline import get_ceilings

    from phase3_tiled import compiler_report
    import phase2_naive as ph2
    import phase3_tiled as ph3

    start = time.perf_counter()
    ceilings = get_ceilings()
    tiled = {IMPLS[t]: tiled_impl(t) for t in TILES}
    naive = common.phase2_impl()
    seq_lens = QUICK_SEQ_LENS if args.quick else SEQ_LENS
    panels = []
    for D in seq_lens:
        for causal in (False, True):
            ours = tiled if not causal else {DEFAULT_IMPL: tiled[DEFAULT_IMPL]}
            panels.append({"D": D, "causal": causal, "seq_lens": seq_lens[D],
                           "impls": {**common.peer_impls(), "phase2_naive": naive, **ours}})
    rows = common.sweep_with_budget(panels, BUDGETS_MS)

    print("each kernel on its own:", flush=True)
    shapes = KERNEL_SHAPES[:1] if args.quick else KERNEL_SHAPES
    for t in TILES:
        ops = {"matmul_qk": lambda q, k, t=t: ph3.matmul_qk(q, k, tile=t), "softmax": ph3.softmax,
               "matmul_av": lambda p, v, t=t: ph3.matmul_av(p, v, tile=t)}
        if t != 16:
            ops.pop("softmax")  # the softmax has no tile: measured once, under the default's name
        rows += common.kernel_rows(IMPLS[t], ops, shapes)
    rows += common.kernel_rows("phase2_naive", {"matmul_qk": ph2.matmul_qk, "softmax": ph2.softmax,
                                                "matmul_av": ph2.matmul_av}, KERNEL_SHAPES[:1])
    for impl, ops in common.torch_kernel_ops().items():
        rows += common.kernel_rows(impl, ops, shapes)

    try:
        compiler = compiler_report.report()
    except Exception as exc:  # the benchmark stands without it; say why in the results
        print(f"compiler report failed: {exc}", flush=True)
        compiler = []
    ncu = ({"shape": HEADLINE, "note": "skipped (--no-ncu)", "kernels": []} if args.no_ncu
           else common.profile(f"{NAME}.run", [IMPLS[t] for t in TILES], "tiled_|block_softmax", KERNEL_OPS))
    write_results(metrics, rows, ceilings, ncu=ncu, compiler=compiler, target=target_check(rows),
                  headline=HEADLINE, budgets_ms=BUDGETS_MS)
    doc = read_results(metrics)
    (render_quick if args.quick else render)(doc, results)
    print(f"wrote {metrics.relative_to(HERE.parent)} and plots in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
