"""`python -m phase5_fused.backward.run [--quick] [--no-ncu]`: time the attention backward, then render.

1. The backward alone at B=4, H=8, S in {1024, 4096}, D in {64, 128}, causal and not: each
   implementation runs its forward once, untimed, and the timed call is
   torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), the whole backward that autograd
   runs for it (for ours: D_i, the kernel, dQ's conversion). FP16: phase5_fused_bwd_hopper
   (phase5_fused.hopper.attention's backward, hopper_bwd.cu; on Hopper GPUs only) and
   phase5_fused_bwd_tc (phase5_fused.tensor_cores.attention's backward) beside sdpa_flash and
   sdpa_cudnn; FP32:
   phase5_fused_bwd (phase5_fused.fp32.attention's backward) beside sdpa_efficient.
2. TFLOP/s = 2.5 x the forward's FLOPs: the backward's five matmuls (S = Q K^T again,
   dP = dO V^T, dV = P^T dO, dK = dS^T Q, dQ = dS K) are 5 x 2 Sq Sk D per head against the
   forward's 2 x 2 Sq Sk D: 10 B H Sq Sk D, halved for causal. GB/s counts the minimum traffic:
   q, k, v, O, dO read once, dq, dk, dv written once (8 B H S D elements).
   At S=4096 the tensor-core kernel's three tile configurations (bwd_tc.cu: variant 0, 4 warps and
   Bc = 64; variant 1, 8 warps and Bc = 128; bwd_tc_2d.cu: variant 2, FlashAttention-2's
   two-dimensional warp tiles; autograd's default per D and GPU is backward.DEFAULT_VARIANT) are also timed
   by calling the backward op directly on the saved out and lse: rows phase5_fused_bwd_tc_v0, _v1
   and _v2; likewise the Hopper kernel's variants (hopper_bwd.cu: 0, dQ
   shared by keys; 1, by columns; autograd runs hopper.BWD_DEFAULT_VARIANT), rows
   phase5_fused_bwd_hopper_v0 and _v1, on Hopper GPUs; and the FP32 kernels (0: bwd_fp32.cu on
   FFMA, 1: bwd_tf32x3.cu in 3xTF32), rows phase5_fused_bwd_fp32_v0 and _v1.
3. rel_err (at S=1024 only: the float64 reference holds S x S matrices) is the largest of the
   relative errors of dq, dk, dv against utils.reference.attention_grads.
   Grouped-query heads (op attention_backward_gqa, field H_kv): autograd's backward of
   phase5_fused_bwd_hopper (on Hopper GPUs), phase5_fused_bwd_tc, sdpa_flash and sdpa_cudnn
   (enable_gqa) at GQA's shape, B=4, H=32 query heads over H_kv in {32, 8}, S=4096, D=128, causal
   and not, every (impl, H_kv) pair timed in the same turns (utils.bench.time_in_turns): each kernel
   with shared K/V heads against itself with one K/V head per query head.
   Sliding window (op attention_backward_window): autograd's backward of phase5_fused_bwd_tc at
   B=4, H=8, S=8192, D=128, causal, window in {256, 1024, 4096, none}, each row with its speed-up
   over no window, beside sdpa_efficient given the same window as a boolean mask (a mask hides
   scores but skips no work) and, without a window, sdpa_flash; TFLOP/s count the visible pairs.
   Head dims (op attention_backward_head_dims): autograd's backward of phase5_fused_bwd_tc beside
   sdpa_flash and sdpa_cudnn at B=4, H=8, S=4096, FP16, causal and not, D in HEAD_DIMS_SWEEP: the
   tile widths and the head dims between them that run padded (80 on the tiles of 96, 112 on
   those of 128), and above 128 the widths of variant 2's Bc = 64 tiles; TFLOP/s count the head
   dim's own FLOPs, not the tile's.
4. Nsight Compute (skipped with --no-ncu): the backward's main kernel of each (impl, D) of
   PROFILE_CALLS at S=4096, non-causal (ours, the tensor-core kernel's variants 1 and 2 called
   directly, and the peer of each dtype): instruction counts, memory
   traffic, occupancy, why warps wait (utils.ncu); records under "ncu" in the results.
5. results/metrics.json, then the tables manifest.json declares (utils.render).
Without a GPU it measures nothing and renders from the committed results. --quick: S=1024 only,
written to results/quick/metrics.json, not rendered. About 2 minutes on an H100.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from phase5_fused import backward, fp32, hopper, tensor_cores
from utils.kernel_bench import lesson_main, results_dir

HERE = Path(__file__).resolve().parent
B, H = 4, 8
HEAD_DIMS = (64, 128)
# The head-dims rows: tile widths of the tensor-core backward and padded head dims between them.
HEAD_DIMS_SWEEP = (32, 64, 80, 96, 112, 128, 160, 192, 256)
HEAD_DIMS_IMPLS = [("phase5_fused_bwd_tc", "tc"), ("sdpa_flash", "sdpa_flash"), ("sdpa_cudnn", "sdpa_cudnn")]
SEQ_LENS = (1024, 4096)
QUICK_SEQ_LENS = (1024,)
REFERENCE_S = 1024  # rel_err only here
VARIANT_S = 4096  # the tensor-core variants are compared here
# ncu profiles the backward's main kernel of each (impl, D) at S=NCU_S, non-causal, in this order.
NCU_S = 4096
# The Hopper kernel's come last: on another GPU they are missing, and the others keep their labels.
PROFILE_CALLS = [("phase5_fused_bwd_tc_v1", 64), ("phase5_fused_bwd_tc_v1", 128), ("phase5_fused_bwd_tc_v2", 64),
                 ("phase5_fused_bwd_tc_v2", 128), ("sdpa_flash", 64), ("sdpa_flash", 128), ("phase5_fused_bwd", 64),
                 ("sdpa_efficient", 64), ("phase5_fused_bwd_hopper", 64), ("phase5_fused_bwd_hopper", 128)]
# Profiled impls that are a variant's op called directly, not autograd's backward: (kernel, variant).
# The tensor-core kernel's are named by variant: autograd's default depends on the GPU.
PROFILE_VARIANTS = {"phase5_fused_bwd_tc_v1": ("tc", 1), "phase5_fused_bwd_tc_v2": ("tc", 2)}
# The main kernel each impl's backward launches (FP32: variant 1, 3xTF32, at D = 64 and 128, the
# default): ncu profiles these, and each record is checked against its call's before it is labelled.
MAIN_KERNEL = {"phase5_fused_bwd_tc_v1": "tc_backward_kernel", "phase5_fused_bwd_tc_v2": "tc_backward_2d_kernel",
               "sdpa_flash": "flash_bwd_dq_dk_dv",
               "phase5_fused_bwd": "fp32_backward_kernel|tf32x3_backward_kernel", "sdpa_efficient": "fmha_cutlassB",
               "phase5_fused_bwd_hopper": "hopper_bwd_kernel"}
NCU_REGEX = "|".join(MAIN_KERNEL.values())
BACKWARD_FLOP_FACTOR = 2.5
# Grouped-query backward: B, H query heads, the H_kv values compared, S, D; (impl, forward), the
# Hopper kernel's on Hopper GPUs only.
GQA = {"B": 4, "H": 32, "H_kv": (32, 8), "S": 4096, "D": 128}
GQA_IMPLS = [("phase5_fused_bwd_hopper", "hopper"), ("phase5_fused_bwd_tc", "tc"), ("sdpa_flash", "sdpa_flash"),
             ("sdpa_cudnn", "sdpa_cudnn")]
# Sliding-window backward (FP16): B, H, S, D and the windows (None: causal without a window).
WINDOW = {"B": 4, "H": 8, "S": 8192, "D": 128, "windows": (256, 1024, 4096, None)}
# (impl, dtype, forward): ours first, then the peers of the same dtype.
IMPLS = [("phase5_fused_bwd_hopper", torch.float16, "hopper"), ("phase5_fused_bwd_tc", torch.float16, "tc"),
         ("sdpa_flash", torch.float16, "sdpa_flash"), ("sdpa_cudnn", torch.float16, "sdpa_cudnn"),
         ("phase5_fused_bwd", torch.float32, "fp32"), ("sdpa_efficient", torch.float32, "sdpa_efficient")]
# The kernels whose variants are timed by a direct call: (forward returning lse, backward op).
VARIANT_CALLS = {"tc": (tensor_cores.attention, backward.attention_backward),
                 "hopper": (hopper.attention, hopper.attention_backward),
                 "fp32": (fp32.attention, backward.attention_backward)}


def forward_fn(name):
    """f(q, k, v, causal) -> out, differentiable."""
    if name == "hopper":
        return lambda q, k, v, c: hopper.attention(q, k, v, is_causal=c)
    if name == "tc":
        return lambda q, k, v, c: tensor_cores.attention(q, k, v, is_causal=c)
    if name == "fp32":
        return lambda q, k, v, c: fp32.attention(q, k, v, is_causal=c)
    from utils.peers import sdpa

    fn = sdpa(name)
    return lambda q, k, v, c: fn(q, k, v, is_causal=c)


def on_hopper() -> bool:
    """Whether the current GPU runs the Hopper kernels (sm_90)."""
    return hopper.device_capability(torch.cuda.current_device()) == hopper.HOPPER


def make_inputs(S, D, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], dout


def backward_call(forward, leaves, dout, causal, variant):
    """The timed call: autograd's backward of one saved forward, or, with a variant ("tc", "hopper"
    or "fp32", number), that kernel's backward op itself on the saved out and lse."""
    q, k, v = leaves
    if variant is None:
        out = forward(q, k, v, causal)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    kernel, number = variant
    forward_lse, backward_fn = VARIANT_CALLS[kernel]
    with torch.no_grad():
        out, lse = forward_lse(q, k, v, is_causal=causal, return_lse=True)
    return lambda: backward_fn(q, k, v, out, lse, dout, is_causal=causal, variant=number)


