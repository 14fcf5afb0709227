"""End-to-end benchmark: the phase 1 GPT in PyTorch against the OptimizedTransformer.

`python -m final.benchmark [--quick | --full]` on a GPU measures, for every (batch, seq) of the grid
and every implementation, with the same weights (phase1 build_model(0)) and the same tokens:
forward time (CUDA events, warm-up, L2 flush, median: utils.bench.time_cuda), tokens/s, model TFLOP/s
(model_flops's formula), the peak memory a forward allocates beyond the weights and inputs
(utils.bench.peak_extra_mb), and the logits' relative error against torch_eager's FP32 logits
(a broken kernel must not look fast). Then, at the profile shape (batch 8, seq 1024), torch.profiler
splits each eager implementation's GPU time into attention, layer_norm, mlp and other from the
models' named ranges (as phase1_baseline/profile_pytorch.py does), and three more figures join that
shape's rows, for the models whose single call is bound by the CPU's launches more than by the GPU:
    ms          wall time of one call after an L2 flush (every shape; CPU launches included)
    gpu_ms      the GPU time of the call's kernels (torch.profiler, the profile's total)
    b2b_ms      time per call of calls launched back to back (the CPU queues ahead where it can)
    graph_ms    one call replayed from a CUDA graph, after an L2 flush (no CPU launch cost)
Writes final/results/metrics.json (utils.results; op "model" rows with B and S, DESIGN.md's schema),
then runs final.api_overhead (the attention API's per-call cost, final/results/api_overhead.json) and
draws final/README.md's tables and final/results' plots (utils.render).

Implementations (IMPLS; one impl name per model and precision, the dtype field says it too):
    torch_eager            FP32, explicit-math attention (phase 1's "math")
    torch_sdpa             FP32, torch SDPA attention
    torch_sdpa_compiled    FP32, torch SDPA model under torch.compile(dynamic=True): one compile serves
                           every shape (plus one for batch 1, which dynamo specializes); a compile
                           failure is caught, noted in "notes", and the impl left out
    optimized              FP32 OptimizedTransformer (phase 5 fused attention, phase 6 LN + MLP)
    torch_sdpa_fp16        FP16, torch SDPA attention: optimized_fp16's peer
    optimized_fp16         FP16 OptimizedTransformer (phase 5 tensor-core attention, phase 6 LN)
    optimized_cublas_mlp   FP32 OptimizedTransformer with mlp="cublas", at the profile shape only
                           (does phase 6's MLP cost or gain at the model level?)

Grid: seq 128, 256, 512, 1024, 2048, 4096 x batch 1, 8, 32, limited to B * S <= 32768 tokens so
a full run stays under about 4 minutes on an H100 (batch 32 stops at seq 1024, the rest of the grid
is complete); --full drops that limit (batch 32 up to seq 4096, where torch_eager's S x S scores
need tens of GB), --quick runs seq 128 and 1024 at batch 1 and 8. An implementation that runs out
of memory at a shape is noted and skipped there.
The target (at batch 8, seq 1024 the OptimizedTransformer at least as fast as PyTorch with SDPA, FP32
and FP16) is a `targets` table of final/manifest.json, one line per figure it judges.
Without a GPU nothing is measured: it says so and redraws the tables and plots from the committed results.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
METRICS_PATH = RESULTS / "metrics.json"

SEQ_LENS = (128, 256, 512, 1024, 2048, 4096)
BATCHES = (1, 8, 32)
MAX_TOKENS = 32768  # B * S limit of the default grid (time budget); --full lifts it
QUICK = {"seq_lens": (128, 1024), "batches": (1, 8)}
PROFILE_SHAPE = {"B": 8, "S": 1024}
DEVICE = "cuda"  # (a test runs the pipeline on CPU with fake timing)
RANGES = ("attention", "layer_norm", "mlp")
COMPONENTS = (*RANGES, "other")

# impl -> (dtype, what it is); the order is the order of measurement and of the summary.
IMPLS = {
    "torch_eager": ("float32", "phase 1 GPT, explicit-math attention"),
    "torch_sdpa": ("float32", "phase 1 GPT, torch SDPA attention"),
    "torch_sdpa_compiled": ("float32", "phase 1 GPT, torch SDPA, torch.compile(dynamic=True)"),
    "optimized": ("float32", "OptimizedTransformer: phase 5 fused attention, phase 6 LayerNorm + MLP"),
    "torch_sdpa_fp16": ("float16", "phase 1 GPT in FP16, torch SDPA attention"),
    "optimized_fp16": ("float16", "OptimizedTransformer FP16: phase 5 tensor-core attention, phase 6 LayerNorm"),
}
PROFILE_ONLY_IMPLS = {
    "optimized_cublas_mlp": ("float32", "OptimizedTransformer FP32 with mlp='cublas'"),
}
# Not captured in a CUDA graph: the compiled model (torch.compile has its own graph mode).
NO_GRAPH = ("torch_sdpa_compiled",)


def grid(seq_lens=SEQ_LENS, batches=BATCHES, max_tokens: int | None = MAX_TOKENS) -> list[dict]:
    """The (B, S) configurations measured, batch-major."""
    return [{"B": b, "S": s} for b in batches for s in seq_lens if max_tokens is None or b * s <= max_tokens]


def model_flops(B: int, S: int, config=None) -> float:
    """FLOPs of one forward: 2 per multiply-add of every GEMM (qkv, proj, MLP, lm_head) and causal
    attention 4 * B * H * S * S * D / 2 (QK^T and PV, the half above the diagonal not counted).
    Elementwise work (LayerNorm, GELU, softmax) is left out."""
    from phase1_baseline.pytorch_transformer import GPTConfig

    c = config or GPTConfig()
    tokens, C = B * S, c.hidden
    per_layer = 2 * tokens * (3 * C * C + C * C + 2 * c.mlp_ratio * C * C) + 2 * B * c.n_head * S * S * c.head_dim
    return float(c.n_layer * per_layer + 2 * tokens * C * c.vocab_size)


# ------------------------------------------------------------------------------------------------
# Models


class Models:
    """Builds each implementation once, on first use (same weights: build_model(0))."""

    def __init__(self, notes: list[str]):
        self.notes = notes
        self._models: dict[str, torch.nn.Module | None] = {}
        self.compile_s: float | None = None

    def get(self, impl: str):
        if impl not in self._models:
            self._models[impl] = self._build(impl)
        return self._models[impl]

    def _build(self, impl: str):
        from final.optimized_transformer import OptimizedTransformer
        from phase1_baseline.pytorch_transformer import build_model

        if impl == "torch_eager":
            return build_model(0, DEVICE, attention="math")
        if impl == "torch_sdpa":
            return build_model(0, DEVICE, attention="sdpa")
        if impl == "torch_sdpa_fp16":
            return build_model(0, DEVICE, attention="sdpa").half()
        if impl == "torch_sdpa_compiled":
            return torch.compile(build_model(0, DEVICE, attention="sdpa"), dynamic=True)
        base = build_model(0, DEVICE)
        if impl == "optimized":
            return OptimizedTransformer.from_baseline(base)
        if impl == "optimized_fp16":
            return OptimizedTransformer.from_baseline(base, dtype=torch.float16)
        if impl == "optimized_cublas_mlp":
            return OptimizedTransformer.from_baseline(base, mlp="cublas")
        raise KeyError(impl)

    def drop(self, impl: str, why: str) -> None:
        self._models[impl] = None
        self.notes.append(f"{impl} left out: {why}")
        print(f"{impl} left out: {why}", flush=True)


def _first_call(models: Models, impl: str, idx):
    """The first forward of an impl at a shape (torch.compile compiles here); None if it fails."""
    model = models.get(impl)
    if model is None:
        return None
    if impl != "torch_sdpa_compiled":
        return model(idx)
    start = time.perf_counter()
    try:
        out = model(idx)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # a compile failure is a result to report, not a crash
        traceback.print_exc()
        models.drop(impl, f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        return None
    spent = time.perf_counter() - start
    models.compile_s = (models.compile_s or 0.0) + spent
    print(f"torch_sdpa_compiled first call at B={idx.shape[0]} S={idx.shape[1]}: {spent:.1f} s", flush=True)
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, on the device (utils.testing.rel_error's formula)."""
    out64, ref64 = out.double(), ref.double()
    return (torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64)).item()


