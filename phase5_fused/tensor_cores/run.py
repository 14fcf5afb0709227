"""`python -m phase5_fused.run_tc [--quick]`: the tensor-core fused attention (phase5_fused_tc)
beside FlashAttention-2 (sdpa_flash), cuDNN (sdpa_cudnn), sdpa_efficient and torch_naive in FP16,
and this phase's FP32 fused kernel (phase5_fused, when it exists), at B=4, H=8, D=64 and 128,
S 512 to 16384, causal and not. TFLOP/s against the measured FP16 tensor-core ceiling; Nsight
Compute metrics of the kernels at S=4096; results in results/tc_metrics.json, plots in
results/tc_roofline.png and results/tc_speed.png.

Both paths regenerate the results section and checklist of README_tensor_cores.md from the results
(tc_report.py). Without a GPU it redraws the plots and that section from the committed
results/tc_metrics.json (or says there are none yet), and never fails.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
METRICS_PATH = RESULTS / "tc_metrics.json"
ROOFLINE_PNG = RESULTS / "tc_roofline.png"
SPEED_PNG = RESULTS / "tc_speed.png"

B, H = 4, 8
HEAD_DIMS = (64, 128)
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQ_LENS = (1024, 4096)
HEADLINE_S = 4096
DTYPE = torch.float16
PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch_naive")
# Beyond these lengths an implementation is skipped: torch_naive's S x S matrices (4 GB at 8192)
# and the FP32 kernel's time would push the run past its two-minute budget.
MAX_S = {"torch_naive": 8192, "phase5_fused": 4096}
IMPL = "phase5_fused_tc"
# The profile target launches these, in this order; ncu records come back in launch order.
PROFILE_CALLS = [(IMPL, 64), (IMPL, 128), ("sdpa_flash", 64), ("sdpa_flash", 128)]
NCU_REGEX = "tc_attention_kernel|flash_fwd"
HMMA_16816_FLOP = 2 * 16 * 8 * 16  # FLOPs of one mma.sync m16n8k16 (one warp-level tensor instruction)


def tc_fn(q, k, v, causal):
    from phase5_fused import tc

    return tc.attention(q, k, v, is_causal=causal)


def fp32_kernel():
    """phase5_fused.attention (the FP32 fused kernel) if the package provides it, else None."""
    try:
        module = importlib.import_module("phase5_fused")
    except ImportError:
        return None
    fn = getattr(module, "attention", None)
    return (lambda q, k, v, causal: fn(q, k, v, is_causal=causal)) if callable(fn) else None


def make_inputs(S, D, seed):
    """Benchmark inputs drawn on the GPU (CPU float64 draws of 16384-long sequences take seconds)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, S, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3)]


# ------------------------------------------------------------------------------------------------
# Benchmark


def benchmark(seq_lens) -> tuple[list[dict], list[str]]:
    from utils import reference
    from utils.attention_bench import REFERENCE_LIMIT, try_attention_row
    from utils.bench import sweep
    from utils.peers import attention_peers

    notes = []
    fp32 = fp32_kernel()
    if fp32 is None:
        notes.append("phase5_fused.attention (FP32 fused kernel) not found: its rows are skipped")
        print(notes[-1], flush=True)
    configs = [{"B": B, "H": H, "S": S, "D": D, "causal": c} for D in HEAD_DIMS for c in (False, True)
               for S in seq_lens]

    def run_config(c):
        S, D, causal = c["S"], c["D"], c["causal"]
        q, k, v = make_inputs(S, D, seed=S * 1000 + D * 10 + causal)
        ref = reference.attention(q, k, v, is_causal=causal) if B * H * S * S <= REFERENCE_LIMIT // 8 else None
        impls = {IMPL: tc_fn}
        for name, fn in attention_peers(q, k, v, causal, names=PEERS).items():
            impls[name] = lambda q_, k_, v_, c_, fn=fn: fn(q_, k_, v_, is_causal=c_)
        rows = []
        for name, fn in impls.items():
            if S > MAX_S.get(name, S):
                continue
            rows.append(try_attention_row(name, fn, q, k, v, causal, ref))
        if fp32 is not None and S <= MAX_S["phase5_fused"]:
            q32, k32, v32 = (t.float() for t in (q, k, v))
            rows.append(try_attention_row("phase5_fused", fp32, q32, k32, v32, causal, ref))
        del q, k, v, ref
        torch.cuda.empty_cache()
        return [r for r in rows if r is not None]

    return sweep(configs, run_config, "tc attention"), notes


