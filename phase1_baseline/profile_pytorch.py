"""The measurements of phase 1 (run.py calls them on a GPU and writes results/metrics.json).

Every measurement is of inference: the model runs under torch.no_grad().
- profile_ops: torch.profiler over one forward at batch 8, seq 1024: the share of the GPU time in
  each named range (attention and its five steps, mlp, layer_norm) and the top kernels;
- model_rows: forward time, tokens/s and peak memory for seq 128-1024 and batch 1, 8, 32, with the
  explicit-math attention (torch_eager) and with torch SDPA (torch_sdpa), same weights, same tokens;
- attention_rows: the attention step alone at the model's shapes (H=8, D=64, causal): torch_naive
  (the same five kernels as the model's explicit math) beside sdpa_efficient;
- ncu_records: Nsight Compute on torch_naive's five kernels at the profile shape (ncu_target is
  what it profiles).
"""

from __future__ import annotations

import torch

from phase1_baseline.pytorch_transformer import build_model, synthetic_batch
from utils.attention_bench import benchmark_attention
from utils.bench import peak_extra_mb, profile_ranges, sweep, time_cuda
from utils.peers import sdpa, torch_naive

SEQ_LENS = (128, 256, 512, 1024)
BATCHES = (1, 8, 32)
PROFILE_SHAPE = {"batch": 8, "seq": 1024}
HEADS, HEAD_DIM = 8, 64
RANGES = ("attention", "mlp", "layer_norm", "attention.qk", "attention.scale", "attention.mask",
          "attention.softmax", "attention.av")
STEPS = ("qk", "scale", "mask", "softmax", "av")


@torch.no_grad()
def profile_ops(top: int = 15) -> dict:
    """torch.profiler over one forward: the top kernels by GPU time, and the share of the GPU time
    spent in each named range (attention and its steps, mlp, layer_norm)."""
    from torch.autograd import DeviceType

    model = build_model(device="cuda")
    idx = synthetic_batch(PROFILE_SHAPE["batch"], PROFILE_SHAPE["seq"], device="cuda")
    prof, total, range_us = profile_ranges(lambda: model(idx), RANGES)
    averages = [e for e in prof.key_averages()
                if e.device_type != DeviceType.CPU and e.key not in RANGES and e.self_device_time_total > 0]
    ops = [{"op": e.key, "gpu_us": e.self_device_time_total, "calls": e.count,
            "share": e.self_device_time_total / total}
           for e in sorted(averages, key=lambda e: -e.self_device_time_total)[:top]]
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top), flush=True)
    return {"shape": PROFILE_SHAPE, "total_gpu_us": total, "top_ops": ops,
            "range_shares": {name: us / total for name, us in range_us.items()}}


@torch.no_grad()
def model_rows(seq_lens=SEQ_LENS, batches=BATCHES) -> list[dict]:
    """Forward time, tokens/s and peak memory, eager math attention vs SDPA, same weights and tokens."""
    models = {"torch_eager": build_model(device="cuda", attention="math"),
              "torch_sdpa": build_model(device="cuda", attention="sdpa")}

    def run_one(c):
        idx = synthetic_batch(c["B"], c["S"], device="cuda")
        rows = []
        for impl, model in models.items():
            ms = time_cuda(lambda: model(idx), warmup=3, reps=10, gpu_only=False)  # what a caller waits for
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


def ncu_records(module: str) -> list[dict]:
    """ncu metrics of torch_naive's kernels at the profile shape (`python -m module --profile-target all`),
    each labelled with the attention problem and its step (the five kernels that take more than 2%
    of the time, in launch order). Raises utils.ncu.NcuUnavailable where ncu cannot run."""
    from utils.ncu import profile_python

    records = profile_python([module, "--profile-target", "all"], from_start=False)
    total = sum(r.get("time_ns") or 0 for r in records)
    main_kernels = [r for r in records if (r.get("time_ns") or 0) > 0.02 * total]
    names = STEPS if len(main_kernels) == len(STEPS) else [f"kernel{n}" for n in range(len(main_kernels))]
    S = PROFILE_SHAPE["seq"]
    problem = {"impl": "torch_naive", "op": "attention", "B": PROFILE_SHAPE["batch"], "H": HEADS, "Sq": S, "Sk": S,
               "D": HEAD_DIM, "causal": True}
    return [{**problem, **record, "step": step} for record, step in zip(main_kernels, names)]


def ncu_target() -> None:
    """What ncu profiles: torch_naive's causal attention once at the profile shape (inputs made
    outside the profiled region)."""
    from utils.ncu import profiled_region

    B, S = PROFILE_SHAPE["batch"], PROFILE_SHAPE["seq"]
    q, k, v = (torch.randn(B, HEADS, S, HEAD_DIM, device="cuda") for _ in range(3))
    torch.cuda.synchronize()
    with profiled_region():
        torch_naive(q, k, v, is_causal=True)
        torch.cuda.synchronize()