def first_call(label, forward, leaves, dout, causal, variant=None):
    """backward_call's timed call and the gradients of its first run, or (None, None) with a note
    naming `label` when the impl refuses the inputs."""
    try:
        grad = backward_call(forward, leaves, dout, causal, variant)
        return grad, grad()
    except (RuntimeError, ValueError, TypeError) as exc:
        print(f"    {label}: skipped ({str(exc).splitlines()[0][:100]})", flush=True)
        return None, None


def backward_row(impl, forward, leaves, dout, causal, refs, variant=None, op="attention_backward"):
    """Time the backward of one saved forward, as a results row of `op` (None when the impl refuses)."""
    from utils import roofline
    from utils.bench import peak_extra_mb, time_cuda
    from utils.testing import rel_error

    q = leaves[0]
    _, _, S, D = q.shape
    grad, grads = first_call(impl, forward, leaves, dout, causal, variant)
    if grad is None:
        return None
    ms = time_cuda(grad, warmup=3, reps=20, max_seconds=2.0)
    flops = BACKWARD_FLOP_FACTOR * roofline.attention_flops(B, H, S, S, D, causal)
    nbytes = 8 * B * H * S * D * q.element_size()
    row = {"impl": impl, "op": op, "B": B, "H": H, "Sq": S, "Sk": S, "D": D,
           "dtype": str(q.dtype).replace("torch.", ""), "causal": causal, "ms": ms,
           "tflops": roofline.tflops(flops, ms), "gbps": roofline.gbps(nbytes, ms), "extra_mb": peak_extra_mb(grad)}
    if variant is not None:
        row["variant"] = variant[1]
    if refs is not None:
        row["rel_err"] = max(rel_error(g.nan_to_num(0.0), r) for g, r in zip(grads, refs))
    return row


