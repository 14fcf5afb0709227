"""Phase 5 benchmark: the fused FP32 kernels beside PyTorch and phases 2-4, then ncu, plots and
the generated optimization summary.

    python -m phase5_fused.run            # full run (about 3 minutes on an H100)
    python -m phase5_fused.run --quick    # smoke run: few sizes, short timings
    python -m phase5_fused.run --profile-target all   # (used by ncu) one call of each impl

Writes results/metrics.json, speed_vs_seq.png, memory_scaling.png, strided.png,
final_roofline.png, optimization_summary.md and the generated section of README.md (between the
results markers; text from summary.py). Without a GPU it regenerates the plots, the summary and the
README section from the committed metrics.json (or says there are no results yet).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

from utils import reference, roofline
from utils.attention_bench import attention_row, try_attention_row
from utils.testing import random_qkv

RESULTS = Path(__file__).resolve().parent / "results"
METRICS = RESULTS / "metrics.json"

B, H = 4, 8
HEADLINE = {"B": B, "H": H, "Sq": 4096, "Sk": 4096, "D": 64, "causal": False, "dtype": "float32"}
SEQ_LENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
QUICK_SEQ_LENS = [256, 1024]
STRIDES = [1, 2, 4, 8]
# Largest S each implementation is timed at (B=4, H=8): the unfused paths hold B*H*S*S floats
# (S=16384: 34 GB per buffer) and the simple kernels would take most of the time budget.
MAX_S = {"torch_naive": 8192, "sdpa_math": 8192, "phase2_naive": 4096, "phase3_tiled_t16": 4096,
         "phase4_coalesced": 4096, "phase5_fused_teaching": 4096}
REFERENCE_LIMIT = 2**28  # float64 reference only up to this many score elements
PHASE_PEERS = {"phase2_naive": ("phase2_naive", {}), "phase3_tiled_t16": ("phase3_tiled", {"tile": 16}),
               "phase4_coalesced": ("phase4_coalesced", {})}
NCU_IMPLS = ["phase2_naive", "phase3_tiled_t16", "phase4_coalesced", "phase5_fused_teaching",
             "phase5_fused", "sdpa_efficient"]


# ------------------------------------------------------------------------------------------------
# Implementations: name -> f(q, k, v, causal)


def phase5_impls() -> dict:
    import phase5_fused

    return {
        "phase5_fused_teaching": lambda q, k, v, c: phase5_fused.attention(q, k, v, is_causal=c, kernel="teaching"),
        "phase5_fused": lambda q, k, v, c: phase5_fused.attention(q, k, v, is_causal=c, kernel="fast"),
    }


def peer_impls(verbose=True) -> dict:
    """torch_naive, sdpa_math, sdpa_efficient and phases 2-4 that import, build and run here."""
    from utils import peers

    impls = {"torch_naive": lambda q, k, v, c: peers.torch_naive(q, k, v, is_causal=c)}
    probe = [torch.randn(1, 1, 8, 64, device="cuda") for _ in range(3)]
    for name in ("sdpa_math", "sdpa_efficient"):
        fn = peers.available_sdpa(name, *probe)
        if fn is None:
            print(f"note: {name} does not run here, skipped", flush=True)
            continue
        impls[name] = lambda q, k, v, c, fn=fn: fn(q, k, v, is_causal=c)
    for name, (package, kwargs) in PHASE_PEERS.items():
        try:
            module = importlib.import_module(package)
            fn = lambda q, k, v, c, m=module, kw=kwargs: m.attention(q, k, v, is_causal=c, **kw)
            fn(*probe, False)  # builds the extension on first use
            torch.cuda.synchronize()
            impls[name] = fn
        except Exception as exc:  # a peer phase missing or broken must not stop this phase
            if verbose:
                print(f"note: {name} skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})",
                      flush=True)
    return impls


# ------------------------------------------------------------------------------------------------
# Timing rows (results schema). utils.bench.time_cuda with a per-point time cap keeps the run short.


def timing(quick: bool) -> dict:
    """utils.attention_bench.attention_row's time_cuda arguments: fewer repetitions, capped per point."""
    return {"warmup": 2 if quick else 3, "reps": 10 if quick else 25, "max_seconds": 0.3 if quick else 0.8}


