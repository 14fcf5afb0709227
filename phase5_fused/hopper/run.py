"""`python -m phase5_fused.hopper.run [--quick] [--no-ncu]`: measure the Hopper kernels, then render.

1. Attention forward at B=4, H=8, D in {64, 128}, causal and not: FP16 at S in {1024, 4096, 8192,
   16384} and BF16 at S=4096, every version of the lesson (hopper.VERSIONS: the default one is the
   impl phase5_fused_hopper, the others phase5_fused_hopper_<version>; each row with its version
   number and the idea it adds) beside cuDNN (sdpa_cudnn), FlashAttention-2 (sdpa_flash) and the
   mma.sync kernel of the previous lesson (phase5_fused_tc), on the same inputs in the same run,
   timed in turns (utils.bench.time_in_turns: one sample of each per round).
2. Grouped-query prefill (op attention_gqa): the default version at B=4, H=32 query heads over
   H_kv in {32, 8} KV heads, S=4096, D=128, FP16, causal and not, beside the mma.sync kernel,
   sdpa_flash and sdpa_cudnn (enable_gqa; a backend that refuses it is left out with a note),
   every (impl, H_kv) pair of a causal setting timed in the same turns.
3. Nsight Compute on one non-causal FP16 call of every version and of sdpa_cudnn at S=4096, D=64
   and 128, with the warp-state and pipe counters (this script's --profile-target); the records
   are named impl_D<D>.
4. results/metrics.json, then the tables and plots that manifest.json declares (utils.render).
Without a GPU it measures nothing and renders from the committed results; on a GPU that is not
sm_90 it stops with the reason. --quick: FP16 at S in {1024, 4096}, shorter timing, written to
results/quick/metrics.json, not rendered. About 3 minutes on an H100 (--quick: under one).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from phase5_fused import hopper, tensor_cores
from utils.kernel_bench import lesson_main, results_dir

HERE = Path(__file__).resolve().parent
B, H = 4, 8
HEAD_DIMS = (64, 128)
SEQ_LENS = (1024, 4096, 8192, 16384)
QUICK_SEQ_LENS = (1024, 4096)
HEADLINE_S = 4096
PEERS = ("sdpa_cudnn", "sdpa_flash")
TC_IMPL = "phase5_fused_tc"
IMPL = "phase5_fused_hopper"
# The idea each version adds over the one before (README "Versions").
ADDS = {"v1_wgmma_tma": "TMA loads into an mbarrier ring, wgmma for both matmuls",
        "v2_warp_specialized": "producer warpgroup, consumers drift apart, setmaxnreg",
        "v3_intra_overlap": "S_j and P_j-1 V_j-1 in flight together, the softmax of S_j overlaps the P V",
        "v4_pingpong": "the two consumer warpgroups take turns on the tensor cores",
        "v5_tiles": "three consumer warpgroups (192 query rows) at D=64",
        "v6_persistent": "persistent CTAs (causal tiles longest first), the K/V ring and Q carried across tiles, no turns",
        "v7_split_tail": "non-causal: the last partial wave's tiles cut along the keys, merged by logsumexp",
        "v8_stream_k": "non-causal, D=128: v6's last round cut into even shares of key blocks per CTA"}
# Grouped-query prefill: B, H query heads, the H_kv values compared, S, D (op attention_gqa).
GQA = {"B": 4, "H": 32, "H_kv": (32, 8), "S": 4096, "D": 128}
PROFILE_D = HEAD_DIMS
CUDNN = "sdpa_cudnn"


def impl_name(version: str) -> str:
    """The default version is the lesson's kernel (phase5_fused_hopper); the others carry their name."""
    return IMPL if version == hopper.DEFAULT_VERSION else f"{IMPL}_{version}"


def version_fns() -> dict:
    """impl name -> (f(q, k, v, causal), version number, what it adds), in lesson order."""
    return {impl_name(name): (lambda q, k, v, c, name=name: hopper.attention(q, k, v, is_causal=c, version=name),
                              number, ADDS[name])
            for number, name in enumerate(hopper.VERSIONS, 1)}


