"""End-to-end benchmark: the phase 1 GPT in PyTorch against the OptimizedTransformer.

`python -m final.benchmark [--quick | --full]` on a GPU measures, for every (batch, seq) of the grid
and every implementation, with the same weights (phase1 build_model(0)) and the same tokens:
forward time (CUDA events, warm-up, L2 flush, median: utils.bench.time_cuda), tokens/s, model TFLOP/s
(model_flops's formula), the peak memory a forward allocates beyond the weights and inputs
(utils.bench.peak_extra_mb), and the logits' relative error against torch_eager's FP32 logits
(a broken kernel must not look fast). Then, at the profile shape (batch 8, seq 1024), torch.profiler
splits each eager implementation's GPU time into attention, layer_norm, mlp and other from the
models' named ranges (as phase1_baseline/profile_pytorch.py does). Writes final/results/metrics.json
(utils.results; op "model" rows with B and S, DESIGN.md's schema) and prints a summary.

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
Target (issue 7): at batch 8, seq 1024 the OptimizedTransformer at least as fast as PyTorch with
SDPA, FP32 (optimized vs torch_sdpa) and FP16 (optimized_fp16 vs torch_sdpa_fp16); "targets" in
the results says whether it was met, from the measured times.
It also regenerates final/README.md's measured section from the file it wrote (between the
results markers); `--render` does only that, from the committed results, on any machine.
Without a GPU it says so in one line and exits 0.
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
TARGETS = {"float32": ("optimized", "torch_sdpa"), "float16": ("optimized_fp16", "torch_sdpa_fp16")}


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
                ms = time_cuda(lambda: model(idx), warmup=3, reps=10, max_seconds=2.0)
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


def evaluate_targets(rows: list[dict]) -> dict:
    """At the profile shape: is each optimized model at least as fast as its SDPA peer?"""
    from utils.results import select

    out = {}
    for dtype, (ours, peer) in TARGETS.items():
        a = select(rows, impl=ours, **PROFILE_SHAPE)
        b = select(rows, impl=peer, **PROFILE_SHAPE)
        if a and b:
            out[dtype] = {"impl": ours, "peer": peer, **PROFILE_SHAPE, "ms": a[0]["ms"], "peer_ms": b[0]["ms"],
                          "speedup": b[0]["ms"] / a[0]["ms"], "met": a[0]["ms"] <= b[0]["ms"]}
        else:
            out[dtype] = {"impl": ours, "peer": peer, **PROFILE_SHAPE, "met": None, "why": "not measured"}
    return out


# ------------------------------------------------------------------------------------------------
# README section (generated from the results, never typed)


def readme_lines(doc: dict) -> list[str]:
    """final/README.md's measured section, every number read from the results file."""
    from utils.readme import env_line, fmt

    rows = [r for r in doc["rows"] if r["op"] == "model"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    by_key = {(r["impl"], r["B"], r["S"]): r for r in rows}
    shapes = sorted({(r["B"], r["S"]) for r in rows})
    lines = [env_line(doc), "", "**Forward time in ms** (lower is better; same weights and tokens; "
             "the last two columns: the optimized model's speed-up over its SDPA peer)", "",
             "| batch | seq | " + " | ".join(impls) + " | FP32 speed-up | FP16 speed-up |",
             "|---|---|" + "---|" * (len(impls) + 2)]
    for B, S in shapes:
        cells = [fmt(by_key[(i, B, S)]["ms"]) if (i, B, S) in by_key else "–" for i in impls]
        ups = []
        for ours, peer in TARGETS.values():
            a, b = by_key.get((ours, B, S)), by_key.get((peer, B, S))
            ups.append(f"{b['ms'] / a['ms']:.2f}x" if a and b else "–")
        lines.append(f"| {B} | {S} | " + " | ".join(cells) + " | " + " | ".join(ups) + " |")
    lines += ["", "**Tokens/s and peak extra memory (MB)**", "",
              "| batch | seq | " + " | ".join(f"{i} tok/s | {i} MB" for i in impls) + " |",
              "|---|---|" + "---|---|" * len(impls)]
    for B, S in shapes:
        cells = []
        for i in impls:
            r = by_key.get((i, B, S))
            cells += [fmt(r["tokens_per_s"]), fmt(r["extra_mb"])] if r else ["–", "–"]
        lines.append(f"| {B} | {S} | " + " | ".join(cells) + " |")
    errs = [r["rel_err"] for r in rows if r.get("rel_err") is not None and r["dtype"] == "float32"]
    errs16 = [r["rel_err"] for r in rows if r.get("rel_err") is not None and r["dtype"] != "float32"]
    if errs or errs16:
        lines += ["", f"Largest logits relative error against torch_eager: FP32 impls {fmt(max(errs, default=None))}, "
                      f"FP16 impls {fmt(max(errs16, default=None))}."]
    lines += ["", "**Target** (issue 7: the optimized model at least as fast as PyTorch with SDPA at batch "
                  f"{PROFILE_SHAPE['B']}, seq {PROFILE_SHAPE['S']})", ""]
    for dtype, t in doc.get("targets", {}).items():
        if t.get("met") is None:
            lines.append(f"- {dtype}: {t['impl']} vs {t['peer']}: not measured")
        else:
            lines.append(f"- {dtype}: {t['impl']} {fmt(t['ms'])} ms vs {t['peer']} {fmt(t['peer_ms'])} ms = "
                         f"{t['speedup']:.2f}x: {'met' if t['met'] else '**not met**'}")
    prof = doc.get("profile", {})
    if prof.get("by_impl"):
        shape = prof["shape"]
        lines += ["", f"**Where the GPU time goes** (torch.profiler ranges, batch {shape['B']}, seq {shape['S']}; "
                      "other = embeddings, qkv / proj / lm_head GEMMs, head split and merge)", "",
                  "| impl | kernels ms | " + " | ".join(COMPONENTS) + " |", "|---|---|" + "---|" * len(COMPONENTS)]
        for impl, p in prof["by_impl"].items():
            shares = [f"{fmt(p['us'][c] / 1e3)} ms ({p['share'][c]:.0%})" if p["share"].get(c) is not None else "–"
                      for c in COMPONENTS]
            lines.append(f"| {impl} | {fmt(p['total_gpu_us'] / 1e3)} | " + " | ".join(shares) + " |")
    grid_doc = doc.get("grid", {})
    if grid_doc.get("max_tokens"):
        lines += ["", f"Grid limited to batch x seq <= {grid_doc['max_tokens']} tokens (run time); "
                      "`python -m final.benchmark --full` measures the rest."]
    if doc.get("notes"):
        lines += ["", "Notes from the run:", ""] + [f"- {n}" for n in doc["notes"]]
    return lines


def render(doc: dict) -> bool:
    from utils.readme import update_readme

    return update_readme(HERE / "README.md", readme_lines(doc), source="results/metrics.json",
                         script="benchmark.py")


# ------------------------------------------------------------------------------------------------


def _ceilings() -> dict:
    """This GPU's cached ceilings (utils.roofline), if a phase already measured them; {} otherwise
    (the model rows need none; measuring them here would cost the run's time)."""
    try:
        from utils.roofline import load_cached_ceilings

        return load_cached_ceilings() or {}
    except Exception:  # noqa: BLE001 - a missing cache is not an error here
        return {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="seq 128 and 1024, batch 1 and 8 (a smoke run)")
    size.add_argument("--full", action="store_true", help=f"no B*S <= {MAX_TOKENS} limit (slow; large memory)")
    parser.add_argument("--no-compile", action="store_true", help="leave torch_sdpa_compiled out")
    parser.add_argument("--out", type=Path, default=METRICS_PATH, help="results file (default: %(default)s)")
    parser.add_argument("--render", action="store_true",
                        help="only regenerate final/README.md's measured section from the results file")
    args = parser.parse_args(argv)
    if args.render or not torch.cuda.is_available():
        from utils.results import read_results

        if not args.render:
            print("final.benchmark: no CUDA GPU visible, nothing measured (the committed final/results are unchanged)")
        if not args.out.exists():
            print(f"final.benchmark: no {args.out.name} yet, nothing to render")
            return 0
        render(read_results(args.out))
        print(f"rendered final/README.md from {args.out.name}")
        return 0
    from utils.results import read_results, write_results

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
    targets = evaluate_targets(rows)
    grid_doc = {"seq_lens": sorted({c["S"] for c in configs}), "batches": sorted({c["B"] for c in configs}),
                "max_tokens": None if (args.full or args.quick) else MAX_TOKENS,
                "mode": "quick" if args.quick else "full" if args.full else "default",
                "impls": {k: {"dtype": d, "what": w} for k, (d, w) in {**IMPLS, **PROFILE_ONLY_IMPLS}.items()},
                "tf32": bool(torch.backends.cuda.matmul.allow_tf32)}
    path = write_results(args.out, rows, _ceilings(), profile=profile, targets=targets, grid=grid_doc,
                         notes=notes, compile_s=models.compile_s, wall_s=time.perf_counter() - start)
    if args.out.resolve() == METRICS_PATH:
        render(read_results(path))
    for dtype, t in targets.items():
        if t.get("met") is None:
            print(f"target {dtype}: {t['impl']} vs {t['peer']} not measured")
        else:
            print(f"target {dtype} (B={t['B']}, S={t['S']}): {t['impl']} {t['ms']:.3f} ms vs {t['peer']} "
                  f"{t['peer_ms']:.3f} ms = {t['speedup']:.2f}x -> {'met' if t['met'] else 'NOT met'}")
    print(f"wrote {path} ({len(rows)} rows, {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
