"""Phase 4 benchmark: `python -m phase4_coalesced.run [--quick]`.

1. Attention forward at B=4, H=8, D in {64, 128}, S in {128 ... 4096} (8192 for the fast
   implementations), causal and not, beside its peers in the same run: torch_naive (cuBLAS SGEMM +
   torch softmax, TF32 off), sdpa_math, sdpa_efficient, phase2_naive (S <= 2048: it is slow) and
   phase3_tiled_t16 (S <= 4096).
2. Each kernel on its own at S=4096 (matmul_qk, softmax, matmul_av) beside phase 3's and beside
   cuBLAS SGEMM (torch.matmul, TF32 off, impl "cublas") and torch.softmax on the same shapes: the
   matmuls' TFLOP/s as a fraction of cuBLAS's.
3. Nsight Compute on one call each of phase3_tiled_t16, phase4_coalesced and torch_naive at the
   headline shape (B=4, H=8, S=4096, D=64): results/memory_analysis.txt compares the kernels before
   (phase 3) and after (phase 4), metric by metric.
4. results/coalesced_metrics.json (utils.results schema), results/coalesced_roofline.png,
   results/coalesced_speed.png, results/kernel_times.png, and the generated sections of README.md
   (measurement, ncu evidence, success checklist: readme_section.py).

Without a GPU it redraws the plots, the memory analysis and the README sections from the
committed json (a --quick run's json redraws the plots only).
`--profile-target NAME[,NAME...]` is the mode ncu runs: one call of each named impl at the
headline shape, each preceded by a one-thread marker kernel that tells the records apart.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from utils import peers, roofline
from utils.attention_bench import benchmark_attention, plot_speed_vs_seq, roofline_points
from utils.results import read_results, select, write_results

IMPL = "phase4_coalesced"
RESULTS = Path(__file__).resolve().parent / "results"
METRICS_PATH = RESULTS / "coalesced_metrics.json"
ANALYSIS_PATH = RESULTS / "memory_analysis.txt"
ROOFLINE_PATH = RESULTS / "coalesced_roofline.png"
SPEED_PATH = RESULTS / "coalesced_speed.png"
KERNELS_PATH = RESULTS / "kernel_times.png"

HEADLINE = {"B": 4, "H": 8, "S": 4096, "D": 64}
PROFILED = ("phase3_tiled_t16", IMPL, "torch_naive")
MARKER_KERNEL = "spin_kernel"  # what torch.cuda._sleep launches: the separator between impls
# Largest S each peer is timed at (the slow ones would take the whole time budget above it).
MAX_S = {"phase2_naive": 2048, "phase3_tiled_t16": 4096, "sdpa_math": 4096}
TARGETS = {"vs_torch_naive": 0.8, "vs_phase3": 1.3}


# ------------------------------------------------------------------------------------------------
# Implementations


_PEERS: dict = {}


def _phase_module(name: str):
    """A peer phase's package, built and loaded, or None (with a printed note) if it cannot be."""
    if name not in _PEERS:
        try:
            module = __import__(name)
            module.load()
            _PEERS[name] = module
        except Exception as exc:  # a missing package or a failed build only drops that peer
            print(f"note: peer {name} skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})",
                  flush=True)
            _PEERS[name] = None
    return _PEERS[name]


def attention_impls() -> dict:
    """{impl name: f(q, k, v, causal)} for phase 4 and every peer available here."""
    import phase4_coalesced as p4

    impls = {IMPL: lambda q, k, v, c: p4.attention(q, k, v, is_causal=c)}
    p3 = _phase_module("phase3_tiled")
    if p3 is not None:
        impls["phase3_tiled_t16"] = lambda q, k, v, c: p3.attention(q, k, v, is_causal=c, tile=16)
    p2 = _phase_module("phase2_naive")
    if p2 is not None:
        impls["phase2_naive"] = lambda q, k, v, c: p2.attention(q, k, v, is_causal=c)
    impls["torch_naive"] = lambda q, k, v, c: peers.torch_naive(q, k, v, is_causal=c)
    for name in ("sdpa_math", "sdpa_efficient"):
        fn = peers.sdpa(name)
        impls[name] = lambda q, k, v, c, fn=fn: fn(q, k, v, is_causal=c)
    return impls


