"""`python -m phase2_naive.run [--quick]`: benchmark, profile and plot phase 2 on the GPU.

1. Attention forward at B=4, H=8, D in {64, 128}, causal and not, S from 128 to 4096 (8192 at
   D=64), beside torch_naive, sdpa_math and sdpa_efficient timed in the same run. The naive kernels are slow:
   phase2_naive is measured at a larger S only while one call is predicted (time at the previous
   S, times the growth of S*S) to stay under MAX_CALL_MS, which keeps the run under 2 minutes.
2. Each kernel on its own (matmul_qk, softmax, matmul_av) beside cuBLAS / torch.softmax.
3. Nsight Compute on one attention call at the headline shape (this script's --profile-target).
4. results/metrics.json, results/naive_roofline.png, results/speed_vs_seq.png, and the generated
   results section of README.md.
Without a GPU it regenerates the plots and the README section from results/metrics.json.
The helpers here are reused by later phases' run.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from utils.readme import env_line, fmt, update_readme

HERE = Path(__file__).resolve().parent
NAME = "phase2_naive"
HEADLINE = {"B": 4, "H": 8, "S": 2048, "D": 64, "causal": False}   # ncu and Roofline shape
SEQ_LENS = {64: (128, 256, 512, 1024, 2048, 4096, 8192), 128: (128, 256, 512, 1024, 2048, 4096)}
QUICK_SEQ_LENS = {64: (128, 256, 512, 1024, 2048)}
MAX_CALL_MS = 120.0
KERNEL_SHAPES = ((1024, 64), (2048, 64), (2048, 128))               # (S, D) of the per-kernel rows
KERNEL_OPS = {"naive_qk_kernel": "matmul_qk", "naive_softmax_kernel": "softmax",
              "naive_av_kernel": "matmul_av"}


# ------------------------------------------------------------------------------------------------
# Implementations: f(q, k, v, is_causal) -> out


def peer_impls() -> dict:
    from utils import peers

    def wrap(fn):
        return lambda q, k, v, causal: fn(q, k, v, is_causal=causal)

    return {"torch_naive": wrap(peers.torch_naive), "sdpa_math": wrap(peers.sdpa("sdpa_math")),
            "sdpa_efficient": wrap(peers.sdpa("sdpa_efficient"))}


def phase2_impl():
    import phase2_naive as ph

    ph.load()
    return lambda q, k, v, causal: ph.attention(q, k, v, is_causal=causal)


# ------------------------------------------------------------------------------------------------
# Sweeps


def sweep_with_budget(panels: list[dict], budgets: dict[str, float], desc="attention"):
    """Attention rows for every panel {"D", "causal", "seq_lens", "impls": {name: fn}} and each of
    its S (ascending).

    An impl named in `budgets` (name -> max ms per call) runs at the next S of a panel only while
    its time at the previous S, scaled by the growth of S*S, stays under its budget; once skipped
    (or out of memory) it stays out of that panel.
    """
    from utils.attention_bench import benchmark_attention

    rows = []
    total = sum(len(panel["seq_lens"]) for panel in panels)
    n = 0
    for panel in panels:
        active = dict(panel["impls"])
        last: dict = {}  # impl -> (S, ms) of its last measurement in this panel
        for S in panel["seq_lens"]:
            n += 1
            for name, budget in budgets.items():
                if name in active and name in last:
                    S0, ms0 = last[name]
                    if ms0 * (S / S0) ** 2 > budget:
                        print(f"    {name}: skipped from S={S} on (predicted "
                              f"{ms0 * (S / S0) ** 2:.0f} ms per call > {budget:.0f} ms)", flush=True)
                        del active[name]
            config = {"B": HEADLINE["B"], "H": HEADLINE["H"], "S": S, "D": panel["D"],
                      "causal": panel["causal"]}
            new = benchmark_attention(active, [config], desc=f"{desc} {n}/{total}")
            measured = {r["impl"] for r in new}
            for name in budgets:
                if name in active and name not in measured:
                    del active[name]
            for r in new:
                last[r["impl"]] = (S, r["ms"])
            rows += new
    return rows


def kernel_rows(impl: str, ops: dict, shapes, B=4, H=8, reference_limit=2**28) -> list[dict]:
    """Rows for each kernel on its own. ops: {"matmul_qk": f(q, k), "softmax": f(s),
    "matmul_av": f(p, v)}; any may be missing. Inputs are fresh random tensors per shape."""
    from utils import roofline
    from utils.bench import time_cuda
    from utils.testing import random_qkv, randn, rel_error
    from utils import reference

    rows = []
    for S, D in shapes:
        q, k, v = random_qkv(B, H, S, S, D)
        s = randn(B, H, S, S)
        p = torch.softmax(s, dim=-1)
        small = B * H * S * S <= reference_limit
        cases = {
            "matmul_qk": (lambda: ops["matmul_qk"](q, k), roofline.matmul_flops(S, S, D, B * H),
                          roofline.matmul_bytes(S, S, D, B * H),
                          (lambda: (q.double() @ k.double().transpose(-1, -2)) / D**0.5) if small else None),
            "softmax": (lambda: ops["softmax"](s), roofline.softmax_flops(B * H * S, S),
                        roofline.softmax_bytes(B * H * S, S),
                        (lambda: reference.softmax(s)) if small else None),
            "matmul_av": (lambda: ops["matmul_av"](p, v), roofline.matmul_flops(S, D, S, B * H),
                          roofline.matmul_bytes(S, D, S, B * H),
                          (lambda: p.double() @ v.double()) if small else None),
        }
        for op, (fn, flops, nbytes, ref) in cases.items():
            if op not in ops:
                continue
            ms = time_cuda(fn, warmup=2, reps=10, max_seconds=1.0)
            row = {"impl": impl, "op": op, "B": B, "H": H, "Sq": S, "Sk": S, "D": D,
                   "dtype": "float32", "causal": False, "ms": ms,
                   "tflops": roofline.tflops(flops, ms), "gbps": roofline.gbps(nbytes, ms)}
            if ref is not None:
                row["rel_err"] = rel_error(fn(), ref())
            rows.append(row)
            print(f"    {impl:<18} {op:<10} S={S} D={D}: {ms:.3f} ms", flush=True)
        del q, k, v, s, p
        torch.cuda.empty_cache()
    return rows


def torch_kernel_ops() -> dict:
    """The per-kernel peers: cuBLAS SGEMM (TF32 off) for the matmuls, torch.softmax."""
    from utils.peers import no_tf32

    def mm_qk(q, k):
        with no_tf32():
            return torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)

    def mm_av(p, v):
        with no_tf32():
            return torch.matmul(p, v)

    return {"cublas": {"matmul_qk": mm_qk, "matmul_av": mm_av},
            "torch_naive": {"softmax": lambda s: torch.softmax(s, dim=-1)}}


# ------------------------------------------------------------------------------------------------
# Nsight Compute


def headline_inputs():
    from utils.testing import random_qkv

    h = HEADLINE
    return random_qkv(h["B"], h["H"], h["S"], h["S"], h["D"])


def profile(module: str, targets: list[str], kernel_regex: str, kernel_ops: dict) -> dict:
    """ncu records for `python -m module --profile-target T` (each target one attention call at
    the headline shape), labelled with impl and op; or a note saying why ncu did not run."""
    from utils.ncu import NcuUnavailable, profile_python, summarize

    try:
        records = profile_python([module, "--profile-target", ",".join(targets)], kernel_regex,
                                 launch_count=3 * len(targets))
    except (NcuUnavailable, OSError) as exc:
        print(f"ncu: not run ({str(exc).splitlines()[0]})", flush=True)
        return {"shape": HEADLINE, "note": f"ncu unavailable: {exc}", "kernels": []}
    print(summarize(records), flush=True)
    for n, r in enumerate(records):
        r["impl"] = targets[n // 3] if n // 3 < len(targets) else "?"
        r["op"] = next((op for key, op in kernel_ops.items() if key in r["kernel"]), "?")
    return {"shape": HEADLINE, "kernels": records}


def ncu_bytes_by_impl(ncu: dict) -> dict:
    totals: dict = {}
    for r in ncu.get("kernels", []):
        if r.get("dram_bytes") is not None:
            totals[r["impl"]] = totals.get(r["impl"], 0.0) + r["dram_bytes"]
    return totals


# ------------------------------------------------------------------------------------------------
# Plots and the README section (from the results document only)


def headline_rows(rows: list[dict]) -> list[dict]:
    h = HEADLINE
    return [r for r in rows if r["op"] == "attention" and r["B"] == h["B"] and r["H"] == h["H"]
            and r["Sq"] == h["S"] and r["D"] == h["D"] and r["causal"] == h["causal"]]


def roofline_points_with_kernels(doc: dict, kernel_impls: list[str]) -> list[dict]:
    """Attention points at the headline shape (all impls) plus each profiled kernel of
    kernel_impls as its own point (analytic bytes, ncu bytes, ncu time)."""
    from utils import roofline
    from utils.attention_bench import roofline_points

    h = HEADLINE
    match = {"op": "attention", "B": h["B"], "H": h["H"], "Sq": h["S"], "D": h["D"],
             "causal": h["causal"]}
    points = roofline_points(doc["rows"], match, ncu_bytes_by_impl(doc.get("ncu", {})))
    B, H, S, D = h["B"], h["H"], h["S"], h["D"]
    models = {"matmul_qk": (roofline.matmul_flops(S, S, D, B * H), roofline.matmul_bytes(S, S, D, B * H)),
              "softmax": (roofline.softmax_flops(B * H * S, S), roofline.softmax_bytes(B * H * S, S)),
              "matmul_av": (roofline.matmul_flops(S, D, S, B * H), roofline.matmul_bytes(S, D, S, B * H))}
    for r in doc.get("ncu", {}).get("kernels", []):
        if r.get("impl") in kernel_impls and r.get("op") in models and r.get("time_ns"):
            flops, nbytes = models[r["op"]]
            points.append({"label": f"{r['impl']} {r['op']}", "flops": flops, "bytes": nbytes,
                           "ms": r["time_ns"] / 1e6, "measured_bytes": r.get("dram_bytes")})
    return points


def attention_table(rows: list[dict], title: str) -> list[str]:
    base = {r["impl"]: r for r in rows}.get("torch_naive")
    lines = [f"**{title}**", "", "| impl | ms | TFLOP/s | × torch_naive | extra MB | rel err |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["ms"]):
        speed = base["ms"] / r["ms"] if base else None
        lines.append(f"| {r['impl']} | {fmt(r['ms'])} | {fmt(r['tflops'])} | {fmt(speed)} | "
                     f"{fmt(r.get('extra_mb'), 4)} | {fmt(r.get('rel_err'), 2)} |")
    return lines + [""]


def kernel_table(rows: list[dict]) -> list[str]:
    lines = ["| impl | op | S | D | ms | TFLOP/s | GB/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["op"] != "attention":
            lines.append(f"| {r['impl']} | {r['op']} | {r['Sq']} | {r['D']} | {fmt(r['ms'])} | "
                         f"{fmt(r['tflops'])} | {fmt(r['gbps'])} |")
    return lines + [""]


def ncu_table(ncu: dict) -> list[str]:
    if not ncu.get("kernels"):
        return [f"ncu did not run: {ncu.get('note', 'no records')}", ""]
    cols = [("time_ns", "time µs", 1e-3), ("dram_bytes", "DRAM MB", 1e-6), ("dram_GBps", "DRAM GB/s", 1),
            ("l1_bytes", "L1 MB", 1e-6), ("l2_bytes", "L2 MB", 1e-6),
            ("sectors_per_request", "sectors/req", 1), ("occupancy_pct", "occupancy %", 1),
            ("smem_ld_conflicts", "smem ld confl.", 1), ("smem_st_conflicts", "smem st confl.", 1),
            ("registers", "regs", 1), ("fp32_GFLOPs", "FP32 GFLOP/s", 1)]
    s = ncu["shape"]
    lines = [f"B={s['B']}, H={s['H']}, S={s['S']}, D={s['D']}, "
             f"{'causal' if s['causal'] else 'non-causal'}, one attention call per impl:", "",
             "| impl | op | " + " | ".join(c[1] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for r in ncu["kernels"]:
        vals = [fmt(r[k] * f) if r.get(k) is not None else "–" for k, _, f in cols]
        lines.append(f"| {r.get('impl')} | {r.get('op')} | " + " | ".join(vals) + " |")
    return lines + [""]


def render(doc: dict, results: Path) -> None:
    from utils.attention_bench import plot_speed_vs_seq
    from utils.roofline import plot_roofline

    env = doc["env"]
    attention = [r for r in doc["rows"] if r["op"] == "attention"]
    plot_speed_vs_seq(attention, results / "speed_vs_seq.png", "Phase 2: naive kernels vs PyTorch", env)
    points = roofline_points_with_kernels(doc, [NAME])
    h = HEADLINE
    plot_roofline(points, doc["ceilings"], results / "naive_roofline.png",
                  f"Phase 2 Roofline: attention B={h['B']} H={h['H']} S={h['S']} D={h['D']}, and each naive kernel",
                  env=env)
    lines = [env_line(doc), "", *attention_table(headline_rows(attention), "Attention forward at the headline shape"),
             "**Each kernel on its own**", "", *kernel_table(doc["rows"]),
             "**Nsight Compute**", "", *ncu_table(doc.get("ncu", {})),
             "Plots: [speed vs S](results/speed_vs_seq.png), [Roofline](results/naive_roofline.png)."]
    update_readme(HERE / "README.md", lines)


def regenerate_without_gpu(metrics: Path, results: Path, render_fn) -> int:
    from utils.results import read_results

    if not metrics.exists():
        print(f"no GPU and no results yet ({metrics.relative_to(HERE.parent)} missing): run this on a GPU machine")
        return 0
    doc = read_results(metrics)
    render_fn(doc, results)
    print(f"no GPU: plots and README section regenerated from {metrics.relative_to(HERE.parent)} "
          f"({doc['env']['gpu']}, {doc['env']['date'][:10]})")
    return 0


# ------------------------------------------------------------------------------------------------


def profile_target(names: str, impls: dict) -> None:
    """One attention call per named impl at the headline shape (run under ncu)."""
    q, k, v = headline_inputs()
    fns = {n: impls[n]() for n in names.split(",")}   # build/load before the profiled launches
    torch.cuda.synchronize()
    for name, fn in fns.items():
        fn(q, k, v, HEADLINE["causal"])
    torch.cuda.synchronize()


def parse_args(argv, description):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true",
                        help="a short sweep (D=64, S <= 2048) written to results/quick/")
    parser.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute step")
    parser.add_argument("--profile-target", metavar="NAMES",
                        help="internal: one headline attention call per named impl (for ncu)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv, "Phase 2 benchmark, ncu profile and plots")
    if args.profile_target:
        profile_target(args.profile_target, {NAME: phase2_impl})
        return 0
    results = HERE / "results" / ("quick" if args.quick else "")
    metrics = results / "metrics.json"
    if not torch.cuda.is_available():
        return regenerate_without_gpu(HERE / "results" / "metrics.json", HERE / "results", render)

    from utils.results import write_results
    from utils.roofline import get_ceilings

    start = time.perf_counter()
    ceilings = get_ceilings()
    naive = phase2_impl()
    seq_lens = QUICK_SEQ_LENS if args.quick else SEQ_LENS
    panels = [{"D": D, "causal": c, "seq_lens": seq_lens[D], "impls": {**peer_impls(), NAME: naive}}
              for D in seq_lens for c in (False, True)]
    rows = sweep_with_budget(panels, {NAME: MAX_CALL_MS})

    import phase2_naive as ph

    print("each kernel on its own:", flush=True)
    rows += kernel_rows(NAME, {"matmul_qk": ph.matmul_qk, "softmax": ph.softmax, "matmul_av": ph.matmul_av},
                        KERNEL_SHAPES[:1] if args.quick else KERNEL_SHAPES)
    for impl, ops in torch_kernel_ops().items():
        rows += kernel_rows(impl, ops, KERNEL_SHAPES[:1] if args.quick else KERNEL_SHAPES)

    ncu = ({"shape": HEADLINE, "note": "skipped (--no-ncu)", "kernels": []} if args.no_ncu
           else profile(f"{NAME}.run", [NAME], "naive_", KERNEL_OPS))
    write_results(metrics, rows, ceilings, ncu=ncu, headline=HEADLINE,
                  budget={"max_call_ms": MAX_CALL_MS, "note": "phase2_naive is measured at a larger S "
                          "only while one call is predicted under max_call_ms"})
    from utils.results import read_results

    doc = read_results(metrics)
    if args.quick:
        render_quick(doc, results)
    else:
        render(doc, results)
    print(f"wrote {metrics.relative_to(HERE.parent)} and plots in {time.perf_counter() - start:.0f} s")
    return 0


def render_quick(doc: dict, results: Path) -> None:
    from utils.attention_bench import plot_speed_vs_seq

    plot_speed_vs_seq([r for r in doc["rows"] if r["op"] == "attention"], results / "speed_vs_seq.png",
                      "Phase 2 (quick run)", doc["env"])


if __name__ == "__main__":
    sys.exit(main())