def make_inputs(S, D, dtype, seed):
    """Benchmark inputs drawn on the GPU (CPU float64 draws of 16384-long sequences take seconds)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(3)]


def timing(quick: bool) -> dict:
    """utils.bench.time_in_turns arguments: fewer repetitions, capped per point, to fit the time budget."""
    return {"warmup": 2 if quick else 3, "reps": 10 if quick else 20, "max_seconds": 0.2 if quick else 0.5}


# ------------------------------------------------------------------------------------------------
# Benchmark


def benchmark(quick: bool) -> list[dict]:
    from utils import reference
    from utils.attention_bench import try_attention_rows
    from utils.bench import sweep
    from utils.peers import attention_peers

    seq_lens = QUICK_SEQ_LENS if quick else SEQ_LENS
    configs = [{"S": S, "D": D, "causal": c, "dtype": torch.float16} for D in HEAD_DIMS for c in (False, True)
               for S in seq_lens]
    if not quick:
        configs += [{"S": HEADLINE_S, "D": D, "causal": c, "dtype": torch.bfloat16} for D in HEAD_DIMS
                    for c in (False, True)]
    versions = version_fns()

    def run_config(c):
        S, D, causal, dtype = c["S"], c["D"], c["causal"], c["dtype"]
        q, k, v = make_inputs(S, D, dtype, seed=S * 1000 + D * 10 + causal)
        ref = reference.attention(q, k, v, is_causal=causal) if B * H * S * S <= 2**25 else None
        impls = {impl: fn for impl, (fn, _, _) in versions.items()}
        impls[TC_IMPL] = lambda q_, k_, v_, c_: tensor_cores.attention(q_, k_, v_, is_causal=c_)
        for name, fn in attention_peers(q, k, v, causal, names=PEERS).items():
            impls[name] = lambda q_, k_, v_, c_, fn=fn: fn(q_, k_, v_, is_causal=c_)
        rows = try_attention_rows(impls, q, k, v, causal, ref, **timing(quick))
        for impl, (_, number, adds) in versions.items():
            if impl in rows:
                rows[impl].update(version=number, adds=adds)
        del q, k, v, ref
        torch.cuda.empty_cache()
        return list(rows.values())

    return sweep(configs, run_config, "hopper attention")


def gqa_rows(quick: bool) -> list[dict]:
    """The default version on H query heads over each H_kv of KV heads (the same q), beside the
    mma.sync kernel and both library kernels: sharing K/V should cost nothing."""
    from utils.attention_bench import grouped_query_rows
    from utils.peers import sdpa

    impls = {IMPL: lambda q, k, v, c: hopper.attention(q, k, v, is_causal=c),
             TC_IMPL: lambda q, k, v, c: tensor_cores.attention(q, k, v, is_causal=c)}
    for name in PEERS:
        impls[name] = lambda q, k, v, c, fn=sdpa(name): fn(q, k, v, is_causal=c)
    return grouped_query_rows(impls, GQA, torch.float16, seed=11, quick=quick, **timing(quick))


# ------------------------------------------------------------------------------------------------
# Nsight Compute


def profile_target() -> None:
    """One warmed-up non-causal FP16 call of every version and of sdpa_cudnn at S=4096 per D, in
    that order, inside the profiled region (what ncu measures)."""
    from utils.ncu import profiled_region
    from utils.peers import available_sdpa

    calls = []
    for D in PROFILE_D:
        q, k, v = make_inputs(HEADLINE_S, D, torch.float16, seed=D)
        for name in hopper.VERSIONS:
            calls.append(lambda q=q, k=k, v=v, name=name: hopper.attention(q, k, v, version=name))
        cudnn = available_sdpa(CUDNN, q, k, v)  # None where cuDNN attention does not run: left out
        if cudnn is not None:
            calls.append(lambda q=q, k=k, v=v, cudnn=cudnn: cudnn(q, k, v))
    for call in calls:  # builds, plans and warms up outside the region
        call()
    torch.cuda.synchronize()
    with profiled_region():
        for call in calls:
            call()
        torch.cuda.synchronize()


def label_records(records: list[dict]) -> dict:
    """ncu records in launch order -> {impl_D<D>: record}. Each version's call in profile_target
    launches one of our kernels (hopper_v<N>_kernel, not always its own: v6 runs v5's non-causal at
    D=64, v7 v6's where it cuts nothing), so the i-th of them is labelled by position. Every other
    kernel belongs to the cuDNN call after a D's versions (its longest one is kept: cuDNN may launch
    helpers)."""
    labelled: dict = {}
    ours = 0  # our kernels seen so far
    for record in records:
        if re.search(r"hopper_v\d+_kernel", record["kernel"]):
            d_index, version = divmod(ours, len(hopper.VERSIONS))
            ours += 1
            if d_index < len(PROFILE_D):
                labelled[f"{impl_name(hopper.VERSIONS[version])}_D{PROFILE_D[d_index]}"] = record
            continue
        d_index = (ours - 1) // len(hopper.VERSIONS)
        if ours == 0 or d_index >= len(PROFILE_D):
            continue
        key = f"{CUDNN}_D{PROFILE_D[d_index]}"
        if record.get("time_ns", 0) > labelled.get(key, {}).get("time_ns", -1):
            labelled[key] = record
    return labelled


def run_ncu() -> dict:
    """ncu records named impl_D<D>, or why ncu did not run."""
    from utils.ncu import NcuUnavailable, profile_python

    try:
        records = profile_python(["phase5_fused.hopper.run", "--profile-target", "all"], None,
                                 launch_count=64, timeout=300, from_start=False, stalls=True)
    except NcuUnavailable as exc:
        print(f"ncu unavailable: {exc}", flush=True)
        return {"ncu_unavailable": str(exc)}
    labelled = label_records(records)
    print(f"ncu: {len(records)} kernels profiled ({', '.join(labelled)})", flush=True)
    return {"shape": {"B": B, "H": H, "S": HEADLINE_S, "causal": False, "dtype": "float16"}, "kernels": labelled}


# ------------------------------------------------------------------------------------------------


def measure(args) -> Path:
    """The benchmark and the ncu records, written to the results file (returned)."""
    from utils.results import write_results
    from utils.roofline import get_ceilings

    hopper.check_hopper(torch.device("cuda"))
    ceilings = {k: v for k, v in get_ceilings().items() if k != "env"}
    rows = benchmark(args.quick) + gqa_rows(args.quick)
    ncu = {"skipped": "--no-ncu"} if args.no_ncu else run_ncu()
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, ceilings, ncu=ncu)


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 5 Hopper attention benchmark, then its tables and plots", measure,
                       lambda names: profile_target())


if __name__ == "__main__":
    sys.exit(main())