def kernel_impls() -> dict:
    """{impl: {op: f}} for the per-kernel timings: phase 4, phase 3 and cuBLAS / torch."""
    import phase4_coalesced as p4

    def mm(a, b):
        with peers.no_tf32():
            return torch.matmul(a, b)

    out = {IMPL: {"matmul_qk": p4.matmul_qk, "softmax": p4.softmax, "matmul_av": p4.matmul_av},
           "cublas": {"matmul_qk": lambda q, k: mm(q, k.transpose(-1, -2)),
                      "matmul_av": mm},
           "torch_naive": {"softmax": lambda s: torch.softmax(s, dim=-1)}}
    p3 = _phase_module("phase3_tiled")
    if p3 is not None:
        out["phase3_tiled_t16"] = {"matmul_qk": lambda q, k: p3.matmul_qk(q, k, tile=16),
                                   "softmax": p3.softmax,
                                   "matmul_av": lambda p, v: p3.matmul_av(p, v, tile=16)}
    return out


# ------------------------------------------------------------------------------------------------
# Benchmarks


def sweep_configs(quick: bool) -> list[tuple[list[dict], tuple[str, ...] | None]]:
    """Groups of configs, each with the impls it runs (None: all that allow that S)."""
    B, H = HEADLINE["B"], HEADLINE["H"]
    seqs = (512, 4096) if quick else (128, 256, 512, 1024, 2048, 4096)
    dims = (64,) if quick else (64, 128)
    causal = (False,) if quick else (False, True)
    groups = [([{"B": B, "H": H, "S": S, "D": D, "causal": c} for D in dims for c in causal], None)
              for S in seqs]
    if not quick:  # S = 8192: the fast implementations only (one B*H*8192^2 fp32 buffer is 8.6 GB)
        groups.append(([{"B": B, "H": H, "S": 8192, "D": D, "causal": False} for D in dims],
                       (IMPL, "torch_naive", "sdpa_efficient")))
    return groups


def run_attention_sweep(impls: dict, quick: bool) -> list[dict]:
    rows = []
    for configs, only in sweep_configs(quick):
        S = configs[0]["S"]
        chosen = {n: f for n, f in impls.items()
                  if (only is None or n in only) and S <= MAX_S.get(n, S)}
        rows += benchmark_attention(chosen, configs, desc=f"attention S={S}")
    return rows


def run_kernel_timings(dims=(64, 128)) -> list[dict]:
    """Each kernel alone at S = 4096 (inputs shared by every impl): rows with op matmul_qk,
    softmax, matmul_av; TFLOP/s from the matmul/softmax FLOP models, GB/s from minimum bytes."""
    from utils.bench import time_cuda
    from utils.testing import random_qkv

    B, H, S = HEADLINE["B"], HEADLINE["H"], HEADLINE["S"]
    impls = kernel_impls()
    rows = []
    for D in dims:
        q, k, v = random_qkv(B, H, S, S, D)
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
        p = torch.softmax(s, dim=-1)
        args = {"matmul_qk": (q, k), "softmax": (s,), "matmul_av": (p, v)}
        models = {"matmul_qk": (roofline.matmul_flops(S, S, D, B * H), roofline.matmul_bytes(S, S, D, B * H)),
                  "matmul_av": (roofline.matmul_flops(S, D, S, B * H), roofline.matmul_bytes(S, D, S, B * H)),
                  "softmax": (roofline.softmax_flops(B * H * S, S), roofline.softmax_bytes(B * H * S, S))}
        for impl, ops in impls.items():
            for op, fn in ops.items():
                try:
                    ms = time_cuda(lambda: fn(*args[op]))
                except (RuntimeError, ValueError, TypeError) as exc:
                    print(f"    {impl} {op}: skipped ({str(exc).splitlines()[0][:100]})", flush=True)
                    continue
                flops, nbytes = models[op]
                rows.append({"impl": impl, "op": op, "B": B, "H": H, "Sq": S, "Sk": S, "D": D,
                             "dtype": "float32", "causal": False, "ms": ms,
                             "tflops": roofline.tflops(flops, ms), "gbps": roofline.gbps(nbytes, ms)})
                print(f"  kernel D={D} {impl:<18} {op:<10} {ms:8.3f} ms  "
                      f"{rows[-1]['tflops']:6.2f} TFLOP/s  {rows[-1]['gbps']:7.1f} GB/s", flush=True)
        del q, k, v, s, p, args
        torch.cuda.empty_cache()
    return rows


