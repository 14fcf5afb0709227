"""`python -m phase5_fused.fp32.run [--quick] [--no-ncu]`: measure the FP32 fused kernels, then render.

1. Attention forward at B=4, H=8, D in {64, 128}, causal and not, S from 128 to 32768: the
   teaching, the fast and the tf32x3 kernel beside torch_naive, sdpa_math, sdpa_efficient and phases 2-4, on
   the same inputs in the same run, timed in turns (utils.bench.time_in_turns; the S x S paths and
   the slow kernels stop at MAX_S).
2. Every version of the fused kernel (fp32.KERNELS) beside sdpa_efficient at S=4096, D in {64, 128},
   causal and not (section `versions`: each row with its version number, the idea it adds and its
   speed-up over the version before).
3. The fast kernel at stride 1, 2, 4, 8 (rows op=attention_strided, with their speed-up over
   stride 1), and every tile variant of the fast kernel at S=4096 (section `variants`).
4. The fast kernel on grouped-query heads (op attention_gqa: B=4, H=32 over H_kv in {32, 8},
   S=4096, D=64, causal and not) and with a sliding window (op attention_window: B=4, H=8, S=8192,
   D=64, causal, window in {256, 1024, 4096, none}, each row with its speed-up over no window;
   TFLOP/s count the visible pairs only).
5. Nsight Compute on one call of every attention kernel of phases 2-5 (every version of the fused
   kernel) and of sdpa_efficient at the headline shape, in one session (this script's
   --profile-target).
6. results/metrics.json, then the tables and plots that manifest.json declares (utils.render).
Without a GPU it measures nothing and renders from the committed results. --quick: a short run
written to results/quick/metrics.json, not rendered. About 4 minutes on an H100.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch

from phase5_fused import fp32
from utils import reference
from utils.attention_bench import attention_row, numbered_versions, try_attention_rows
from utils.kernel_bench import lesson_main, results_dir
from utils.testing import random_qkv

HERE = Path(__file__).resolve().parent
B, H = 4, 8
HEADLINE = {"B": B, "H": H, "Sq": 4096, "Sk": 4096, "D": 64, "causal": False, "dtype": "float32"}
SEQ_LENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SEQ_LENS = [256, 1024]
STRIDES = [1, 2, 4, 8]
# Grouped-query heads (op attention_gqa) and sliding windows (op attention_window; None: no window).
GQA = {"B": 4, "H": 32, "H_kv": (32, 8), "S": 4096, "D": 64}
WINDOW = {"B": 4, "H": 8, "S": 8192, "D": 64, "windows": (256, 1024, 4096, None)}
# Largest S each implementation is timed at (B=4, H=8): the unfused paths hold B*H*S*S floats
# (S=16384: 34 GB per buffer) and the simple kernels would take most of the time budget.
MAX_S = {"torch_naive": 8192, "sdpa_math": 8192, "phase2_naive": 4096, "phase3_tiled_t16": 4096,
         "phase4_coalesced": 4096, "phase5_fused_teaching": 4096}
REFERENCE_LIMIT = 2**28  # float64 reference only up to this many score elements
# The earlier phases timed beside this one: impl name -> (package, extra arguments of its attention).
PHASE_PEERS = {"phase2_naive": ("phase2_naive", {}), "phase3_tiled_t16": ("phase3_tiled", {"tile": 16}),
               "phase4_coalesced": ("phase4_coalesced", {})}
# The versions of the fused kernel (fp32.KERNELS, in lesson order): the impl name of their rows and
# the idea each adds over the version before (README "Versions").
VERSIONS = {"teaching": ("phase5_fused_teaching", "fusion: online softmax, one thread per row"),
            "v2": ("phase5_fused_v2", "register tiles, float4 Q K^T"),
            "v3": ("phase5_fused_v3", "cp.async, K and V double-buffered"),
            "v4": ("phase5_fused_v4", "exp2 with the scale folded in, partial row sums"),
            "fast": ("phase5_fused", "mask-free tiles, strided gather, heaviest blocks first"),
            "tf32x3": ("phase5_fused_tf32x3", "tensor cores: 3xTF32 mma.sync, Q in registers")}
NCU_IMPLS = ["phase2_naive", "phase3_tiled_t16", "phase4_coalesced",
             *(VERSIONS[kernel][0] for kernel in fp32.KERNELS), "sdpa_efficient"]


# ------------------------------------------------------------------------------------------------
# Implementations: name -> f(q, k, v, causal)


def version_impls() -> dict:
    """Every version of the fused kernel, in lesson order."""
    return {VERSIONS[kernel][0]: lambda q, k, v, c, name=kernel: fp32.attention(q, k, v, is_causal=c, kernel=name)
            for kernel in fp32.KERNELS}


def fused_impls() -> dict:
    """The versions the sweep times at every S: the teaching kernel, the fast one and the tensor-core one."""
    versions = version_impls()
    return {name: versions[name] for name in ("phase5_fused_teaching", "phase5_fused", "phase5_fused_tf32x3")}


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
        except Exception as exc:  # a peer phase missing or broken must not stop this one
            if verbose:
                print(f"note: {name} skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})",
                      flush=True)
    return impls


# ------------------------------------------------------------------------------------------------
# Timing rows (results schema). utils.bench.time_cuda with a per-point time cap keeps the run short.


def timing(quick: bool) -> dict:
    """utils.bench.time_cuda / time_in_turns arguments: fewer repetitions, capped per point."""
    return {"warmup": 2 if quick else 3, "reps": 10 if quick else 25, "max_seconds": 0.3 if quick else 0.8}


def sweep(impls: dict, seq_lens, head_dims, quick) -> list[dict]:
    rows = []
    start = time.perf_counter()
    configs = [(D, c, S) for D in head_dims for c in (False, True) for S in seq_lens]
    for n, (D, causal, S) in enumerate(configs, 1):
        q, k, v = random_qkv(B, H, S, S, D)
        ref = reference.attention(q, k, v, is_causal=causal) if B * H * S * S <= REFERENCE_LIMIT else None
        runs = {name: fn for name, fn in impls.items() if S <= MAX_S.get(name, 1 << 30)}
        rows += try_attention_rows(runs, q, k, v, causal, ref, **timing(quick)).values()
        del q, k, v, ref
        torch.cuda.empty_cache()
        print(f"[sweep {n}/{len(configs)}] D={D} causal={causal} S={S} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    return rows


def version_rows(sdpa_efficient, quick) -> list[dict]:
    """Every version at S=4096 (quick: 1024), D=64 and 128, causal and not, beside sdpa_efficient
    (None where it does not run) on the same inputs: each version's row gets its number, the idea
    it adds and its speed-up over the version before."""
    rows = []
    S = 1024 if quick else HEADLINE["Sq"]
    impls = version_impls()
    for D in (64, 128):
        for causal in (False, True):
            q, k, v = random_qkv(B, H, S, S, D)
            runs = {} if sdpa_efficient is None else {"sdpa_efficient": sdpa_efficient}
            runs.update({VERSIONS[kernel][0]: impls[VERSIONS[kernel][0]] for kernel in fp32.KERNELS})
            timed = try_attention_rows(runs, q, k, v, causal, **timing(quick))
            rows += [timed["sdpa_efficient"]] if "sdpa_efficient" in timed else []
            rows += numbered_versions([timed.get(VERSIONS[kernel][0]) for kernel in fp32.KERNELS],
                                      [VERSIONS[kernel][1] for kernel in fp32.KERNELS])
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def strided_rows(quick) -> list[dict]:
    """The fast kernel at stride 1 (dense), 2, 4, 8: time and speed-up over dense."""
    rows = []
    for S in ([2048] if quick else [4096, 16384]):
        for causal in (False, True):
            q, k, v = random_qkv(B, H, S, S, 64)
            dense_ms = None
            for stride in STRIDES:
                fn = lambda q, k, v, c, s=stride: fp32.attention(q, k, v, is_causal=c, stride=s)
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
    rows = []
    for D in (64, 128):
        q, k, v = random_qkv(B, H, 1024 if quick else 4096, 1024 if quick else 4096, D)
        for variant in range(fp32.FAST_VARIANTS[D]):
            fn = lambda q, k, v, c, n=variant: fp32.attention(q, k, v, is_causal=c, variant=n)
            row = attention_row("phase5_fused", fn, q, k, v, False, op="attention_variant", **timing(quick))
            row["variant"] = variant
            rows.append(row)
        del q, k, v
    return rows


def gqa_window_rows(quick) -> list[dict]:
    """The fast kernel on H query heads over H_kv KV heads (the same q for each H_kv), and causal
    with each window of WINDOW (speedup_vs_full: the time without a window over this row's). The
    --quick run takes a quarter of the lengths."""
    from utils import roofline

    rows = []
    B, H, D, S = GQA["B"], GQA["H"], GQA["D"], GQA["S"] // (4 if quick else 1)
    for causal in (False, True):
        q = random_qkv(B, H, S, 1, D)[0]
        for H_kv in GQA["H_kv"]:
            k, v = random_qkv(B, H_kv, 1, S, D)[1:]
            row = attention_row("phase5_fused", lambda q_, k_, v_, c_: fp32.attention(q_, k_, v_, is_causal=c_),
                                q, k, v, causal, op="attention_gqa", **timing(quick))
            row["H_kv"] = H_kv
            rows.append(row)
            del k, v
        del q
    B, H, D, S = WINDOW["B"], WINDOW["H"], WINDOW["D"], WINDOW["S"] // (4 if quick else 1)
    q, k, v = random_qkv(B, H, S, S, D)
    full_ms = None
    for window in sorted(WINDOW["windows"], key=lambda w: w is not None):  # None first: the base
        fn = lambda q_, k_, v_, c_, w=window: fp32.attention(q_, k_, v_, is_causal=c_, window=w)
        row = attention_row("phase5_fused", fn, q, k, v, True, op="attention_window", **timing(quick))
        row["window"] = "none" if window is None else window
        row["tflops"] = roofline.tflops(roofline.attention_flops(B, H, S, S, D, True, window=window), row["ms"])
        full_ms = row["ms"] if window is None else full_ms
        row["speedup_vs_full"] = full_ms / row["ms"]
        rows.append(row)
    del q, k, v
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------
# ncu: one process runs one call of every implementation at the headline shape. A marker kernel
# (torch.cuda._sleep) follows the set-up and each call, so the records split per implementation.

MARKER = "spin_kernel"
TORCH_KERNEL_HINTS = ("at::native", "at::cuda")


def profile_target() -> None:
    impls = {**peer_impls(verbose=False), **version_impls()}
    shape = (HEADLINE["B"], HEADLINE["H"], HEADLINE["Sq"], HEADLINE["D"])
    q, k, v = (torch.randn(*shape).cuda() for _ in range(3))  # made on the CPU: no kernels
    torch.cuda._sleep(1000)  # marker: everything before it (peer probes, builds) is set-up
    for impl in NCU_IMPLS:
        if impl in impls:
            impls[impl](q, k, v, HEADLINE["causal"])
        torch.cuda._sleep(1000)
    torch.cuda.synchronize()


def run_ncu() -> dict:
    """ncu records per implementation ({impl: [one record per kernel]}), or why ncu did not run."""
    from utils.ncu import NcuUnavailable, profile_python

    try:
        records = profile_python(["phase5_fused.fp32.run", "--profile-target", "all"], launch_count=200)
    except (NcuUnavailable, OSError, TimeoutError) as exc:
        print(f"note: ncu unavailable: {str(exc).splitlines()[0]}", flush=True)
        return {"unavailable": str(exc)}
    per_impl: dict[str, list] = {name: [] for name in NCU_IMPLS}
    segment = -1  # records before the first marker are set-up
    for r in records:
        if MARKER in r["kernel"]:
            segment += 1
            continue
        if 0 <= segment < len(NCU_IMPLS) and not any(h in r["kernel"] for h in TORCH_KERNEL_HINTS):
            r["kernel"] = r["kernel"].split("(")[0][:120]
            per_impl[NCU_IMPLS[segment]].append(r)
    return {"shape": HEADLINE, "kernels": {k: v for k, v in per_impl.items() if v}}


# ------------------------------------------------------------------------------------------------


def measure(args) -> Path:
    """The sweep, the versions, the strided rows, the tile variants and the ncu records, written to the
    results file (returned)."""
    from utils.results import write_results
    from utils.roofline import get_ceilings

    start = time.perf_counter()
    impls = {**peer_impls(), **fused_impls()}
    print(f"impls: {', '.join(impls)}", flush=True)
    rows = sweep(impls, QUICK_SEQ_LENS if args.quick else SEQ_LENS, (64, 128), args.quick)
    print(f"sweep done ({time.perf_counter() - start:.0f} s)", flush=True)
    versions = version_rows(impls.get("sdpa_efficient"), args.quick)
    print(f"versions done ({time.perf_counter() - start:.0f} s)", flush=True)
    rows += strided_rows(args.quick)
    rows += gqa_window_rows(args.quick)
    variants = variant_rows(args.quick)
    print(f"strided + variants done ({time.perf_counter() - start:.0f} s)", flush=True)
    ncu = {"skipped": "--no-ncu"} if args.no_ncu else run_ncu()
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, get_ceilings(), versions=versions,
                         variants=variants, ncu=ncu, headline=HEADLINE, max_s=MAX_S)


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 5 FP32 fused attention benchmark, then its tables and plots", measure,
                       lambda names: profile_target())

if __name__ == "__main__":
    sys.exit(main())