def benchmark(seq_lens) -> list[dict]:
    from utils import reference
    from utils.bench import sweep

    configs = [{"S": S, "D": D, "causal": c} for D in HEAD_DIMS for c in (False, True) for S in seq_lens]

    def run_config(c):
        S, D, causal = c["S"], c["D"], c["causal"]
        rows = []
        for dtype in (torch.float16, torch.float32):
            leaves, dout = make_inputs(S, D, dtype, seed=S * 1000 + D * 10 + causal)
            # One float64 reference per dtype's inputs, at small S only.
            refs = reference.attention_grads(*leaves, dout, is_causal=causal) if S <= REFERENCE_S else None
            for impl, impl_dtype, fwd in IMPLS:
                if impl_dtype == dtype:
                    rows.append(backward_row(impl, forward_fn(fwd), leaves, dout, causal, refs))
            if S == VARIANT_S and dtype == torch.float32:
                variants = [("fp32", n) for n in backward.variants_for(dtype, D)]
            elif S == VARIANT_S:
                variants = [("tc", n) for n in range(backward.VARIANTS[dtype])]
                if on_hopper():
                    variants += [("hopper", n) for n in hopper.BWD_VARIANTS]
            else:
                variants = []
            for kernel, number in variants:
                rows.append(backward_row(f"phase5_fused_bwd_{kernel}_v{number}", None, leaves, dout, causal, None,
                                         variant=(kernel, number)))
            del leaves, dout, refs
            torch.cuda.empty_cache()
        return [r for r in rows if r is not None]

    return sweep(configs, run_config, "attention backward")