def _reference_logits(models: Models, idx):
    """The FP32 logits every impl is compared with: torch_eager's, or torch_sdpa's where the eager
    model runs out of memory."""
    for impl in ("torch_eager", "torch_sdpa"):
        try:
            return models.get(impl)(idx).float(), impl
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    return None, None


def measure(impls, configs, models: Models, notes: list[str]) -> list[dict]:
    from phase1_baseline.pytorch_transformer import synthetic_batch
    from utils.bench import peak_extra_mb, time_cuda

    rows = []
    start = time.perf_counter()
    for n, c in enumerate(configs, 1):
        B, S = c["B"], c["S"]
        idx = synthetic_batch(B, S, device=DEVICE)
        ref, ref_impl = _reference_logits(models, idx)
        for impl in impls:
            dtype = {**IMPLS, **PROFILE_ONLY_IMPLS}[impl][0]
            try:
                logits = _first_call(models, impl, idx)
                if logits is None:
                    continue
                model = models.get(impl)
                err = rel_error(logits, ref) if ref is not None and impl != ref_impl else None
                del logits
                ms = time_cuda(lambda: model(idx), warmup=3, reps=10, max_seconds=2.0, gpu_only=False)  # wall time
                extra = peak_extra_mb(lambda: model(idx))
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                notes.append(f"{impl} B={B} S={S}: out of memory, skipped")
                print(f"  {impl} B={B} S={S}: out of memory, skipped", flush=True)
                continue
            rows.append({"impl": impl, "op": "model", "B": B, "S": S, "dtype": dtype, "ms": ms,
                         "tokens_per_s": B * S / (ms * 1e-3), "tflops": model_flops(B, S) / (ms * 1e9),
                         "extra_mb": extra, "rel_err": err, "rel_err_vs": ref_impl if err is not None else None})
            err_text = "" if err is None else f", logits rel err {err:.1e} vs {ref_impl}"
            print(f"  {impl:22s} B={B:<3d} S={S:<5d} {ms:9.3f} ms {B * S / (ms * 1e-3):12,.0f} tok/s "
                  f"{extra:9.1f} MB{err_text}", flush=True)
        del ref
        torch.cuda.empty_cache()
        print(f"[model {n}/{len(configs)}] B={B} S={S} ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------
# Profile


def profile_components(model, idx) -> dict:
    """GPU time of one forward split by the models' profiler ranges: attention, layer_norm, mlp, and
    other (the rest: embeddings, qkv / proj / lm_head GEMMs, head split and merge copies)."""
    from torch.autograd import DeviceType

    from utils.bench import profile_ranges

    prof, total, us = profile_ranges(lambda: model(idx), RANGES)
    us["other"] = total - sum(us.values())
    top = sorted((e for e in prof.key_averages() if e.device_type != DeviceType.CPU and e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)[:10]
    return {"total_gpu_us": total, "us": us, "share": {k: (v / total if total else None) for k, v in us.items()},
            "top_kernels": [{"kernel": e.key[:120], "gpu_us": e.self_device_time_total, "calls": e.count}
                            for e in top]}


def profile_all(impls, models: Models, notes: list[str]) -> dict:
    from phase1_baseline.pytorch_transformer import synthetic_batch

    B, S = PROFILE_SHAPE["B"], PROFILE_SHAPE["S"]
    idx = synthetic_batch(B, S, device=DEVICE)
    out = {"shape": PROFILE_SHAPE, "by_impl": {}}
    for impl in impls:
        model = models.get(impl)
        if model is None:
            continue
        try:
            prof = profile_components(model, idx)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            notes.append(f"profile of {impl}: out of memory")
            continue
        if prof["us"]["other"] < -0.01 * prof["total_gpu_us"]:
            notes.append(f"profile of {impl}: the named ranges add up to more than the total GPU time "
                         f"(overlapping ranges?); 'other' is negative")
        out["by_impl"][impl] = prof
        shares = ", ".join(f"{k} {v:.0%}" for k, v in prof["share"].items() if v is not None)
        print(f"profile {impl} (B={B}, S={S}): {prof['total_gpu_us'] / 1e3:.2f} ms of kernels; {shares}", flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# Launch-bound figures: what one call costs the GPU, apart from the CPU's launches


def back_to_back_ms(fn, calls: int = 20) -> float:
    """Milliseconds per call of `calls` calls launched back to back (no flush, no sync between): the
    GPU's time per call where the CPU launches faster than the GPU runs, the CPU's otherwise."""
    from utils.bench import timed_call

    fn()
    torch.cuda.synchronize()

    def back_to_back():
        for _ in range(calls):
            fn()

    return timed_call(back_to_back)[1] / calls


def graph_ms(fn) -> float:
    """Median milliseconds of one call replayed from a CUDA graph (captured once, after warm-up calls
    on a side stream as capture requires), with the L2 flush of utils.bench.time_cuda."""
    from utils.bench import time_cuda

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, warmup=3, reps=20, max_seconds=2.0)


def add_launch_figures(rows: list[dict], profile: dict, models: Models, notes: list[str]) -> None:
    """Give each row at the profile shape its GPU kernel time (from the profile), its back-to-back time
    and its CUDA-graph time (module docstring)."""
    from phase1_baseline.pytorch_transformer import synthetic_batch

    idx = synthetic_batch(PROFILE_SHAPE["B"], PROFILE_SHAPE["S"], device=DEVICE)
    for row in rows:
        if (row["B"], row["S"]) != (PROFILE_SHAPE["B"], PROFILE_SHAPE["S"]):
            continue
        impl = row["impl"]
        measured = profile["by_impl"].get(impl)
        row["gpu_ms"] = measured["total_gpu_us"] / 1e3 if measured else None
        model = models.get(impl)
        if model is None:   # dropped after this row was measured
            continue
        row["b2b_ms"] = back_to_back_ms(lambda: model(idx))
        row["graph_ms"] = None
        if impl not in NO_GRAPH:
            try:
                row["graph_ms"] = graph_ms(lambda: model(idx))
            except Exception as exc:  # a model that cannot be captured is a result to report, not a crash
                notes.append(f"{impl}: CUDA graph capture failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200]}")
        print(f"  {impl:22s} kernels {row['gpu_ms'] or float('nan'):.3f} ms, back-to-back {row['b2b_ms']:.3f} ms, "
              f"CUDA graph {row['graph_ms'] or float('nan'):.3f} ms", flush=True)


# ------------------------------------------------------------------------------------------------


def _ceilings() -> dict:
    """This GPU's cached ceilings (utils.roofline), if a phase already measured them; {} otherwise
    (the model rows need none; measuring them here would cost the run's time)."""
    try:
        from utils.roofline import load_cached_ceilings

        return load_cached_ceilings() or {}
    except Exception:  # noqa: BLE001 - a missing cache is not an error here
        return {}


@torch.no_grad()  # every figure here is of inference: no autograd graph is recorded
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="seq 128 and 1024, batch 1 and 8 (a smoke run)")
    size.add_argument("--full", action="store_true", help=f"no B*S <= {MAX_TOKENS} limit (slow; large memory)")
    parser.add_argument("--no-compile", action="store_true", help="leave torch_sdpa_compiled out")
    parser.add_argument("--out", type=Path, default=METRICS_PATH, help="results file (default: %(default)s)")
    args = parser.parse_args(argv)
    from utils.render import render
    from utils.results import write_results

    if not torch.cuda.is_available():
        print("final.benchmark: no CUDA GPU visible, nothing measured (the committed final/results are unchanged)")
        if not args.out.exists():
            print(f"final.benchmark: no {args.out.name} yet, nothing to render")
            return 0
        render(HERE)
        return 0
    if torch.backends.cuda.matmul.allow_tf32:
        print("note: TF32 matmuls are enabled; FP32 rows then use TF32 tensor cores", flush=True)
    configs = (grid(QUICK["seq_lens"], QUICK["batches"]) if args.quick
               else grid(max_tokens=None if args.full else MAX_TOKENS))
    notes: list[str] = []
    impls = [i for i in IMPLS if not (args.no_compile and i == "torch_sdpa_compiled")]
    if args.no_compile:
        notes.append("torch_sdpa_compiled left out (--no-compile)")
    models = Models(notes)
    start = time.perf_counter()
    rows = measure(impls, configs, models, notes)
    rows += measure(list(PROFILE_ONLY_IMPLS), [PROFILE_SHAPE], models, notes)
    profile_impls = [i for i in (*IMPLS, *PROFILE_ONLY_IMPLS) if i != "torch_sdpa_compiled"]
    profile = profile_all(profile_impls, models, notes)
    add_launch_figures(rows, profile, models, notes)
    grid_doc = {"seq_lens": sorted({c["S"] for c in configs}), "batches": sorted({c["B"] for c in configs}),
                "max_tokens": None if (args.full or args.quick) else MAX_TOKENS,
                "mode": "quick" if args.quick else "full" if args.full else "default",
                "impls": {k: {"dtype": d, "what": w} for k, (d, w) in {**IMPLS, **PROFILE_ONLY_IMPLS}.items()},
                "tf32": bool(torch.backends.cuda.matmul.allow_tf32)}
    path = write_results(args.out, rows, _ceilings(), profile=profile, grid=grid_doc,
                         notes=notes, compile_s=models.compile_s, wall_s=time.perf_counter() - start)
    from utils.build import shown
    print(f"wrote {shown(path)} ({len(rows)} rows, {time.perf_counter() - start:.0f} s)")
    if args.out.resolve() == METRICS_PATH:
        from final import api_overhead, api_speed

        api_overhead.run()  # the attention API's per-call cost (seconds), a table of the same README
        api_speed.run()  # the attention API at the phases' headline shape (seconds), likewise
        render(HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
