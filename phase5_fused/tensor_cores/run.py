"""`python -m phase5_fused.tensor_cores.run [--quick] [--no-ncu]`: measure the tensor-core kernel, then render.

1. Attention forward in FP16 at B=4, H=8, D in {64, 128}, causal and not, S from 512 to 16384:
   phase5_fused_tc beside FlashAttention-2 (sdpa_flash), cuDNN (sdpa_cudnn), sdpa_efficient and
   torch_naive, and the previous lesson's FP32 kernel (phase5_fused, on the same values in FP32),
   on the same inputs in the same run.
2. Nsight Compute on one non-causal call of phase5_fused_tc and of sdpa_flash at S=4096, D=64 and
   128, with the warp-state and pipe counters (this script's --profile-target); the records are
   named impl_D<D>.
3. results/metrics.json, then the tables and plots that manifest.json declares (utils.render).
Without a GPU it measures nothing and renders from the committed results. --quick: a short run
written to results/quick/metrics.json, not rendered. Under 2 minutes on an H100.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from phase5_fused import fp32, tensor_cores
from utils.kernel_bench import lesson_main, results_dir

HERE = Path(__file__).resolve().parent
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
    return tensor_cores.attention(q, k, v, is_causal=causal)


def fp32_fn(q, k, v, causal):
    return fp32.attention(q, k, v, is_causal=causal)


def make_inputs(S, D, seed):
    """Benchmark inputs drawn on the GPU (CPU float64 draws of 16384-long sequences take seconds)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, S, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3)]


# ------------------------------------------------------------------------------------------------
# Benchmark


def benchmark(seq_lens) -> list[dict]:
    from utils import reference
    from utils.attention_bench import REFERENCE_LIMIT, try_attention_row
    from utils.bench import sweep
    from utils.peers import attention_peers

    configs = [{"B": B, "H": H, "S": S, "D": D, "causal": c} for D in HEAD_DIMS for c in (False, True)
               for S in seq_lens]

    def run_config(c):
        S, D, causal = c["S"], c["D"], c["causal"]
        q, k, v = make_inputs(S, D, seed=S * 1000 + D * 10 + causal)
        ref = reference.attention(q, k, v, is_causal=causal) if B * H * S * S <= REFERENCE_LIMIT // 8 else None
        impls = {IMPL: tc_fn}
        for name, fn in attention_peers(q, k, v, causal, names=PEERS).items():
            impls[name] = lambda q_, k_, v_, c_, fn=fn: fn(q_, k_, v_, is_causal=c_)
        rows = [try_attention_row(name, fn, q, k, v, causal, ref) for name, fn in impls.items()
                if S <= MAX_S.get(name, S)]
        if S <= MAX_S["phase5_fused"]:
            q32, k32, v32 = (t.float() for t in (q, k, v))
            rows.append(try_attention_row("phase5_fused", fp32_fn, q32, k32, v32, causal, ref))
        del q, k, v, ref
        torch.cuda.empty_cache()
        return [r for r in rows if r is not None]

    return sweep(configs, run_config, "tc attention")


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
    """ncu records named impl_D<D> ({"phase5_fused_tc_D64": {...}, ...}), or why ncu did not run."""
    from utils.ncu import NcuUnavailable, profile_python
    from utils.roofline import attention_flops

    try:
        records = profile_python(["phase5_fused.tensor_cores.run", "--profile-target", "all"], NCU_REGEX,
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


def measure(args) -> Path:
    """The benchmark and the ncu records, written to the results file (returned)."""
    from utils.results import write_results
    from utils.roofline import get_ceilings

    ceilings = {k: v for k, v in get_ceilings().items() if k != "env"}
    rows = benchmark(QUICK_SEQ_LENS if args.quick else SEQ_LENS)
    ncu = {"skipped": "--no-ncu"} if args.no_ncu else run_ncu()
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, ceilings, ncu=ncu)


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 5 tensor-core attention benchmark, then its tables and plots", measure,
                       lambda names: profile_target())

if __name__ == "__main__":
    sys.exit(main())