def head_dim_backward_rows(quick: bool) -> list[dict]:
    """Autograd's backward of each impl of HEAD_DIMS_IMPLS at each D of HEAD_DIMS_SWEEP, causal and not
    (S = 1024 when quick), as op attention_backward_head_dims rows; at a D up to the row tiles' limit
    that the variants table does not time (not in HEAD_DIMS), each tensor-core variant that takes D
    too, called directly, so that autograd's default there is compared with every choice it had."""
    S = QUICK_SEQ_LENS[0] if quick else VARIANT_S
    rows = []
    for D in HEAD_DIMS_SWEEP:
        for causal in (False, True):
            leaves, dout = make_inputs(S, D, torch.float16, seed=D * 10 + causal)
            for impl, fwd in HEAD_DIMS_IMPLS:
                rows.append(backward_row(impl, forward_fn(fwd), leaves, dout, causal, None,
                                         op="attention_backward_head_dims"))
            if D not in HEAD_DIMS and D <= backward.TC_ROW_TILE_MAX_D:
                for number in backward.variants_for(torch.float16, D):
                    rows.append(backward_row(f"phase5_fused_bwd_tc_v{number}", None, leaves, dout, causal, None,
                                             variant=("tc", number), op="attention_backward_head_dims"))
            del leaves, dout
            torch.cuda.empty_cache()
    return [r for r in rows if r is not None]