def add_ceiling_fractions(rows, ceilings) -> None:
    for r in rows:
        key = {"float16": "fp16_tc_TFLOPs", "bfloat16": "bf16_tc_TFLOPs", "float32": "fp32_TFLOPs"}[r["dtype"]]
        if ceilings.get(key):
            r["pct_of_ceiling"] = 100.0 * r["tflops"] / ceilings[key]
            r["ceiling"] = key


def summarize(rows) -> list[dict]:
    """At S=4096 per (D, causal): our TFLOP/s, the peers', and our fraction of each."""
    out = []
    for D in HEAD_DIMS:
        for causal in (False, True):
            at = {r["impl"]: r for r in rows if r["Sq"] == HEADLINE_S and r["D"] == D and r["causal"] == causal}
            if IMPL not in at:
                continue
            entry = {"S": HEADLINE_S, "D": D, "causal": causal, "tflops": at[IMPL]["tflops"],
                     "pct_of_fp16_tc": at[IMPL].get("pct_of_ceiling")}
            for peer in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "phase5_fused"):
                if peer in at:
                    entry[f"{peer}_tflops"] = at[peer]["tflops"]
                    entry[f"fraction_of_{peer}"] = at[IMPL]["tflops"] / at[peer]["tflops"]
            out.append(entry)
    return out


# ------------------------------------------------------------------------------------------------
# Nsight Compute


def profile_target() -> None:
    """One call of each (impl, D) of PROFILE_CALLS at S=4096, non-causal: what ncu measures."""
    from utils.peers import sdpa

    flash = sdpa("sdpa_flash")
    for impl, D in PROFILE_CALLS:
        q, k, v = make_inputs(HEADLINE_S, D, seed=D)
        if impl == IMPL:
            tc_fn(q, k, v, False)
        else:
            flash(q, k, v)
        torch.cuda.synchronize()


def run_ncu() -> dict:
    from utils.ncu import NcuUnavailable, profile_python
    from utils.roofline import attention_flops

    try:
        records = profile_python(["phase5_fused.run_tc", "--profile-target"], NCU_REGEX,
                                 launch_count=len(PROFILE_CALLS), timeout=300, stalls=True)
    except NcuUnavailable as exc:
        print(f"ncu unavailable: {exc}", flush=True)
        return {"ncu_unavailable": str(exc)}
    ours = [r for r in records if "tc_attention" in r["kernel"]]
    flash = [r for r in records if "flash" in r["kernel"]]
    labelled = {}
    for impl, group in ((IMPL, ours), ("sdpa_flash", flash)):
        for D, record in zip(HEAD_DIMS, group):
            labelled[f"{impl}_D{D}"] = record
            if impl == IMPL and record.get("tensor_inst") and record.get("time_ns"):
                # Every tensor instruction of our kernel is an HMMA.16816: its FLOPs are known.
                record["tensor_flops"] = record["tensor_inst"] * HMMA_16816_FLOP
                record["tensor_TFLOPs_achieved"] = record["tensor_flops"] / record["time_ns"] / 1e3
                useful = attention_flops(B, H, HEADLINE_S, HEADLINE_S, D)
                record["useful_fraction_of_tensor_flops"] = useful / record["tensor_flops"]
    print(f"ncu: {len(records)} kernels profiled ({', '.join(labelled)})", flush=True)
    return {"shape": {"B": B, "H": H, "S": HEADLINE_S, "causal": False}, "kernels": labelled}


# ------------------------------------------------------------------------------------------------
# Plots


