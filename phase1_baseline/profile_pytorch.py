"""Profile the baseline GPT: where the time goes, how fast attention runs, where it sits on the Roofline.

`python -m phase1_baseline.run` (or this module) on a GPU:
1. torch.profiler table per op at batch 8, seq 1024, with attention's share of the GPU time;
2. forward time, tokens/s and peak memory for seq 128, 256, 512, 1024 and batch 1, 8, 32, with the
   explicit-math attention (torch_eager) and with torch SDPA (torch_sdpa), same weights, same tokens;
3. the attention step alone at the model's shapes (H=8, D=64, causal): torch_naive vs sdpa_efficient;
4. ncu metrics of the attention kernels (GFLOP/s, DRAM GB/s, occupancy);
5. results/baseline_metrics.json and results/baseline_roofline.png with the measured ceilings.
Without a GPU it redraws the plot from the committed results and says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from phase1_baseline.pytorch_transformer import build_model, causal_attention_math, synthetic_batch
from utils import roofline
from utils.attention_bench import benchmark_attention, roofline_points
from utils.bench import peak_extra_mb, profile_ranges, sweep, time_cuda
from utils.peers import sdpa, torch_naive
from utils.readme import env_line, fmt, update_readme
from utils.results import read_results, write_results

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
METRICS_PATH = RESULTS / "baseline_metrics.json"
ROOFLINE_PATH = RESULTS / "baseline_roofline.png"
SEQ_LENS = (128, 256, 512, 1024)
BATCHES = (1, 8, 32)
PROFILE_SHAPE = {"batch": 8, "seq": 1024}
HEADS, HEAD_DIM = 8, 64


RANGES = ("attention", "mlp", "layer_norm", "attention.qk", "attention.scale", "attention.mask",
          "attention.softmax", "attention.av")


def profile_ops(model, idx, top: int = 15) -> dict:
    """torch.profiler over one forward: the top ops by GPU time, and the share of the GPU time spent
    in each named range (attention and its steps, mlp, layer_norm)."""
    from torch.autograd import DeviceType

    prof, total, range_us = profile_ranges(lambda: model(idx), RANGES)
    shares = {name: us / total for name, us in range_us.items()}
    averages = [e for e in prof.key_averages()
                if e.device_type != DeviceType.CPU and e.key not in RANGES and e.self_device_time_total > 0]
    ops = [{"op": e.key, "gpu_us": e.self_device_time_total, "calls": e.count,
            "share": e.self_device_time_total / total}
           for e in sorted(averages, key=lambda e: -e.self_device_time_total)[:top]]
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top), flush=True)
    return {"shape": PROFILE_SHAPE, "total_gpu_us": total, "top_ops": ops, "range_shares": shares}


def model_rows(seq_lens=SEQ_LENS, batches=BATCHES) -> list[dict]:
    """Forward time, tokens/s and peak memory, eager math attention vs SDPA, same weights and tokens."""
    models = {"torch_eager": build_model(device="cuda", attention="math"),
              "torch_sdpa": build_model(device="cuda", attention="sdpa")}

    def run_one(c):
        idx = synthetic_batch(c["B"], c["S"], device="cuda")
        rows = []
        for impl, model in models.items():
            ms = time_cuda(lambda: model(idx), warmup=3, reps=10)
            rows.append({"impl": impl, "op": "model", "B": c["B"], "S": c["S"], "dtype": "float32",
                         "ms": ms, "tokens_per_s": c["B"] * c["S"] / (ms * 1e-3),
                         "extra_mb": peak_extra_mb(lambda: model(idx))})
        return rows

    configs = [{"B": b, "S": s} for b in batches for s in seq_lens]
    return sweep(configs, run_one, "model")


def attention_rows(seq_lens=SEQ_LENS, batch=PROFILE_SHAPE["batch"]) -> list[dict]:
    impls = {"torch_naive": lambda q, k, v, c: torch_naive(q, k, v, is_causal=c),
             "sdpa_efficient": lambda q, k, v, c: sdpa("sdpa_efficient")(q, k, v, is_causal=c)}
    configs = [{"B": batch, "H": HEADS, "S": s, "D": HEAD_DIM, "causal": True} for s in seq_lens]
    return benchmark_attention(impls, configs, desc="attention")


STEPS = ("qk", "scale", "mask", "softmax", "av")


def step_models(B=PROFILE_SHAPE["batch"], S=PROFILE_SHAPE["seq"]) -> dict:
    """Analytic FLOPs and minimum DRAM bytes of each explicit-math step (FP32, causal mask built once)."""
    bh, ss = B * HEADS, B * HEADS * S * S
    qk_av_bytes = 4.0 * (bh * 2 * S * HEAD_DIM + ss)
    return {"qk": (roofline.matmul_flops(S, S, HEAD_DIM, bh), qk_av_bytes),
            "scale": (float(ss), 8.0 * ss),
            "mask": (float(ss), 8.0 * ss + S * S),
            "softmax": (roofline.softmax_flops(bh * S, S), roofline.softmax_bytes(bh * S, S)),
            "av": (roofline.matmul_flops(S, HEAD_DIM, S, bh), qk_av_bytes)}


def ncu_records() -> list[dict] | str:
    """ncu metrics of the explicit-math attention's kernels at the profile shape, each named by
    its step (the five kernels that take more than 2% of the time, in launch order)."""
    from utils.ncu import NcuUnavailable, profile_python

    try:
        records = profile_python(["phase1_baseline.profile_pytorch", "--ncu-target"], from_start=False)
    except NcuUnavailable as exc:
        print(f"ncu skipped: {exc}", flush=True)
        return str(exc)
    total = sum(r.get("time_ns") or 0 for r in records)
    main_kernels = [r for r in records if (r.get("time_ns") or 0) > 0.02 * total]
    names = STEPS if len(main_kernels) == len(STEPS) else [f"kernel{n}" for n in range(len(main_kernels))]
    for record, step in zip(main_kernels, names):
        record["step"] = step
    return main_kernels


def ncu_target() -> None:
    """What ncu profiles: the explicit-math attention once at the profile shape (inputs made outside
    the profiled region)."""
    from utils.ncu import profiled_region

    B, S = PROFILE_SHAPE["batch"], PROFILE_SHAPE["seq"]
    q, k, v = (torch.randn(B, HEADS, S, HEAD_DIM, device="cuda") for _ in range(3))
    torch.cuda.synchronize()
    with profiled_region():
        causal_attention_math(q, k, v)
        torch.cuda.synchronize()


def plot(doc: dict) -> None:
    points = []
    for r in doc["rows"]:
        if r["op"] == "attention":
            point = roofline_points([r], {})[0]
            point["label"] = f"{r['impl']} S={r['Sq']}"
            points.append(point)
    models = step_models()
    if isinstance(doc.get("ncu"), list):
        for r in doc["ncu"]:
            if r.get("step") in models and r.get("dram_bytes") and r.get("time_ns"):
                flops, nbytes = models[r["step"]]
                points.append({"label": f"{r['step']} kernel S={PROFILE_SHAPE['seq']} (ncu)", "flops": flops,
                               "bytes": nbytes, "measured_bytes": r["dram_bytes"], "ms": r["time_ns"] * 1e-6})
    roofline.plot_roofline(points, doc["ceilings"], ROOFLINE_PATH,
                           f"Phase 1: PyTorch attention, B={PROFILE_SHAPE['batch']}, H={HEADS}, D={HEAD_DIM}, causal",
                           env=doc["env"])
    print(f"wrote {ROOFLINE_PATH}")


def readme_lines(doc: dict) -> list[str]:
    """The README's measurement section, every number read from the results."""
    prof, ceilings = doc["profile"], doc["ceilings"]
    shape = prof["shape"]
    lines = [env_line(doc), "",
             f"**Where the forward's GPU time goes** (batch {shape['batch']}, seq {shape['seq']}, explicit-math "
             f"attention; torch.profiler, total {prof['total_gpu_us'] / 1e3:.2f} ms of kernels)", "",
             "| range | share of GPU time |", "|---|---|"]
    lines += [f"| {name} | {share:.1%} |" for name, share in prof["range_shares"].items()]
    kernels = [op for op in prof["top_ops"] if not op["op"].startswith("aten::")]  # kernels, not the ops launching them
    lines += ["", "| top kernels by GPU time | launches | GPU µs | share |", "|---|---|---|---|"]
    lines += [f"| `{op['op'][:60]}` | {op['calls']} | {fmt(op['gpu_us'])} | {op['share']:.1%} |"
              for op in kernels[:8]]
    models = [r for r in doc["rows"] if r["op"] == "model"]
    lines += ["", "**Whole model: explicit-math attention (torch_eager) vs SDPA (torch_sdpa)**", "",
              "| batch | seq | eager ms | SDPA ms | SDPA speed-up | eager tokens/s | eager extra MB | SDPA extra MB |",
              "|---|---|---|---|---|---|---|---|"]
    by_key = {(r["impl"], r["B"], r["S"]): r for r in models}
    for (impl, B, S), eager in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        sdpa_row = by_key.get(("torch_sdpa", B, S))
        if impl != "torch_eager" or sdpa_row is None:
            continue
        lines.append(f"| {B} | {S} | {fmt(eager['ms'])} | {fmt(sdpa_row['ms'])} | {eager['ms'] / sdpa_row['ms']:.2f}x | "
                     f"{fmt(eager['tokens_per_s'])} | {fmt(eager['extra_mb'])} | {fmt(sdpa_row['extra_mb'])} |")
    lines += ["", f"**The attention step alone** (B={shape['batch']}, H={HEADS}, D={HEAD_DIM}, causal)", "",
              "| impl | S | ms | TFLOP/s | % of FP32 FFMA peak | GB/s (minimum bytes) | extra MB |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in doc["rows"] if r["op"] == "attention"), key=lambda r: (r["Sq"], r["impl"])):
        lines.append(f"| {r['impl']} | {r['Sq']} | {fmt(r['ms'])} | {fmt(r['tflops'])} | "
                     f"{r['tflops'] / ceilings['fp32_TFLOPs']:.0%} | {fmt(r['gbps'])} | {fmt(r['extra_mb'])} |")
    if isinstance(doc.get("ncu"), list):
        lines += ["", f"**Nsight Compute, the explicit-math attention at S={shape['seq']}** "
                      f"(DRAM ceiling: copy at {ceilings['dram_TBps']:.2f} TB/s)", "",
                  "| step | kernel | µs | DRAM GB/s | % of copy bandwidth | FP32 GFLOP/s (counted) | occupancy % |",
                  "|---|---|---|---|---|---|---|"]
        for r in doc["ncu"]:
            lines.append(f"| {r.get('step', '?')} | `{r['kernel'].split('(')[0][:48]}` | {fmt(r['time_ns'] / 1e3)} | "
                         f"{fmt(r.get('dram_GBps'))} | {r.get('dram_GBps', 0) / (ceilings['dram_TBps'] * 1e3):.0%} | "
                         f"{fmt(r.get('fp32_GFLOPs'))} | {fmt(r.get('occupancy_pct'))} |")
    elif doc.get("ncu"):
        lines += ["", f"ncu did not run: {doc['ncu']}"]
    lines += ["", "Ceilings measured on the same GPU: " + ", ".join(
        f"{k} {fmt(v)}" for k, v in ceilings.items() if isinstance(v, float)) + ".",
              "", "Plot: [Roofline](results/baseline_roofline.png)."]
    return lines


def render(doc: dict) -> None:
    plot(doc)
    update_readme(HERE / "README.md", readme_lines(doc), source="results/baseline_metrics.json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sweep, no ncu (a smoke run)")
    parser.add_argument("--ncu-target", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ncu_target:
        ncu_target()
        return 0
    if not torch.cuda.is_available():
        if METRICS_PATH.exists():
            print("no GPU visible: redrawing the phase 1 Roofline and README section from the committed "
                  "results (nothing re-measured)")
            render(read_results(METRICS_PATH))
        else:
            print("no GPU visible and no committed phase 1 results yet: nothing to do")
        return 0
    ceilings = roofline.get_ceilings()
    seq_lens, batches = ((128, 256), (1, 8)) if args.quick else (SEQ_LENS, BATCHES)
    model = build_model(device="cuda")
    profile = profile_ops(model, synthetic_batch(PROFILE_SHAPE["batch"], PROFILE_SHAPE["seq"], device="cuda"))
    del model
    rows = model_rows(seq_lens, batches) + attention_rows(seq_lens)
    ncu = "skipped (--quick)" if args.quick else ncu_records()
    write_results(METRICS_PATH, rows, ceilings, profile=profile, ncu=ncu)
    doc = read_results(METRICS_PATH)
    render(doc)
    share = profile["range_shares"]["attention"]
    print(f"attention takes {share:.0%} of the forward's GPU time at batch {PROFILE_SHAPE['batch']}, "
          f"seq {PROFILE_SHAPE['seq']}; wrote {METRICS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
