"""`python -m phase5_fused.tensor_cores.run [--quick] [--no-ncu]`: measure the tensor-core kernel, then render.

1. Attention forward in FP16 at B=4, H=8, D in {64, 128}, causal and not, S from 512 to 32768:
   phase5_fused_tc beside FlashAttention-2 (sdpa_flash), cuDNN (sdpa_cudnn), sdpa_efficient and
   torch_naive, and the previous lesson's FP32 kernel (phase5_fused, on the same values in FP32),
   on the same inputs in the same run; the FP16 ones timed in turns (utils.bench.time_in_turns).
2. Grouped-query prefill (op attention_gqa): B=4, H=32 query heads over H_kv in {32, 8} KV heads,
   S=4096, D=128, causal and not, beside sdpa_flash with enable_gqa, every (impl, H_kv) pair of a
   causal setting timed in the same turns.
   Sliding window (op attention_window): B=4, H=8, S=8192, D=128, causal, window in {256, 1024,
   4096, none}, each row with its speed-up over no window, beside sdpa_efficient given the same
   window as a boolean mask (a mask hides scores but skips no work). TFLOP/s count the visible
   pairs only (utils.roofline.attention_flops with the window); GB/s the K/V of H_kv heads.
   Head sizes (op attention_head_dims): B=4, H=8, S=4096, non-causal, D from 32 to 256 with the
   padded 80 among them, beside sdpa_flash; TFLOP/s count the D columns (4·B·H·S²·D), tile_tflops
   the Dp columns of the tile our kernel runs D on.
   The lesson's versions (section `versions`; tensor_cores.VERSIONS, README "Versions"): each at
   B=4, H=8, S=4096, D in {64, 128}, FP16, causal and not, beside sdpa_flash on the same inputs,
   timed in turns with it, each row with its version number, the idea it adds and its speed-up over the
   version before.
3. Nsight Compute on one non-causal call of phase5_fused_tc and of sdpa_flash at S=4096, D=64 and
   128, with the warp-state and pipe counters (this script's --profile-target); the records are
   named impl_D<D>.
4. results/metrics.json, then the tables and plots that manifest.json declares (utils.render).
Without a GPU it measures nothing and renders from the committed results. --quick: a short run
written to results/quick/metrics.json, not rendered (with GQA and window rows at a quarter of the
lengths). Under 3 minutes on an H100.
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
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
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
# Grouped-query prefill: B, H query heads, the H_kv values compared, S, D (op attention_gqa).
GQA = {"B": 4, "H": 32, "H_kv": (32, 8), "S": 4096, "D": 128}
# Sliding window: B, H, S, D and the windows (None: causal without a window), op attention_window.
WINDOW = {"B": 4, "H": 8, "S": 8192, "D": 128, "windows": (256, 1024, 4096, None)}
# Head sizes, non-causal (op attention_head_dims): 80 runs on the tiles of 96, padded.
HEAD_SIZES = {"B": 4, "H": 8, "S": 4096, "D": (32, 64, 80, 96, 128, 160, 192, 256)}
# The lesson's versions (tensor_cores.VERSIONS, in order): the impl name of their rows and the idea
# each adds over the version before (README "Versions"); timed at B, H, HEADLINE_S, HEAD_DIMS.
VERSION_ROWS = {"v1_mma": ("phase5_fused_tc_v1", "mma.sync; fragments by plain loads; synchronous copies"),
                "v2_ldmatrix": ("phase5_fused_tc_v2", "ldmatrix.x4 (.trans for V)"),
                "v3_swizzle": ("phase5_fused_tc_v3", "XOR-swizzled tiles"),
                "v4_cp_async": ("phase5_fused_tc_v4", "cp.async ring of K/V blocks"),
                "v5_exp2": ("phase5_fused_tc_v5", "log2 units: one FFMA and one ex2 per score"),
                "v6_lazy": ("phase5_fused_tc_v6", "lazy rescaling of O and l"),
                "fast": (IMPL, "measured tiles; Q held in registers at D=64; key blocks without mask code")}


def tc_fn(q, k, v, causal):
    return tensor_cores.attention(q, k, v, is_causal=causal)


def version_fn(version):
    """The lesson's version `version` (tensor_cores.VERSIONS) as f(q, k, v, causal)."""
    return lambda q, k, v, causal: tensor_cores.attention(q, k, v, is_causal=causal, version=version)


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
    from utils.attention_bench import REFERENCE_LIMIT, try_attention_row, try_attention_rows
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
        impls = {name: fn for name, fn in impls.items() if S <= MAX_S.get(name, S)}
        rows = list(try_attention_rows(impls, q, k, v, causal, ref).values())
        if S <= MAX_S["phase5_fused"]:
            q32, k32, v32 = (t.float() for t in (q, k, v))
            rows.append(try_attention_row("phase5_fused", fp32_fn, q32, k32, v32, causal, ref))
        del q, k, v, ref
        torch.cuda.empty_cache()
        return [r for r in rows if r is not None]

    return sweep(configs, run_config, "tc attention")


