"""`python -m phase6_layernorm_mlp.run [--quick]`: phase 6's kernels beside PyTorch, on the GPU.

- LayerNorm and add + LayerNorm (FP32, BF16) at rows 16384 / 65536 x hidden 512 / 1024 / 4096,
  beside F.layer_norm (torch_layer_norm), each timed after a read-only L2 flush (LN_FLUSH); the
  FP32 ones also after the zeroing flush the other phases use (ms_write_flush, frac_copy_write_flush).
- GELU (tanh) at 8192 x 2048 FP32 beside F.gelu.
- The MLP at 8192 tokens, 512 -> 2048 -> 512, FP32, beside torch eager (torch_mlp, TF32 off) and
  torch.compile (torch_mlp_compiled); each GEMM beside cuBLAS SGEMM, with its error against float64;
  then every GEMM variant (p6.LINEAR_TILES: ops linear1_variant, linear2_variant, mlp_variant); the
  two GEMMs at 1 to 512 rows (a decode step's shapes), the few-rows kernel and the tiled ones beside
  cuBLAS.
- The backward: LayerNorm backward (dx, dgamma, dbeta; FP32, BF16) at rows 16384 / 65536 x hidden
  512 / 1024 / 4096 beside torch's (aten native_layer_norm_backward with the mean and rstd its
  forward saved), GB/s from layer_norm_backward_bytes; GELU backward (tanh) beside aten's; the MLP's
  forward + backward (autograd) beside torch eager's.
- ncu on one call of each kernel at the headline shapes (a `--profile-target all` run of this file):
  the MLP on the default GEMM and on the FFMA SGEMM (LINEAR_SGEMM), and cuBLAS's linear1.
Writes results/metrics.json, then renders the README tables and the plots that manifest.json
declares (utils.render); without a GPU it only renders, from the committed results. --quick: fewer
shapes, no torch.compile, no ncu, written to results/quick/ (not rendered); --no-ncu: skip ncu.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import phase6_layernorm_mlp as p6
from utils import reference, roofline
from utils.bench import sweep, time_cuda
from utils.ncu import profile_python, summarize
from utils.peers import no_tf32
from utils.kernel_bench import lesson_main, results_dir
from utils.results import write_results
from utils.testing import randn, rel_error

HERE = Path(__file__).resolve().parent
MODULE = "phase6_layernorm_mlp.run"

LN_ROWS = (16384, 65536)
LN_HIDDEN = (512, 1024, 4096)
LN_DTYPES = (torch.float32, torch.bfloat16)
HEADLINE_LN = {"rows": 65536, "hidden": 1024}
MLP_SHAPE = {"tokens": 8192, "hidden": 512, "inner": 2048}
REF_ROWS = 2048  # rows checked against the float64 reference (rows are independent)
NCU_REGEX = "layer_norm|linear_kernel|linear_async_kernel|linear_tf32x3_kernel|gemm"
# The L2 flush before each timed LayerNorm. The zeroing flush ("write", utils.bench's default) leaves
# about 50 MB of dirty lines that the timed kernel writes back to DRAM: up to 20 µs charged to a
# kernel of 20-200 µs that did not cause them. "read" evicts the same way and leaves clean lines.
LN_FLUSH = "read"


def measured(fields: dict, fn, flops=None, nbytes=None, ref=None, flush="write") -> dict:
    """One results row: `fields`, the median time of fn() and the rates and error that follow."""
    ms = time_cuda(fn, flush=flush)
    row = {**fields, "ms": ms}
    if flops is not None:
        row["tflops"] = roofline.tflops(flops, ms)
    if nbytes is not None:
        row["gbps"] = roofline.gbps(nbytes, ms)
    if ref is not None:
        out = fn()
        row["rel_err"] = rel_error((out[0] if isinstance(out, tuple) else out)[:REF_ROWS], ref)
    return row


# ------------------------------------------------------------------------------------------------
# LayerNorm and GELU


def torch_add_layer_norm(x, r, w, b):
    s = x + r
    return F.layer_norm(s, (x.shape[-1],), w, b), s


def bench_layer_norm(ceilings: dict, quick: bool) -> list[dict]:
    configs = [{"rows": r, "hidden": h, "dtype": d} for d in LN_DTYPES for r in LN_ROWS for h in LN_HIDDEN]
    if quick:
        configs = [c for c in configs if c["rows"] == LN_ROWS[0] and c["dtype"] == torch.float32]

    def run_one(c):
        rows, hidden, dtype = c["rows"], c["hidden"], c["dtype"]
        x, r = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
        w, b = randn(hidden, dtype=dtype), randn(hidden, dtype=dtype)
        impls = {
            ("layer_norm", "phase6_layer_norm"): lambda: p6.layer_norm(x, w, b),
            ("layer_norm", "torch_layer_norm"): lambda: F.layer_norm(x, (hidden,), w, b),
            ("add_layer_norm", "phase6_add_layer_norm"): lambda: p6.add_layer_norm(x, r, w, b),
            ("add_layer_norm", "torch_layer_norm"): lambda: torch_add_layer_norm(x, r, w, b),
        }
        refs = {"layer_norm": reference.layer_norm(x[:REF_ROWS], w, b),
                "add_layer_norm": reference.layer_norm(x[:REF_ROWS], w, b, residual=r[:REF_ROWS])}
        out = []
        for (op, impl), fn in impls.items():
            nbytes = roofline.layer_norm_bytes(rows, hidden, x.element_size(), residual=op == "add_layer_norm")
            fields = {"impl": impl, "op": op, "rows": rows, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
                      "flush": LN_FLUSH}
            row = measured(fields, fn, roofline.layer_norm_flops(rows, hidden), nbytes, refs[op], flush=LN_FLUSH)
            if dtype == torch.float32:   # the same call after the zeroing flush, as a share of copy
                row["ms_write_flush"] = time_cuda(fn, flush="write")
                row["frac_copy_write_flush"] = roofline.gbps(nbytes, row["ms_write_flush"]) / (ceilings["dram_TBps"] * 1e3)
            out.append(row)
        del x, r
        torch.cuda.empty_cache()
        return out

    return sweep(configs, run_one, desc="layer_norm")


def bench_gelu() -> list[dict]:
    x = randn(MLP_SHAPE["tokens"], MLP_SHAPE["inner"])
    ref = reference.gelu(x[:REF_ROWS], "tanh")
    fields = {"op": "gelu", "rows": x.shape[0], "hidden": x.shape[1], "dtype": "float32"}
    return [measured({"impl": impl, **fields}, fn, nbytes=2.0 * x.numel() * x.element_size(), ref=ref)
            for impl, fn in (("phase6_gelu", lambda: p6.gelu(x, "tanh")),
                             ("torch_gelu", lambda: F.gelu(x, approximate="tanh")))]


# ------------------------------------------------------------------------------------------------
# Backward


def layer_norm_backward_bytes(rows, hidden, elem_bytes=4) -> float:
    """The minimum traffic of a LayerNorm backward: read x (the LayerNorm's input) and dy, write dx,
    one row each; read gamma, write dgamma and dbeta once. Our kernel also writes and reads its
    FP32 column partial sums (2 x teams x hidden x 4 bytes, a few % here: README); torch's reads the
    mean and rstd its forward saved (8 bytes per row). Neither extra is counted."""
    return float(elem_bytes) * (3 * rows * hidden + 3 * hidden)


def bench_layer_norm_backward(ceilings: dict, quick: bool) -> list[dict]:
    configs = [{"rows": r, "hidden": h, "dtype": d} for d in LN_DTYPES for r in LN_ROWS for h in LN_HIDDEN]
    if quick:
        configs = [c for c in configs if c["rows"] == LN_ROWS[0] and c["dtype"] == torch.float32]

    def run_one(c):
        rows, hidden, dtype = c["rows"], c["hidden"], c["dtype"]
        x, dy = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
        w, b = randn(hidden, dtype=dtype), randn(hidden, dtype=dtype)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [hidden], w, b, 1e-5)
        x64 = x[:REF_ROWS].double().requires_grad_()
        reference.layer_norm(x64, w).backward(dy[:REF_ROWS].double())
        impls = {"phase6_layer_norm": lambda: p6.layer_norm_backward(dy, x, w),
                 "torch_layer_norm": lambda: torch.ops.aten.native_layer_norm_backward(
                     dy, x, [hidden], mean, rstd, w, b, [True, True, True])}
        fields = {"op": "layer_norm_backward", "rows": rows, "hidden": hidden,
                  "dtype": str(dtype).removeprefix("torch."), "flush": LN_FLUSH}
        nbytes = layer_norm_backward_bytes(rows, hidden, x.element_size())
        out = [measured({"impl": impl, **fields}, fn, None, nbytes, x64.grad, flush=LN_FLUSH)
               for impl, fn in impls.items()]
        del x, dy
        torch.cuda.empty_cache()
        return out

    return sweep(configs, run_one, desc="layer_norm_backward")


def bench_gelu_backward() -> list[dict]:
    x, dy = randn(MLP_SHAPE["tokens"], MLP_SHAPE["inner"]), randn(MLP_SHAPE["tokens"], MLP_SHAPE["inner"])
    x64 = x[:REF_ROWS].double().requires_grad_()
    reference.gelu(x64, "tanh").backward(dy[:REF_ROWS].double())
    fields = {"op": "gelu_backward", "rows": x.shape[0], "hidden": x.shape[1], "dtype": "float32"}
    return [measured({"impl": impl, **fields}, fn, nbytes=3.0 * x.numel() * x.element_size(), ref=x64.grad)
            for impl, fn in (("phase6_gelu", lambda: p6.gelu_backward(dy, x, "tanh")),
                             ("torch_gelu", lambda: torch.ops.aten.gelu_backward(dy, x, approximate="tanh")))]


def bench_mlp_backward(quick: bool) -> list[dict]:
    """The MLP's forward + backward through autograd (every input and weight requires grad), ours
    beside torch eager's: dX on phase 6's GEMM, dW on cuBLAS (README: Backward)."""
    shape = {**MLP_SHAPE, "tokens": MLP_SHAPE["tokens"] // (4 if quick else 1)}
    inputs = [t.requires_grad_() for t in mlp_inputs(**shape)]
    dout = randn(shape["tokens"], shape["hidden"])

    def step(fn):
        def run():
            for t in inputs:
                t.grad = None
            fn(*inputs).backward(dout)
        return run

    # forward 2 GEMMs + backward 4 GEMMs (dX and dW of each): 3 x the forward's FLOPs
    flops = 3 * roofline.mlp_flops(shape["tokens"], shape["hidden"], shape["inner"])
    with no_tf32():
        return [measured({"impl": impl, "op": "mlp_fwd_bwd", **shape, "dtype": "float32"}, step(fn), flops)
                for impl, fn in (("phase6_mlp", p6.mlp), ("torch_mlp", torch_mlp))]


# ------------------------------------------------------------------------------------------------
# MLP and its GEMMs


def mlp_inputs(tokens, hidden, inner):
    x, res = randn(tokens, hidden), randn(tokens, hidden)
    w1, b1 = randn(inner, hidden, scale=hidden ** -0.5), randn(inner, scale=0.1)
    w2, b2 = randn(hidden, inner, scale=inner ** -0.5), randn(hidden, scale=0.1)
    return x, w1, b1, w2, b2, res


def torch_mlp(x, w1, b1, w2, b2, res):
    """The eager Transformer MLP: cuBLAS GEMM (+ bias), GELU kernel, cuBLAS GEMM (+ bias), add."""
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2) + res


def bench_mlp(quick: bool, notes: list[str]) -> list[dict]:
    """The MLP beside torch eager and torch.compile, each GEMM beside cuBLAS, then every variant."""
    shape = {**MLP_SHAPE, "tokens": MLP_SHAPE["tokens"] // (4 if quick else 1)}
    x, w1, b1, w2, b2, res = inputs = mlp_inputs(**shape)
    ref = reference.mlp(x[:REF_ROWS], w1, b1, w2, b2, res[:REF_ROWS], "tanh")
    flops = roofline.mlp_flops(shape["tokens"], shape["hidden"], shape["inner"])
    nbytes = roofline.mlp_bytes(shape["tokens"], shape["hidden"], shape["inner"])
    impls = {"phase6_mlp": lambda: p6.mlp(*inputs), "torch_mlp": lambda: torch_mlp(*inputs)}
    if not quick:
        try:
            with no_tf32():
                compiled = torch.compile(torch_mlp)
                compiled(*inputs)
                torch.cuda.synchronize()
            impls["torch_mlp_compiled"] = lambda: compiled(*inputs)
        except Exception as exc:  # noqa: BLE001 - any compile failure is a note, not a failure
            notes.append(f"torch_mlp_compiled skipped: torch.compile failed: {str(exc).splitlines()[0][:200]}")
            print(f"    {notes[-1]}", flush=True)
    with no_tf32():
        rows = [measured({"impl": impl, "op": "mlp", **shape, "dtype": "float32"}, fn, flops, nbytes, ref)
                for impl, fn in impls.items()]
        # Each GEMM on its own: ours with its fused epilogue, cuBLAS SGEMM without one; each checked
        # on its first REF_ROWS rows against the float64 product (with, and without, the epilogue).
        h = p6.linear(x, w1, b1, "gelu_tanh")
        product1, product2 = x[:REF_ROWS].double() @ w1.double().t(), h[:REF_ROWS].double() @ w2.double().t()
        gemms = {"linear1": ((x.shape[0], w1.shape[0], x.shape[1]), "bias+gelu",
                             lambda v=None: p6.linear(x, w1, b1, "gelu_tanh", variant=v), lambda: x @ w1.t(),
                             reference.gelu(product1 + b1.double(), "tanh"), product1),
                 "linear2": ((h.shape[0], w2.shape[0], h.shape[1]), "bias+residual",
                             lambda v=None: p6.linear(h, w2, b2, residual=res, variant=v), lambda: h @ w2.t(),
                             product2 + b2.double() + res[:REF_ROWS].double(), product2)}
        cublas = {}
        for op, ((M, N, K), epilogue, ours, peer, ref_ours, ref_peer) in gemms.items():
            fields = {"op": op, "M": M, "N": N, "K": K, "dtype": "float32"}
            gemm_flops, gemm_bytes = roofline.matmul_flops(M, N, K), roofline.matmul_bytes(M, N, K)
            cublas[op] = measured({"impl": "cublas", **fields, "epilogue": "none"}, peer, gemm_flops, gemm_bytes,
                                  ref_peer)
            rows += [measured({"impl": "phase6_linear", **fields, "epilogue": epilogue, "variant": p6.LINEAR_DEFAULT},
                              ours, gemm_flops, gemm_bytes, ref_ours),
                     cublas[op]]
        eager_ms = next(r["ms"] for r in rows if r["impl"] == "torch_mlp")
        for variant, tile in enumerate(p6.LINEAR_TILES):
            for op, ((M, N, K), _, ours, _, ref_ours, _) in gemms.items():
                row = measured({"impl": "phase6_linear", "op": f"{op}_variant", "variant": variant, "tile": tile,
                                "M": M, "N": N, "K": K, "dtype": "float32"},
                               lambda: ours(variant), roofline.matmul_flops(M, N, K), ref=ref_ours)
                rows.append({**row, "frac_cublas": row["tflops"] / cublas[op]["tflops"]})
            row = measured({"impl": "phase6_mlp", "op": "mlp_variant", "variant": variant, "tile": tile, **shape,
                            "dtype": "float32"}, lambda: p6.mlp(*inputs, variant=variant), flops, ref=ref)
            rows.append({**row, "speedup_vs_torch_eager": eager_ms / row["ms"]})
    for r in rows:
        print(f"    {r['impl']:<20} {r['op']:<16} {r.get('variant', ''):>2} {r['ms']:.3f} ms", flush=True)
    return rows


# The MLP's two GEMMs with few rows (a decode step's tokens): where the few-rows kernel overtakes
# the tiled GEMMs (p6.LINEAR_ROWS_UP_TO comes from this sweep), beside cuBLAS through F.linear
# (bias included, as the model's other linears call it). Timed after the read-only flush: the
# weight comes from DRAM, and no dirty lines are charged to a kernel of a few microseconds.
FEW_ROWS_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FEW_ROWS_IMPLS = {"phase6_rows": p6.LINEAR_ROWS, "phase6_tiled": p6.LINEAR_SGEMM, "phase6_tf32x3": p6.LINEAR_TF32X3}


def bench_few_rows(quick: bool) -> list[dict]:
    hidden, inner = MLP_SHAPE["hidden"], MLP_SHAPE["inner"]
    w1, b1 = randn(inner, hidden, scale=hidden ** -0.5), randn(inner, scale=0.1)
    w2, b2 = randn(hidden, inner, scale=inner ** -0.5), randn(hidden, scale=0.1)
    rows = []
    for M in FEW_ROWS_M[:4] if quick else FEW_ROWS_M:
        x, res = randn(M, hidden), randn(M, hidden)
        h = randn(M, inner)
        gemms = {"linear1": ((M, inner, hidden), lambda v: p6.linear(x, w1, b1, "gelu_tanh", variant=v),
                             lambda: F.linear(x, w1, b1)),
                 "linear2": ((M, hidden, inner), lambda v: p6.linear(h, w2, b2, residual=res, variant=v),
                             lambda: F.linear(h, w2, b2))}
        with no_tf32():
            for op, ((m, n, k), ours, peer) in gemms.items():
                fields = {"op": f"few_rows_{op}", "M": m, "N": n, "K": k, "dtype": "float32"}
                args = (roofline.matmul_flops(m, n, k), roofline.matmul_bytes(m, n, k))
                rows.append(measured({"impl": "cublas_linear", **fields}, peer, *args, flush=LN_FLUSH))
                for impl, variant in FEW_ROWS_IMPLS.items():
                    rows.append(measured({"impl": impl, **fields, "variant": variant}, lambda: ours(variant), *args,
                                         flush=LN_FLUSH))
    for r in rows:
        print(f"    {r['impl']:<14} {r['op']:<18} M={r['M']:<4} {r['ms'] * 1e3:8.1f} us", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------
# ncu


def profile_target() -> None:
    """One call of each profiled kernel at the headline shapes (run under ncu)."""
    rows, hidden = HEADLINE_LN["rows"], HEADLINE_LN["hidden"]
    x, w, b = randn(rows, hidden), randn(hidden), randn(hidden)
    p6.layer_norm(x, w, b)
    F.layer_norm(x, (hidden,), w, b)
    mx, w1, b1, w2, b2, res = mlp_inputs(**MLP_SHAPE)
    p6.mlp(mx, w1, b1, w2, b2, res)
    p6.mlp(mx, w1, b1, w2, b2, res, variant=p6.LINEAR_SGEMM)
    with no_tf32():
        torch.matmul(mx, w1.t())
    torch.cuda.synchronize()


def ncu_labels(kernel: str, seen: list[dict]) -> dict:
    """Which impl and op a profiled kernel belongs to (profile_target's launch order; `seen`, the
    kernels labelled before it): the default GEMM (phase6_linear) and the FFMA SGEMM (phase6_sgemm)
    each launch linear1, then linear2."""
    for impl, names in (("phase6_linear", ("linear_tf32x3_kernel",)),
                        ("phase6_sgemm", ("linear_kernel", "linear_async_kernel"))):
        if any(name in kernel for name in names):
            return {"impl": impl, "op": "linear1" if sum(x["impl"] == impl for x in seen) == 0 else "linear2"}
    if "layer_norm_cached" in kernel or "layer_norm_streaming" in kernel:
        return {"impl": "phase6_layer_norm", "op": "layer_norm"}
    if "layer_norm" in kernel.lower():
        return {"impl": "torch_layer_norm", "op": "layer_norm"}
    return {"impl": "cublas", "op": "linear1"}


def run_ncu(notes: list[str]) -> list[dict]:
    try:
        records = profile_python([MODULE, "--profile-target", "all"], kernel_regex=NCU_REGEX, launch_count=8,
                                 stalls=True)
    except Exception as exc:  # noqa: BLE001 - ncu missing, not allowed, or timed out: note it and go on
        notes.append(f"ncu did not run: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        print(notes[-1], flush=True)
        return []
    labelled: list[dict] = []
    for r in records:
        labelled.append({**ncu_labels(r["kernel"], labelled), **r})
    print(summarize(labelled), flush=True)
    return labelled


def measure(quick: bool, no_ncu: bool = False) -> Path:
    p6.load()
    ceilings = roofline.get_ceilings()
    notes: list[str] = ["--quick run: fewer shapes, no torch.compile, no ncu"] if quick else []
    rows = bench_layer_norm(ceilings, quick) + bench_gelu() + bench_mlp(quick, notes) + bench_few_rows(quick)
    rows += bench_layer_norm_backward(ceilings, quick) + bench_gelu_backward() + bench_mlp_backward(quick)
    records = [] if quick or no_ncu else run_ncu(notes)
    return write_results(results_dir(HERE, quick) / "metrics.json", rows, ceilings, ncu=records, notes=notes,
                         linear_default=p6.LINEAR_DEFAULT, linear_rows_up_to=p6.LINEAR_ROWS_UP_TO)


def main(argv=None) -> int:
    return lesson_main(argv, HERE, __doc__.split("\n\n")[0], lambda args: measure(args.quick, args.no_ncu),
                       lambda names: profile_target())

if __name__ == "__main__":
    sys.exit(main())