def sweep(impls: dict, seq_lens, head_dims, quick) -> list[dict]:
    rows = []
    start = time.perf_counter()
    configs = [(D, c, S) for D in head_dims for c in (False, True) for S in seq_lens]
    for n, (D, causal, S) in enumerate(configs, 1):
        q, k, v = random_qkv(B, H, S, S, D)
        ref = reference.attention(q, k, v, is_causal=causal) if B * H * S * S <= REFERENCE_LIMIT else None
        for name, fn in impls.items():
            if S > MAX_S.get(name, 1 << 30):
                if D == head_dims[0] and not causal and S == min(s for s in seq_lens if s > MAX_S[name]):
                    print(f"    {name}: skipped from S={S} (S x S buffers / time budget)", flush=True)
                continue
            row = try_attention_row(name, fn, q, k, v, causal, ref, **timing(quick))
            if row is not None:
                rows.append(row)
        del q, k, v, ref
        torch.cuda.empty_cache()
        print(f"[sweep {n}/{len(configs)}] D={D} causal={causal} S={S} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    return rows


def strided_rows(quick) -> list[dict]:
    """The fast kernel at stride 1 (dense), 2, 4, 8: time and speedup over dense."""
    import phase5_fused

    rows = []
    for S in ([2048] if quick else [4096, 16384]):
        for causal in (False, True):
            q, k, v = random_qkv(B, H, S, S, 64)
            dense_ms = None
            for stride in STRIDES:
                fn = lambda q, k, v, c, s=stride: phase5_fused.attention(q, k, v, is_causal=c, stride=s)
                ref = None
                if B * H * S * S <= REFERENCE_LIMIT:
                    ref = reference.attention(q, k, v, is_causal=causal, stride=stride)
                row = attention_row("phase5_fused", fn, q, k, v, causal, ref, op="attention_strided", stride=stride,
                                    **timing(quick))
                row["stride"] = stride
                dense_ms = row["ms"] if stride == 1 else dense_ms
                row["speedup_vs_dense"] = dense_ms / row["ms"]
                rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def variant_rows(quick) -> list[dict]:
    """Every tile configuration of the fast kernel at S=4096 (D=64 and 128, non-causal)."""
    import phase5_fused

    rows = []
    for D in (64, 128):
        q, k, v = random_qkv(B, H, 1024 if quick else 4096, 1024 if quick else 4096, D)
        for variant in range(phase5_fused.FAST_VARIANTS[D]):
            fn = lambda q, k, v, c, n=variant: phase5_fused.attention(q, k, v, is_causal=c, variant=n)
            row = attention_row("phase5_fused", fn, q, k, v, False, op="attention_variant", **timing(quick))
            row["variant"] = variant
            rows.append(row)
        del q, k, v
    return rows


# ------------------------------------------------------------------------------------------------
# ncu: one process runs one call of every implementation at the headline shape. A marker kernel
# (torch.cuda._sleep) follows the set-up and each call, so the records split per implementation.

MARKER = "spin_kernel"
TORCH_KERNEL_HINTS = ("at::native", "at::cuda", MARKER)


def profile_target(name: str) -> None:
    impls = {**peer_impls(verbose=False), **phase5_impls()}
    names = NCU_IMPLS if name == "all" else [name]
    shape = (HEADLINE["B"], HEADLINE["H"], HEADLINE["Sq"], HEADLINE["D"])
    q, k, v = (torch.randn(*shape).cuda() for _ in range(3))  # made on the CPU: no kernels
    torch.cuda._sleep(1000)  # marker: everything before it (peer probes, builds) is set-up
    for impl in names:
        if impl in impls:
            impls[impl](q, k, v, HEADLINE["causal"])
        torch.cuda._sleep(1000)
    torch.cuda.synchronize()


def run_ncu() -> dict:
    from utils.ncu import NcuUnavailable, profile_python

    try:
        records = profile_python(["phase5_fused.run", "--profile-target", "all"], launch_count=200)
    except (NcuUnavailable, OSError, TimeoutError) as exc:
        print(f"note: ncu unavailable: {str(exc).splitlines()[0]}", flush=True)
        return {"unavailable": str(exc)}
    per_impl: dict[str, list] = {name: [] for name in NCU_IMPLS}
    segment = -1  # records before the first marker are set-up
    for r in records:
        if MARKER in r["kernel"]:
            segment += 1
            continue
        if 0 <= segment < len(NCU_IMPLS) and not any(h in r["kernel"] for h in TORCH_KERNEL_HINTS[:2]):
            r["kernel"] = r["kernel"].split("(")[0][:120]
            per_impl[NCU_IMPLS[segment]].append(r)
    return {"shape": HEADLINE, "kernels": {k: v for k, v in per_impl.items() if v}}


# ------------------------------------------------------------------------------------------------
# Plots and the generated summary


def plot_all(doc: dict) -> None:
    from utils.attention_bench import plot_speed_vs_seq, roofline_points

    rows, env = doc["rows"], doc["env"]
    dense = [r for r in rows if r["op"] == "attention"]
    plot_speed_vs_seq(dense, RESULTS / "speed_vs_seq.png", "Phase 5: fused FP32 attention, B=4, H=8", env)
    plot_memory(dense, RESULTS / "memory_scaling.png", env)
    plot_strided([r for r in rows if r["op"] == "attention_strided"], RESULTS / "strided.png", env)
    ncu_bytes = {impl: sum(k.get("dram_bytes") or 0 for k in kernels)
                 for impl, kernels in doc.get("ncu", {}).get("kernels", {}).items()}
    match = {k: HEADLINE[k] for k in ("Sq", "D", "causal")}
    points = roofline_points(dense, match, ncu_bytes)
    if points and doc.get("ceilings"):
        roofline.plot_roofline(points, doc["ceilings"], RESULTS / "final_roofline.png",
                               "Attention S=4096, D=64, B=4, H=8, FP32: phases 2-5 and PyTorch",
                               compute_ceilings=("fp32_TFLOPs", "sgemm_TFLOPs", "tf32_tc_TFLOPs"), env=env)


def _stamp(env):
    return f"{env['gpu']}, torch {env['torch']}, {env['date'][:10]}, {env['commit']}"


def plot_memory(rows, path, env) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    subset = [r for r in rows if r["D"] == 64 and not r["causal"]]
    for impl in dict.fromkeys(r["impl"] for r in subset):
        pts = sorted((r["Sq"], max(r["extra_mb"], 1e-3)) for r in subset if r["impl"] == impl)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("peak extra memory (MiB)")
    ax.set_title(f"Extra memory per call, B=4, H=8, D=64\n{_stamp(env)}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_strided(rows, path, env) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for S, causal in sorted({(r["Sq"], r["causal"]) for r in rows}):
        pts = sorted((r["stride"], r["speedup_vs_dense"]) for r in rows if r["Sq"] == S and r["causal"] == causal)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"S={S}, {'causal' if causal else 'non-causal'}")
    ax.plot(STRIDES, [0.7 * s for s in STRIDES], "k--", linewidth=1, label="target 0.7 x stride")
    ax.plot(STRIDES, STRIDES, "k:", linewidth=1, label="ideal = stride")
    ax.set_xlabel("stride")
    ax.set_ylabel("speedup over dense fused")
    ax.set_title(f"Strided attention, fast kernel, B=4, H=8, D=64\n{_stamp(env)}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_summary(doc: dict) -> None:
    """results/optimization_summary.md and the README's generated section (after the plots, so the
    README's checklist sees the files)."""
    from utils.readme import update_readme
    from phase5_fused.summary import readme_lines, render

    (RESULTS / "optimization_summary.md").write_text(render(doc))
    update_readme(RESULTS.parent / "README.md", readme_lines(doc, RESULTS))


# ------------------------------------------------------------------------------------------------


def offline() -> int:
    """No GPU: regenerate plots and summary from the committed metrics.json, never fail."""
    if not METRICS.exists():
        print("phase5_fused: no GPU and no results yet (results/metrics.json comes from a GPU run)")
        return 0
    try:
        from utils.results import read_results

        doc = read_results(METRICS)
        plot_all(doc)
        write_summary(doc)
        print(f"phase5_fused: no GPU; plots, summary and README section regenerated from {METRICS.name} ({doc['env']['date'][:10]})")
    except Exception as exc:  # never fail without a GPU
        print(f"phase5_fused: no GPU; could not regenerate from {METRICS.name}: {exc}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Phase 5 fused FP32 attention benchmark")
    parser.add_argument("--quick", action="store_true", help="smoke run: few sizes, short timings")
    parser.add_argument("--profile-target", help="(for ncu) one call of an impl, or 'all'")
    parser.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute step")
    args = parser.parse_args(argv)
    if args.profile_target:
        profile_target(args.profile_target)
        return 0
    if not torch.cuda.is_available():
        return offline()

    from utils.results import read_results, write_results

    start = time.perf_counter()
    impls = {**peer_impls(), **phase5_impls()}
    print(f"impls: {', '.join(impls)}", flush=True)
    seq_lens = QUICK_SEQ_LENS if args.quick else SEQ_LENS
    rows = sweep(impls, seq_lens, (64, 128), args.quick)
    print(f"sweep done ({time.perf_counter() - start:.0f} s)", flush=True)
    rows += strided_rows(args.quick)
    variants = variant_rows(args.quick)
    print(f"strided + variants done ({time.perf_counter() - start:.0f} s)", flush=True)
    ncu = {"skipped": "--no-ncu"} if args.no_ncu else run_ncu()
    print(f"ncu done ({time.perf_counter() - start:.0f} s)", flush=True)
    ceilings = roofline.get_ceilings()
    write_results(METRICS, rows, ceilings, variants=variants, ncu=ncu, quick=args.quick,
                  headline=HEADLINE, max_s=MAX_S)
    doc = read_results(METRICS)
    plot_all(doc)
    write_summary(doc)
    print(f"wrote {METRICS} and plots in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
