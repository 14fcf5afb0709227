"""`python -m final.generate_benchmark [--quick]`: generating text, the OptimizedTransformer with its KV
cache against the phase 1 GPT with a KV cache in plain PyTorch, and without one.

The 4-layer model of final.benchmark (phase1 build_model(0): hidden 512, 8 heads of D = 64), greedy,
a prompt of PROMPT tokens and NEW_TOKENS new ones per sequence, at batch BATCHES, FP16 and FP32.
Implementations (IMPLS), all with the same weights and prompts:
    optimized             OptimizedTransformer.generate: the prefill through final.attention, the
                          decode steps through phase5_fused.decode over its KVCache
    optimized_paged       the same with the cache in pages of PAGE_SIZE tokens (decode's page table)
    optimized_graph       the same with the decode steps replayed from a CUDA graph (cuda_graph=True):
                          what is left once the CPU no longer launches each kernel
    torch_sdpa            the phase 1 GPT (torch SDPA attention), the same loop and KVCache with its
                          step in plain PyTorch (final.generation.torch_step): the peer
    torch_sdpa_no_cache   the phase 1 GPT re-run on the whole sequence for every new token
                          (final.generation.greedy_without_cache): what the cache saves
Figures per (impl, dtype, batch), each the median over REPS runs (CUDA events; one untimed run first):
    ms              one whole generation as a caller runs it (argument checks included)
    tokens_per_s    B * NEW_TOKENS / ms
    prefill_ms      the prompt's forward (with its cache writes), the first new token's logits
    decode_ms       the time per decode step after the first (one new token per sequence, argmax
                    included; the graph's first step runs eagerly and records it)
    step_mb         the MB (10^6 bytes) a decode step with a cache must read at least: every weight it
                    uses once (the embedding tables' B rows only) and the K and V of the cache, at the
                    mean cache length over the steps (step_bytes); None without a cache
    gbps            step_mb / decode_ms: against the DRAM ceiling, how memory-bound the steps are
    rel_err         the logits generate returned (each new token's) against the FP32 phase 1 GPT's
                    on the same tokens: a broken kernel must not look fast
Writes final/results/generation.json (utils.results; again after each dtype, so that a run cut short
keeps the dtypes it measured) and redraws final/README.md's table `generation` (final/manifest.json).
About 100 s per dtype on an H100. --quick: a short prompt and few tokens, written to
final/results/quick/ and not rendered. Without a GPU nothing is measured.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "results" / "generation.json"
QUICK_PATH = HERE / "results" / "quick" / "generation.json"

PROMPT, NEW_TOKENS, BATCHES, REPS = 512, 256, (1, 16), 3
PAGE_SIZE = 16
QUICK = {"prompt": 64, "new_tokens": 16, "batches": (1, 16), "reps": 2}
DTYPES = {"float16": torch.float16, "float32": torch.float32}
IMPLS = {
    "optimized": "OptimizedTransformer.generate: final.attention prefill, phase5_fused.decode steps, KVCache",
    "optimized_paged": f"the same, the KVCache in pages of {PAGE_SIZE} tokens",
    "optimized_graph": "the same, each decode step replayed from a CUDA graph (generate(cuda_graph=True))",
    "torch_sdpa": "phase 1 GPT, torch SDPA, the same loop and KVCache with a plain PyTorch step",
    "torch_sdpa_no_cache": "phase 1 GPT, torch SDPA, the whole sequence re-run for every new token",
}


def step_bytes(config, B: int, prompt: int, new_tokens: int, element_bytes: int) -> float:
    """The least a decode step reads: each weight once (of the embeddings, the B rows it looks up),
    and K and V of every layer at the mean cache length of the steps (prompt + 1 .. prompt + new - 1)."""
    C, L = config.hidden, config.n_layer
    per_layer = 3 * C * C + 3 * C + C * C + C + 2 * config.mlp_ratio * C * C + config.mlp_ratio * C + C + 4 * C
    weights = L * per_layer + 2 * C + config.vocab_size * C + 2 * B * C  # + ln_f, lm_head, embedding rows
    mean_length = prompt + new_tokens / 2
    cache = L * 2 * B * config.n_head * mean_length * config.head_dim
    return float((weights + cache) * element_bytes)


@dataclass
class Impl:
    """One implementation: its model, generate(idx, n) -> (tokens, logits) as a caller runs it, and
    for split_ms the prefill step, a factory of the decode step (one per generation) and the cache's
    page size (step None: no cache, the model re-run on the whole sequence)."""
    model: torch.nn.Module
    generate: Callable
    step: Callable | None = None
    decode_step: Callable[[], Callable] | None = None
    page_size: int | None = None


def build(dtype: torch.dtype, device="cuda") -> dict[str, Impl]:
    """Every implementation of IMPLS in dtype, with the same weights."""
    from final import generation as G
    from final.optimized_transformer import OptimizedTransformer
    from phase1_baseline.pytorch_transformer import build_model

    base = build_model(0, device, attention="sdpa").to(dtype)
    fast = OptimizedTransformer.from_baseline(build_model(0, device), dtype=dtype)
    base_step = functools.partial(G.torch_step, base)
    run = functools.partial(fast.generate, return_logits=True)
    return {
        "optimized": Impl(fast, run, fast.forward, lambda: fast.forward),
        "optimized_paged": Impl(fast, functools.partial(run, page_size=PAGE_SIZE), fast.forward, lambda: fast.forward,
                                PAGE_SIZE),
        "optimized_graph": Impl(fast, functools.partial(run, cuda_graph=True), fast.forward,
                                lambda: G.CUDAGraphStep(fast.decode_step)),
        "torch_sdpa": Impl(base, functools.partial(G.generate, base, base_step, return_logits=True), base_step,
                           lambda: base_step),
        "torch_sdpa_no_cache": Impl(base, functools.partial(G.greedy_without_cache, base)),
    }


def split_ms(impl: Impl, idx: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill ms, ms per decode step after the first) of one greedy generation, CUDA events
    around each part. The first decode step is left out of the second figure: the CUDA graph's runs
    eagerly and records the graph (its cost is in the whole generation's time)."""
    from final.kv_cache import KVCache

    B, S = idx.shape
    cache = KVCache.for_model(impl.model, B, S + new_tokens - 1, impl.page_size) if impl.step else None
    decode_step = impl.decode_step() if impl.step else None
    seq = idx

    def step(token):
        nonlocal seq
        if decode_step is not None:
            return decode_step(token, cache)[:, -1]
        seq = torch.cat([seq, token], dim=1)
        return impl.model(seq)[:, -1]

    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    start.record()
    logits = (impl.step(idx, cache) if impl.step else impl.model(idx))[:, -1]
    mid.record()
    logits = step(logits.argmax(dim=-1, keepdim=True))  # the first decode step (untimed)
    second = torch.cuda.Event(enable_timing=True)
    second.record()
    for _ in range(new_tokens - 2):
        logits = step(logits.argmax(dim=-1, keepdim=True))
    end.record()
    end.synchronize()
    return start.elapsed_time(mid), second.elapsed_time(end) / (new_tokens - 2)