def gqa_backward_rows(quick: bool) -> list[dict]:
    """Autograd's backward of each impl of GQA_IMPLS on the same q (and dO) over the k, v of each
    H_kv, causal and not (S / 4 when quick); every (impl, H_kv) pair timed in the same turns, so that
    the ratio of a kernel's two rows comes from the same rounds. A pair that is rejected or runs out
    of memory is left out with a note."""
    from utils import roofline
    from utils.bench import time_in_turns

    impls = [(impl, fwd) for impl, fwd in GQA_IMPLS if on_hopper() or fwd != "hopper"]
    Bg, Hg, Dg = GQA["B"], GQA["H"], GQA["D"]
    S = GQA["S"] // 4 if quick else GQA["S"]
    rows = []
    for causal in (False, True):
        gen = torch.Generator(device="cuda").manual_seed(17 + causal)
        q, dout = (torch.randn(Bg, Hg, S, Dg, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
        runs = {}
        for H_kv in GQA["H_kv"]:
            k, v = (torch.randn(Bg, H_kv, S, Dg, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
            for impl, fwd in impls:
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                grad, _ = first_call(f"{impl} (H_kv={H_kv})", forward_fn(fwd), leaves, dout, causal)
                if grad is not None:
                    runs[impl, H_kv] = grad
        flops = BACKWARD_FLOP_FACTOR * roofline.attention_flops(Bg, Hg, S, S, Dg, causal)
        for (impl, H_kv), ms in time_in_turns(runs, warmup=2, reps=10, max_seconds=1.0).items():
            print(f"    {impl:<26} H_kv={H_kv:<3} causal={causal!s:<5} {ms:8.3f} ms", flush=True)
            rows.append({"impl": impl, "op": "attention_backward_gqa", "B": Bg, "H": Hg, "H_kv": H_kv, "Sq": S,
                         "Sk": S, "D": Dg, "dtype": "float16", "causal": causal, "ms": ms,
                         "tflops": roofline.tflops(flops, ms)})
        del q, dout, runs
        torch.cuda.empty_cache()
    return rows


def window_backward_rows(quick: bool) -> list[dict]:
    """Autograd's backward of phase5_fused_bwd_tc, causal, with each window of WINDOW (S / 4 when
    quick), and of sdpa_efficient with the same window as a boolean mask; without a window both
    causal, and sdpa_flash beside them. speedup_vs_full: the same impl's time without a window over
    this row's."""
    from utils import roofline
    from utils.bench import time_cuda
    from utils.peers import sdpa

    Bw, Hw, Dw = WINDOW["B"], WINDOW["H"], WINDOW["D"]
    S = WINDOW["S"] // 4 if quick else WINDOW["S"]
    gen = torch.Generator(device="cuda").manual_seed(23)
    q, k, v, dout = (torch.randn(Bw, Hw, S, Dw, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    i, j = torch.arange(S, device="cuda").view(-1, 1), torch.arange(S, device="cuda").view(1, -1)
    efficient = sdpa("sdpa_efficient")
    rows, full_ms = [], {}
    for window in sorted(WINDOW["windows"], key=lambda w: w is not None):  # None first: the bases
        impls = {"phase5_fused_bwd_tc": lambda q_, k_, v_, c_, w=window: tensor_cores.attention(
            q_, k_, v_, is_causal=c_, window=w)}
        if window is None:
            impls["sdpa_flash"] = forward_fn("sdpa_flash")
            impls["sdpa_efficient"] = forward_fn("sdpa_efficient")
        else:
            keep = (j <= i) & (j > i - window)
            impls["sdpa_efficient"] = lambda q_, k_, v_, c_, m=keep: efficient(q_, k_, v_, mask=m)
        for impl, forward in impls.items():
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            grad, _ = first_call(f"{impl} (window={window})", forward, leaves, dout, True)
            if grad is None:
                continue
            ms = time_cuda(grad, warmup=3, reps=20, max_seconds=2.0)
            flops = BACKWARD_FLOP_FACTOR * roofline.attention_flops(Bw, Hw, S, S, Dw, True, window=window)
            row = {"impl": impl, "op": "attention_backward_window", "B": Bw, "H": Hw, "Sq": S, "Sk": S, "D": Dw,
                   "dtype": "float16", "causal": True, "window": "none" if window is None else window, "ms": ms,
                   "tflops": roofline.tflops(flops, ms)}
            if window is None:
                full_ms[impl] = ms
            if impl in full_ms:
                row["speedup_vs_full"] = full_ms[impl] / ms
            print(f"    {impl:<26} window={row['window']!s:<5} {ms:8.3f} ms", flush=True)
            rows.append(row)
            del leaves, grad
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------
# Nsight Compute


def profiled_calls() -> list:
    """PROFILE_CALLS that this GPU can run (the Hopper kernel's on sm_90 only)."""
    return [c for c in PROFILE_CALLS if on_hopper() or c[0] != "phase5_fused_bwd_hopper"]


def profile_target(names: str) -> None:
    """One backward of each (impl, D) of PROFILE_CALLS at NCU_S, non-causal (names "all" or a
    comma-separated list of impls): what ncu measures. The forward runs first, outside ncu's regex."""
    forwards = {impl: fwd for impl, _, fwd in IMPLS}
    dtypes = {impl: dtype for impl, dtype, _ in IMPLS}
    for impl, D in profiled_calls():
        if names == "all" or impl in names.split(","):
            if impl in PROFILE_VARIANTS:
                leaves, dout = make_inputs(NCU_S, D, torch.float16, seed=D)
                backward_call(None, leaves, dout, False, PROFILE_VARIANTS[impl])()
            else:
                leaves, dout = make_inputs(NCU_S, D, dtypes[impl], seed=D)
                out = forward_fn(forwards[impl])(*leaves, False)
                torch.autograd.grad(out, leaves, dout)
            torch.cuda.synchronize()


def run_ncu() -> dict:
    """ncu records of the backward's main kernel named impl_D<D> ({"phase5_fused_bwd_tc_v1_D64": {...},
    ...}), or why ncu did not run."""
    from utils.ncu import NcuUnavailable, profile_python

    try:
        calls = profiled_calls()
        records = profile_python(["phase5_fused.backward.run", "--profile-target", "all"], NCU_REGEX,
                                 launch_count=len(calls), timeout=480, stalls=True)
    except NcuUnavailable as exc:
        print(f"ncu unavailable: {exc}", flush=True)
        return {"ncu_unavailable": str(exc)}
    labelled = {}
    for (impl, D), record in zip(calls, records):  # records come back in launch order
        if not re.search(MAIN_KERNEL[impl], record["kernel"]):
            reason = f"{impl} at D={D} was matched with {record['kernel'][:80]}: a kernel name is missing from NCU_REGEX"
            print(f"ncu: {reason}", flush=True)
            return {"ncu_unavailable": reason}
        labelled[f"{impl}_D{D}"] = record
    print(f"ncu: {len(records)} kernels profiled ({', '.join(labelled)})", flush=True)
    return {"shape": {"B": B, "H": H, "S": NCU_S, "causal": False}, "kernels": labelled}


def measure(args) -> Path:
    from utils.results import write_results
    from utils.roofline import get_ceilings

    ceilings = {k: v for k, v in get_ceilings().items() if k != "env"}
    rows = (benchmark(QUICK_SEQ_LENS if args.quick else SEQ_LENS) + head_dim_backward_rows(args.quick)
            + gqa_backward_rows(args.quick) + window_backward_rows(args.quick))
    ncu = {"skipped": "--no-ncu"} if args.no_ncu else run_ncu()
    return write_results(results_dir(HERE, args.quick) / "metrics.json", rows, ceilings, ncu=ncu)


def main(argv=None) -> int:
    return lesson_main(argv, HERE, "Phase 5 attention backward benchmark, then its tables", measure, profile_target)


if __name__ == "__main__":
    sys.exit(main())