def matmul_fractions(rows: list[dict]) -> list[dict]:
    """Phase 4's matmul TFLOP/s as a fraction of cuBLAS SGEMM's on the same shapes, same run."""
    out = []
    for r in rows:
        if r["impl"] != IMPL or r["op"] not in ("matmul_qk", "matmul_av"):
            continue
        ref = select(rows, impl="cublas", op=r["op"], D=r["D"], Sq=r["Sq"])
        if ref:
            out.append({"op": r["op"], "D": r["D"], "S": r["Sq"], "phase4_tflops": r["tflops"],
                        "cublas_tflops": ref[0]["tflops"], "fraction": r["tflops"] / ref[0]["tflops"]})
    return out


def headline_targets(rows: list[dict]) -> dict:
    """Speed ratios at the headline shape (non-causal attention): > 1 means phase 4 is faster."""
    match = {"op": "attention", "Sq": HEADLINE["S"], "D": HEADLINE["D"], "causal": False}
    ms = {r["impl"]: r["ms"] for r in select(rows, **match)}
    out = {"shape": dict(HEADLINE, causal=False)}
    for key, peer in (("vs_torch_naive", "torch_naive"), ("vs_phase3", "phase3_tiled_t16")):
        if IMPL in ms and peer in ms:
            ratio = ms[peer] / ms[IMPL]
            out[key] = {"speedup": ratio, "target": TARGETS[key], "met": ratio >= TARGETS[key]}
    return out


# ------------------------------------------------------------------------------------------------
# Nsight Compute


def profile_target(names: list[str]) -> None:
    """One call of each named impl at the headline shape, each after a marker kernel."""
    B, H, S, D = HEADLINE["B"], HEADLINE["H"], HEADLINE["S"], HEADLINE["D"]
    gen = torch.Generator().manual_seed(0)
    # Inputs made on the CPU and copied: no RNG kernel among the profiled launches.
    q, k, v = (torch.randn(B, H, S, D, generator=gen).cuda() for _ in range(3))
    impls = attention_impls()
    torch.cuda.synchronize()
    for name in names:
        torch.cuda._sleep(1)
        if name in impls:
            impls[name](q, k, v, False)
    torch.cuda.synchronize()