def draw(doc: dict) -> None:
    from utils.attention_bench import plot_speed_vs_seq, roofline_points
    from utils.roofline import plot_roofline

    rows, env, ceilings = doc["rows"], doc["env"], doc["ceilings"]
    plot_speed_vs_seq(rows, SPEED_PNG, "Tensor-core fused attention vs peers (B=4, H=8)", env)
    kernels = doc.get("ncu", {}).get("kernels", {})
    points = []
    for D in HEAD_DIMS:
        measured = {}
        for impl in (IMPL, "sdpa_flash"):
            record = kernels.get(f"{impl}_D{D}", {})
            if record.get("dram_bytes"):
                measured[impl] = record["dram_bytes"]
        for p in roofline_points(rows, {"Sq": HEADLINE_S, "D": D, "causal": False}, measured):
            p["label"] = f"{p['label']} D={D}"
            points.append(p)
    if points and ceilings.get("dram_TBps"):
        plot_roofline(points, ceilings, ROOFLINE_PNG,
                      f"Attention at B=4, H=8, S={HEADLINE_S}, non-causal (FP16; phase5_fused in FP32)",
                      compute_ceilings=("fp16_tc_TFLOPs", "fp32_TFLOPs"), env=env)


def write_readme(doc: dict) -> None:
    """The generated sections of README_tensor_cores.md (tc_report.py), from the results only."""
    from phase5_fused import tc_report

    try:
        if not tc_report.write_readme(doc):
            print("README_tensor_cores.md has no results markers: its section was not regenerated")
    except Exception as exc:  # the results are written; a README problem must not fail the run
        print(f"README_tensor_cores.md not regenerated: {type(exc).__name__}: {exc}")


def print_summary(summary: list[dict]) -> None:
    print(f"\nS={HEADLINE_S}, B={B}, H={H}, FP16: TFLOP/s (ours / sdpa_flash / sdpa_cudnn)")
    for e in summary:
        flash = e.get("sdpa_flash_tflops", float("nan"))
        cudnn = e.get("sdpa_cudnn_tflops", float("nan"))
        frac = e.get("fraction_of_sdpa_flash", float("nan"))
        print(f"  D={e['D']:<4} {'causal' if e['causal'] else 'full  '}  {e['tflops']:7.1f} / {flash:7.1f} / "
              f"{cudnn:7.1f}   = {frac:.2f}x sdpa_flash")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only S in {QUICK_SEQ_LENS}")
    parser.add_argument("--profile-target", action="store_true", help="(internal) the calls ncu profiles")
    parser.add_argument("--no-ncu", action="store_true", help="skip Nsight Compute")
    args = parser.parse_args(argv)

    if args.profile_target:
        profile_target()
        return 0
    if not torch.cuda.is_available():
        return redraw_only()

    from utils.results import read_results, write_results
    from utils.roofline import get_ceilings

    ceilings = get_ceilings()
    rows, notes = benchmark(QUICK_SEQ_LENS if args.quick else SEQ_LENS)
    add_ceiling_fractions(rows, ceilings)
    summary = summarize(rows)
    ncu = {"skipped": "--no-ncu"} if args.no_ncu else run_ncu()
    ceilings = {k: v for k, v in ceilings.items() if k != "env"}
    write_results(METRICS_PATH, rows, ceilings, summary=summary, ncu=ncu, notes=notes, quick=args.quick)
    doc = read_results(METRICS_PATH)
    draw(doc)
    write_readme(doc)
    print_summary(summary)
    print(f"wrote {METRICS_PATH.relative_to(RESULTS.parent.parent)}, {ROOFLINE_PNG.name}, {SPEED_PNG.name}, "
          f"and the results section of README_tensor_cores.md")
    return 0


def redraw_only() -> int:
    try:
        from utils.results import read_results

        if not METRICS_PATH.exists():
            print("no GPU visible and no results yet (results/tc_metrics.json): nothing to plot")
            return 0
        doc = read_results(METRICS_PATH)
        draw(doc)
        write_readme(doc)
        print(f"no GPU visible: redrew the plots and the README section from the committed "
              f"{METRICS_PATH.name} ({doc['env'].get('gpu')}, {doc['env'].get('date', '')[:10]})")
        print_summary(doc.get("summary", []))
    except Exception as exc:  # never fail without a GPU: say what went wrong instead
        print(f"no GPU visible; could not redraw from {METRICS_PATH.name}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