@torch.no_grad()
def measure(impls, dtypes, batches, prompt: int, new_tokens: int, reps: int, device="cuda",
            notes: list | None = None) -> list[dict]:
    """The rows (module docstring). An implementation that fails at a shape (a CUDA graph that
    cannot be captured, say) is noted in `notes` and left out there."""
    from phase1_baseline.pytorch_transformer import build_model, synthetic_batch
    from utils.bench import timed_call
    from utils.testing import rel_error

    if new_tokens < 3:
        raise ValueError(f"new_tokens must be at least 3 (a prefill, a first step, timed steps), got {new_tokens}")
    notes = [] if notes is None else notes
    reference = build_model(0, device)  # FP32: each impl's logits are compared with its
    rows = []
    for dtype_name in dtypes:
        models = build(DTYPES[dtype_name], device)
        for B in batches:
            idx = synthetic_batch(B, prompt, seed=B, device=device)
            for name in impls:
                impl = models[name]
                try:
                    tokens, logits = impl.generate(idx, new_tokens)            # warm-up, and the accuracy check
                    err = rel_error(logits, reference(tokens[:, :-1])[:, prompt - 1:])
                    total = statistics.median(timed_call(lambda: impl.generate(idx, new_tokens))[1]
                                              for _ in range(reps))
                    prefill, decode = (statistics.median(x) for x in
                                       zip(*(split_ms(impl, idx, new_tokens) for _ in range(reps))))
                except Exception as exc:  # noqa: BLE001 - noted in the results, the others still run
                    notes.append(f"{name} {dtype_name} B={B}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    print(f"  {dtype_name:8s} B={B:<3d} {name:20s} FAILED: {notes[-1]}", flush=True)
                    continue
                # A cached step's least bytes; a step without a cache is a whole forward (no such model)
                size = step_bytes(impl.model.config, B, prompt, new_tokens, DTYPES[dtype_name].itemsize)
                cached = impl.step is not None
                row = {"impl": name, "op": "generate", "dtype": dtype_name, "B": B, "prompt": prompt,
                       "new_tokens": new_tokens, "ms": total, "tokens_per_s": B * new_tokens / (total * 1e-3),
                       "prefill_ms": prefill, "decode_ms": decode, "step_mb": size / 1e6 if cached else None,
                       "gbps": size / (decode * 1e-3) / 1e9 if cached else None, "rel_err": err}
                rows.append(row)
                print(f"  {dtype_name:8s} B={B:<3d} {name:20s} {total:9.1f} ms {row['tokens_per_s']:10,.0f} tok/s  "
                      f"prefill {prefill:7.2f} ms  decode {decode:6.3f} ms/step  logits rel err {err:.1e}",
                      flush=True)
        del models
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short prompt and few tokens (results/quick/)")
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("final.generate_benchmark: no CUDA GPU visible, nothing measured (the committed results are unchanged)")
        return 0
    from utils.render import render
    from utils.results import write_results
    from utils.roofline import load_cached_ceilings

    shape = (dict(QUICK) if args.quick
             else {"prompt": PROMPT, "new_tokens": NEW_TOKENS, "batches": BATCHES, "reps": REPS})
    print(f"generation: prompt {shape['prompt']}, {shape['new_tokens']} new tokens, batch {shape['batches']}, "
          f"{args.dtypes}, greedy", flush=True)
    start = time.perf_counter()
    notes: list[str] = []
    rows: list[dict] = []
    out = QUICK_PATH if args.quick else RESULTS_PATH
    ceilings = {k: v for k, v in (load_cached_ceilings() or {}).items() if k != "env"}
    for dtype in args.dtypes:  # written after each dtype: a run cut short keeps what it measured
        rows += measure(args.impls, [dtype], shape["batches"], shape["prompt"], shape["new_tokens"], shape["reps"],
                        notes=notes)
        path = write_results(out, rows, ceilings, setup={**shape, "impls": {k: IMPLS[k] for k in args.impls}},
                             notes=notes, wall_s=time.perf_counter() - start)
        from utils.build import shown
        print(f"wrote {shown(path)} ({', '.join(args.dtypes[:args.dtypes.index(dtype) + 1])}) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    if not args.quick:
        render(HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