def run_ncu() -> dict:
    """Per-kernel ncu records of the profiled impls: {"records": {impl: [...]}} or {"error": ...}."""
    from utils.ncu import NcuUnavailable, profile_python

    start = time.perf_counter()
    print("ncu: profiling " + ", ".join(PROFILED) + " at the headline shape ...", flush=True)
    try:
        records = profile_python([f"{IMPL}.run", "--profile-target", ",".join(PROFILED)],
                                 launch_count=60, timeout=150)
    except (NcuUnavailable, OSError) as exc:
        print(f"ncu unavailable: {exc}", flush=True)
        return {"error": str(exc)}
    except Exception as exc:  # a timeout, say: the benchmark results still stand
        print(f"ncu failed: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}
    by_impl: dict[str, list[dict]] = {}
    current = -1
    for r in records:
        if MARKER_KERNEL in r["kernel"]:
            current += 1
            continue
        name = PROFILED[current] if 0 <= current < len(PROFILED) else "unattributed"
        by_impl.setdefault(name, []).append(r)
    print(f"ncu: {len(records)} kernel records in {time.perf_counter() - start:.0f} s", flush=True)
    return {"shape": dict(HEADLINE, causal=False), "records": by_impl}


ANALYSIS_COLUMNS = (
    # (header, record key, scale, format)
    ("time ms", "time_ns", 1e-6, "{:.3f}"),
    ("sect/req", "sectors_per_request", 1, "{:.2f}"),
    ("DRAM rd MB", "dram_read_bytes", 1e-6, "{:.0f}"),
    ("DRAM wr MB", "dram_write_bytes", 1e-6, "{:.0f}"),
    ("L2 MB", "l2_bytes", 1e-6, "{:.0f}"),
    ("L1 MB", "l1_bytes", 1e-6, "{:.0f}"),
    ("smem ld confl", "smem_ld_conflicts", 1, "{:.3g}"),
    ("smem st confl", "smem_st_conflicts", 1, "{:.3g}"),
    ("occup %", "occupancy_pct", 1, "{:.1f}"),
    ("regs", "registers", 1, "{:.0f}"),
    ("DRAM GB/s", "dram_GBps", 1, "{:.0f}"),
    ("FP32 GFLOP/s", "fp32_GFLOPs", 1, "{:.0f}"),
)


def _short_kernel(name: str) -> str:
    for noise in ("(anonymous namespace)::", "void ", f"{IMPL}::"):
        name = name.replace(noise, "")
    return name.split("(")[0][:60]


def _cell(r: dict, key: str, scale: float, fmt: str) -> str:
    value = r.get(key)
    return "-" if value is None else fmt.format(value * scale)


def memory_analysis_text(ncu: dict, env: dict | None) -> str:
    """The before (phase 3) / after (phase 4) ncu table, kernel by kernel, from the records."""
    shape = ncu.get("shape", HEADLINE)
    lines = [f"Phase 4 memory analysis: ncu --clock-control none, one call of each impl at "
             f"B={shape['B']} H={shape['H']} S={shape['S']} D={shape['D']} (non-causal, float32)."]
    if env:
        lines.append(f"Measured on {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, "
                     f"{env['date']}, commit {env['commit']}.")
    lines += ["Generated by phase4_coalesced/run.py from the records in coalesced_metrics.json; "
              "do not edit by hand.", ""]
    if "error" in ncu:
        return "\n".join(lines + [f"ncu unavailable in this run: {ncu['error']}"]) + "\n"
    lines += [
        "Columns: sect/req = global load sectors per request (32-byte sectors; a warp's fully",
        "coalesced float4 load touches 16, a coalesced float load 4); DRAM/L2/L1 = bytes moved at",
        "that level; smem confl = shared-memory bank conflicts (extra wavefronts) of loads/stores;",
        "occup % = achieved warps / peak; regs = registers per thread.", ""]
    header = "kernel".ljust(62) + "".join(h.rjust(14) for h, *_ in ANALYSIS_COLUMNS)
    records = ncu.get("records", {})
    for impl, label in (("phase3_tiled_t16", "BEFORE: phase3_tiled (tile 16)"),
                        (IMPL, "AFTER: phase4_coalesced"),
                        ("torch_naive", "REFERENCE: torch_naive (cuBLAS SGEMM, TF32 off + torch softmax)"),
                        ("unattributed", "unattributed launches")):
        recs = records.get(impl)
        if not recs:
            if impl != "unattributed":
                lines += [label, "  (no records: impl not available in this run)", ""]
            continue
        lines += [label, header]
        for r in recs:
            lines.append(_short_kernel(r["kernel"]).ljust(62) +
                         "".join(_cell(r, key, sc, fmt).rjust(14) for _, key, sc, fmt in ANALYSIS_COLUMNS))
        total_t = sum(r.get("time_ns") or 0 for r in recs) * 1e-6
        total_b = sum(r.get("dram_bytes") or 0 for r in recs) * 1e-9
        lines += [f"  total: {total_t:.3f} ms of kernel time, {total_b:.2f} GB of DRAM traffic", ""]
    before, after = records.get("phase3_tiled_t16", []), records.get(IMPL, [])
    if len(before) == len(after) == 3:
        lines += ["Kernel by kernel, phase 3 -> phase 4 (same order: QK^T, softmax, AV):"]
        for op, b, a in zip(("matmul_qk", "softmax", "matmul_av"), before, after):
            parts = []
            for h, key, sc, fmt in ANALYSIS_COLUMNS[:10]:
                parts.append(f"{h} {_cell(b, key, sc, fmt)} -> {_cell(a, key, sc, fmt)}")
            lines.append(f"  {op:<10} " + "; ".join(parts))
        lines.append("")
    elif before and after:
        lines += [f"(phase 3 launched {len(before)} kernels and phase 4 {len(after)}: "
                  "compare the tables above by operation)", ""]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Plots


def kernel_roofline_points(kernel_rows: list[dict], ncu: dict) -> list[dict]:
    """Roofline points of each kernel alone at D=64 (phase 4 and cuBLAS/torch), with the ncu
    DRAM bytes of phase 4's kernels."""
    B, H, S, D = HEADLINE["B"], HEADLINE["H"], HEADLINE["S"], HEADLINE["D"]
    models = {"matmul_qk": (roofline.matmul_flops(S, S, D, B * H), roofline.matmul_bytes(S, S, D, B * H)),
              "softmax": (roofline.softmax_flops(B * H * S, S), roofline.softmax_bytes(B * H * S, S)),
              "matmul_av": (roofline.matmul_flops(S, D, S, B * H), roofline.matmul_bytes(S, D, S, B * H))}
    measured = ncu.get("records", {}).get(IMPL, [])
    points = []
    for r in kernel_rows:
        if r["D"] != D or r["impl"] not in (IMPL, "cublas", "torch_naive"):
            continue
        flops, nbytes = models[r["op"]]
        point = {"label": f"{r['impl']} {r['op']}", "flops": flops, "bytes": nbytes, "ms": r["ms"]}
        if r["impl"] == IMPL and len(measured) == 3:
            index = ("matmul_qk", "softmax", "matmul_av").index(r["op"])
            point["measured_bytes"] = measured[index].get("dram_bytes")
        points.append(point)
    return points


def plot_kernel_times(kernel_rows: list[dict], path: Path, env: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["D"] for r in kernel_rows})
    ops = ("matmul_qk", "softmax", "matmul_av")
    impls = list(dict.fromkeys(r["impl"] for r in kernel_rows))
    fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims), 4.2), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, D in zip(axes[0], dims):
        for n, impl in enumerate(impls):
            xs, ys = [], []
            for i, op in enumerate(ops):
                match = select(kernel_rows, impl=impl, op=op, D=D)
                if match:
                    xs.append(i + (n - (len(impls) - 1) / 2) * width)
                    ys.append(match[0]["ms"])
            ax.bar(xs, ys, width=width, label=impl)
        ax.set_xticks(range(len(ops)), ops)
        ax.set_ylabel("ms")
        S = kernel_rows[0]["Sq"]
        ax.set_title(f"each kernel alone, B=4 H=8 S={S} D={D}", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    stamp = f" — {env['gpu']}, torch {env['torch']}, {env['date'][:10]}, {env['commit']}" if env else ""
    fig.suptitle("Phase 4 kernels vs phase 3 and cuBLAS / torch" + stamp, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_everything(doc: dict) -> None:
    """Every PNG, memory_analysis.txt and the README sections, from a results document (fresh or
    read back)."""
    env, ceilings, rows = doc["env"], doc["ceilings"], doc["rows"]
    ncu = doc.get("ncu", {"error": "not recorded"})
    attention_rows = select(rows, op="attention")
    kernel_rows = [r for r in rows if r["op"] != "attention"]
    ANALYSIS_PATH.write_text(memory_analysis_text(ncu, env))
    if attention_rows:
        plot_speed_vs_seq(attention_rows, SPEED_PATH, "Phase 4 attention forward (float32)", env)
    if ceilings.get("dram_TBps"):
        ncu_bytes = {impl: sum(r.get("dram_bytes") or 0 for r in recs)
                     for impl, recs in ncu.get("records", {}).items() if recs}
        match = {"op": "attention", "B": HEADLINE["B"], "H": HEADLINE["H"], "Sq": HEADLINE["S"],
                 "D": HEADLINE["D"], "causal": False}
        points = roofline_points(attention_rows, match, ncu_bytes)
        points += kernel_roofline_points(kernel_rows, ncu)
        if points:
            roofline.plot_roofline(points, ceilings, ROOFLINE_PATH,
                                   "Phase 4: attention (fused minimum bytes) and each kernel alone, "
                                   "B=4 H=8 S=4096 D=64", env=env)
    if kernel_rows:
        plot_kernel_times(kernel_rows, KERNELS_PATH, env)
    if doc.get("quick"):
        print("quick run: README sections left as they are (they describe a full run)")
    else:
        from phase4_coalesced import readme_section

        readme_section.update(doc, HEADLINE, TARGETS, headline_targets)


# ------------------------------------------------------------------------------------------------


def print_summary(doc: dict) -> None:
    t = doc.get("targets", {})
    for key, label in (("vs_torch_naive", "torch_naive"), ("vs_phase3", "phase3_tiled_t16")):
        if key in t:
            print(f"headline S=4096 D=64: phase4 is {t[key]['speedup']:.2f}x the speed of {label} "
                  f"(target {t[key]['target']}x: {'met' if t[key]['met'] else 'NOT met'})")
    for f in doc.get("matmul_vs_cublas", []):
        print(f"{f['op']:<10} D={f['D']:<4} phase4 {f['phase4_tflops']:.1f} TFLOP/s = "
              f"{100 * f['fraction']:.0f}% of cuBLAS SGEMM ({f['cublas_tflops']:.1f})")


def regenerate_without_gpu() -> int:
    if not METRICS_PATH.exists():
        print(f"no GPU and no results yet ({METRICS_PATH.name} appears after the first GPU run)")
        return 0
    try:
        doc = read_results(METRICS_PATH)
        draw_everything(doc)
    except Exception as exc:  # never fail on a CPU machine
        print(f"no GPU: could not redraw from {METRICS_PATH.name} ({type(exc).__name__}: {exc})")
        return 0
    print(f"no GPU: redrew the plots, memory_analysis.txt and the README sections from the committed "
          f"{METRICS_PATH.name} ({doc['env']['gpu']}, {doc['env']['date'][:10]})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Phase 4 benchmark, ncu memory analysis, Roofline")
    parser.add_argument("--quick", action="store_true", help="a few configs only (a smoke run)")
    parser.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute profile")
    parser.add_argument("--profile-target", help="(used by ncu) call these impls once, comma-separated")
    args = parser.parse_args(argv)
    if args.profile_target:
        profile_target(args.profile_target.split(","))
        return 0
    if not torch.cuda.is_available():
        return regenerate_without_gpu()

    start = time.perf_counter()
    ceilings = roofline.get_ceilings()
    impls = attention_impls()
    rows = run_attention_sweep(impls, args.quick)
    kernel_rows = run_kernel_timings((64,) if args.quick else (64, 128))
    rows += kernel_rows
    ncu = {"error": "skipped (--no-ncu)"} if args.no_ncu else run_ncu()
    doc_extra = {"matmul_vs_cublas": matmul_fractions(kernel_rows), "targets": headline_targets(rows),
                 "ncu": ncu, "quick": args.quick}
    write_results(METRICS_PATH, rows, ceilings, **doc_extra)
    doc = read_results(METRICS_PATH)
    draw_everything(doc)
    print_summary(doc)
    print(f"wrote {METRICS_PATH.name}, {ANALYSIS_PATH.name} and the plots in {RESULTS} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