def gqa_rows(quick) -> list[dict]:
    """phase5_fused_tc on H query heads over each H_kv of KV heads (the same q), beside sdpa_flash
    with enable_gqa, every pair timed in the same turns: sharing K/V should cost nothing (the same
    time at H_kv = H / 4 as at H_kv = H)."""
    from utils.attention_bench import grouped_query_rows
    from utils.peers import sdpa

    flash = sdpa("sdpa_flash")
    impls = {IMPL: tc_fn, "sdpa_flash": lambda q, k, v, causal: flash(q, k, v, is_causal=causal)}
    return grouped_query_rows(impls, GQA, DTYPE, seed=7, quick=quick)


def window_rows(quick) -> list[dict]:
    """phase5_fused_tc causal with each window of WINDOW, and sdpa_efficient with the same window as
    a boolean mask; without a window (window "none") both causal, and sdpa_flash causal beside them.
    speedup_vs_full: the same impl's time without a window over this row's."""
    from utils import roofline
    from utils.attention_bench import try_attention_row
    from utils.peers import sdpa

    B, H, D = WINDOW["B"], WINDOW["H"], WINDOW["D"]
    S = WINDOW["S"] // 4 if quick else WINDOW["S"]
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3))
    efficient, flash = sdpa("sdpa_efficient"), sdpa("sdpa_flash")
    i, j = torch.arange(S, device="cuda").view(-1, 1), torch.arange(S, device="cuda").view(1, -1)
    rows, full_ms = [], {}
    for window in sorted(WINDOW["windows"], key=lambda w: w is not None):  # None first: the bases
        impls = {IMPL: lambda q_, k_, v_, c_, w=window: tensor_cores.attention(q_, k_, v_, is_causal=c_, window=w)}
        if window is None:
            impls["sdpa_flash"] = lambda q_, k_, v_, c_: flash(q_, k_, v_, is_causal=c_)
            impls["sdpa_efficient"] = lambda q_, k_, v_, c_: efficient(q_, k_, v_, is_causal=c_)
        else:
            keep = (j <= i) & (j > i - window)
            impls["sdpa_efficient"] = lambda q_, k_, v_, c_, m=keep: efficient(q_, k_, v_, mask=m)
        for name, fn in impls.items():
            row = try_attention_row(name, fn, q, k, v, True, op="attention_window")
            if row is None:
                continue
            row["window"] = "none" if window is None else window
            row["tflops"] = roofline.tflops(roofline.attention_flops(B, H, S, S, D, True, window=window), row["ms"])
            if window is None:
                full_ms[name] = row["ms"]
            if name in full_ms:
                row["speedup_vs_full"] = full_ms[name] / row["ms"]
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def head_dim_rows(quick) -> list[dict]:
    """phase5_fused_tc and sdpa_flash at each head size of HEAD_SIZES. Our rows also carry the tile
    head dim Dp (the next multiple of 32) and tile_tflops = TFLOP/s x Dp / D: the work the tile does."""
    from utils.attention_bench import try_attention_row
    from utils.peers import sdpa

    flash = sdpa("sdpa_flash")
    B, H = HEAD_SIZES["B"], HEAD_SIZES["H"]
    S = HEAD_SIZES["S"] // 4 if quick else HEAD_SIZES["S"]
    rows = []
    for D in HEAD_SIZES["D"]:
        gen = torch.Generator(device="cuda").manual_seed(13 + D)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3))
        for name, fn in ((IMPL, tc_fn), ("sdpa_flash", lambda q_, k_, v_, c_: flash(q_, k_, v_, is_causal=c_))):
            row = try_attention_row(name, fn, q, k, v, False, op="attention_head_dims")
            if row is None:
                continue
            if name == IMPL:
                row["Dp"] = next(dp for dp in tensor_cores.TILE_D if dp >= D)
                row["tile_tflops"] = row["tflops"] * row["Dp"] / D
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def version_rows(quick) -> list[dict]:
    """Every version of VERSION_ROWS at S=HEADLINE_S (quick: a quarter), D in HEAD_DIMS, causal and
    not, beside sdpa_flash on the same inputs: each version's row gets its number, the idea it adds
    and its speed-up over the version before."""
    from utils.attention_bench import numbered_versions, try_attention_rows
    from utils.peers import sdpa

    flash = sdpa("sdpa_flash")
    S = HEADLINE_S // 4 if quick else HEADLINE_S
    rows = []
    for D in HEAD_DIMS:
        for causal in (False, True):
            q, k, v = make_inputs(S, D, seed=17 + D + causal)
            impls = {"sdpa_flash": lambda q_, k_, v_, c_: flash(q_, k_, v_, is_causal=c_)}
            impls.update({VERSION_ROWS[version][0]: version_fn(version) for version in tensor_cores.VERSIONS})
            timed = try_attention_rows(impls, q, k, v, causal)
            rows += [timed["sdpa_flash"]] if "sdpa_flash" in timed else []
            rows += numbered_versions([timed.get(VERSION_ROWS[version][0]) for version in tensor_cores.VERSIONS],
                                      [VERSION_ROWS[version][1] for version in tensor_cores.VERSIONS])
            del q, k, v
            torch.cuda.empty_cache()
    return rows


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
    rows += gqa_rows(args.quick) + window_rows(args.quick) + head_dim_rows(args.quick)
    versions = version_rows(args.quick)
    ncu = {"skipped": "--no-ncu"} if args.no_ncu else run_ncu()
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, ceilings, versions=versions, ncu=ncu)


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 5 tensor-core attention benchmark, then its tables and plots", measure,
                       lambda names: profile_target())

if __name__ == "__main__":
    sys.exit(main())
