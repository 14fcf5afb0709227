"""`python -m final.train [--quick] [--steps N] [--text FILE]`: the phase 1 GPT and the
OptimizedTransformer trained side by side, FP32 and BF16.

Each run starts from the same weights (phase1 build_model(0)) and sees the same batches, so the loss
curves of the two models of one precision should lie on top of each other; what differs is the
time per step. Implementations (IMPLS):
    torch_sdpa        FP32 phase 1 GPT, torch SDPA attention, PyTorch's backward everywhere
    optimized         FP32 OptimizedTransformer: phase 5 fused attention (its backward), phase 6
                      LayerNorm and MLP with phase 6's backward kernels
    torch_sdpa_bf16   the phase 1 GPT with BF16 weights, torch SDPA
    optimized_bf16    the OptimizedTransformer with BF16 weights: phase 5 attention (the Hopper
                      kernels on an H100, else tensor cores), phase 6 LayerNorm and GELU, cuBLAS GEMMs
BF16 runs keep their weights and AdamW state in BF16 (no FP32 master copy): the simplest mixed
setup, and the same for both models.

One training step (train_step): forward, next-token cross-entropy in FP32, backward, AdamW. The
default run: STEPS steps at batch BATCH, sequence SEQ of the 4-layer model; the first WARMUP steps
are left out of the timing (CUDA events around the rest; the losses stay on the GPU until the end,
so no step waits for the CPU). tokens/s = B * S * timed steps / time. Peak memory is the most the
run allocated beyond the weights.

Every model is trained twice from the same weights on the same batches: eagerly, and with the step
captured in a CUDA graph after the warm-up (GraphedTrainStep, AdamW with capturable=True), which
replays its kernels without the CPU's per-op cost. The graph columns (graph_ms, graph_tokens_per_s,
graph_final_loss) are the second run's: the time the GPU needs for a step. host_ms is the eager
run's other side: the CPU's time to issue one step with the GPU idle (host_ms_per_step), so the two
models' per-op costs compare on the host they ran on.

Data: a synthetic byte corpus (synthetic_corpus: words of a fixed random dictionary, drawn with
Zipf frequencies and separated by spaces) unless --text names a local text file; each step reads
BATCH windows of SEQ + 1 bytes at seeded random offsets. Uniform random tokens would leave nothing
to learn (the loss would stay at ln 256); the dictionary gives the models something to learn.

Writes final/results/training.json (utils.results: rows of op "train", the loss curves under
"curves"), then draws final/README.md's training table and loss plot (utils.render). --quick: a few
steps at a small shape, written to final/results/quick/ and not rendered. Without a GPU nothing is
measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "results" / "training.json"
QUICK_PATH = HERE / "results" / "quick" / "training.json"

STEPS, BATCH, SEQ, WARMUP = 200, 8, 1024, 5
HOST_STEPS = 20  # eager steps after the timed ones whose issue time on the CPU is taken (host_ms_per_step)
QUICK = {"steps": 12, "batch": 2, "seq": 256, "warmup": 2}
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1
CORPUS_BYTES = 1 << 22
IMPLS = {
    "torch_sdpa": ("float32", "phase 1 GPT, torch SDPA attention"),
    "optimized": ("float32", "OptimizedTransformer: phase 5 fused attention, phase 6 LayerNorm + MLP"),
    "torch_sdpa_bf16": ("bfloat16", "phase 1 GPT, BF16 weights, torch SDPA attention"),
    "optimized_bf16": ("bfloat16", "OptimizedTransformer, BF16 weights: phase 5 attention (Hopper or tensor cores), "
                       "phase 6 LayerNorm"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------------
# Data


def synthetic_corpus(n_bytes: int = CORPUS_BYTES, seed: int = 0, words: int = 512) -> torch.Tensor:
    """n_bytes of text-like bytes (uint8): words of 2-8 lowercase letters from a fixed random
    dictionary of `words` words, drawn with Zipf frequencies (the k-th word 1/k as often as the first),
    each followed by a space."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (words,), generator=gen)
    table = torch.randint(ord("a"), ord("z") + 1, (words, 9), generator=gen, dtype=torch.uint8)
    table[torch.arange(words), lengths] = ord(" ")  # the space after each word
    keep = torch.arange(9) <= lengths[:, None]      # the word's letters and its space
    frequency = 1.0 / torch.arange(1, words + 1, dtype=torch.float64)
    ids = torch.multinomial(frequency, n_bytes // 3, replacement=True, generator=gen)
    text = table[ids][keep[ids]]
    if text.numel() < n_bytes:
        raise ValueError(f"the corpus came out {text.numel()} bytes long, fewer than {n_bytes}")
    return text[:n_bytes]


def load_corpus(text: str | None) -> torch.Tensor:
    """The bytes to train on: a local text file, or synthetic_corpus()."""
    if text is None:
        return synthetic_corpus()
    data = torch.frombuffer(bytearray(Path(text).read_bytes()), dtype=torch.uint8)
    return data


def batches(corpus: torch.Tensor, steps: int, batch: int, seq: int, seed: int = 0, device="cuda") -> torch.Tensor:
    """[steps, batch, seq + 1] int64 windows of the corpus at seeded random offsets (the same for
    every model), made once on the device so that no step waits for data."""
    if corpus.numel() <= seq + 1:
        raise ValueError(f"the corpus has {corpus.numel()} bytes, fewer than seq + 2 = {seq + 2}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, corpus.numel() - seq - 1, (steps, batch, 1), generator=gen)
    data = corpus.to(device)
    return data[(starts + torch.arange(seq + 1)).to(device)].long()


# ------------------------------------------------------------------------------------------------
# Models and the training step


def build(impl: str, device="cuda", config=None) -> torch.nn.Module:
    """impl's model with build_model(0)'s weights, in impl's dtype."""
    from final.optimized_transformer import OptimizedTransformer
    from phase1_baseline.pytorch_transformer import build_model

    dtype = DTYPES[IMPLS[impl][0]]
    base = build_model(0, device, attention="sdpa", config=config)
    model = OptimizedTransformer.from_baseline(base, dtype=dtype) if impl.startswith("optimized") else base.to(dtype)
    return model.train()


def make_optimizer(model: torch.nn.Module, lr: float = LR, capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW. capturable=True keeps its step count on the GPU, which a CUDA graph of the step needs."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY,
                             capturable=capturable)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor) -> torch.Tensor:
    """One step on tokens idx [B, S + 1]: forward on idx[:, :-1], next-token loss (FP32),
    backward, AdamW. Returns the loss (detached, on the device)."""
    from phase1_baseline.pytorch_transformer import next_token_loss

    optimizer.zero_grad(set_to_none=True)
    loss = next_token_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    optimizer.step()
    return loss.detach()


class GraphedTrainStep:
    """train_step captured once in a CUDA graph: calling it copies idx into the graph's input and
    replays forward, loss, backward and AdamW with no Python and no kernel launch per op.

    Capture records kernels without running them, so whatever a step sets up the first time (the
    extensions, cuBLAS's workspaces, the optimizer's state, the kernels' shared-memory opt-ins) must
    exist before it: take a few eager steps on a side stream first (warm_up_steps). The optimizer
    must be capturable (make_optimizer(..., capturable=True)). The gradients live in the graph's
    memory from then on; the first replay is the first step the graph takes."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, idx_shape):
        self.idx = torch.zeros(tuple(idx_shape), dtype=torch.long, device="cuda")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = train_step(model, optimizer, self.idx)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        self.idx.copy_(idx)
        self.graph.replay()
        return self.loss


def warm_up_steps(model, optimizer, data: torch.Tensor, losses: torch.Tensor) -> None:
    """Eager training steps on data[0], data[1], ... (losses[i] = step i's loss), on a side stream,
    as CUDA graph capture asks: the allocator then keeps their memory apart from the graph's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(data.shape[0]):
            losses[step] = train_step(model, optimizer, data[step])
    torch.cuda.current_stream().wait_stream(side)


def run_steps(impl: str, data: torch.Tensor, warmup: int, graph: bool) -> dict:
    """Train impl's model on data [steps, B, S + 1], eagerly or (graph) replaying a GraphedTrainStep
    after the warm-up: its losses, the time per step after `warmup` (CUDA events) and the peak
    memory beyond the weights."""
    from utils.bench import timed_call

    steps = data.shape[0]
    model = build(impl)
    optimizer = make_optimizer(model, capturable=graph)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    losses = torch.empty(steps, device="cuda")
    warm_up_steps(model, optimizer, data[:warmup], losses)
    step = GraphedTrainStep(model, optimizer, data.shape[1:]) if graph else \
        (lambda idx: train_step(model, optimizer, idx))

    def timed_steps():
        for n in range(warmup, steps):
            losses[n] = step(data[n])

    ms = timed_call(timed_steps)[1] / (steps - warmup)
    result = {"losses": losses.tolist(), "ms": ms, "peak_mb": (torch.cuda.max_memory_allocated() - before) / 2**20}
    if not graph:
        result["host_ms"] = host_ms_per_step(step, data[warmup:warmup + HOST_STEPS])
    del model, optimizer, step
    torch.cuda.empty_cache()
    return result


def host_ms_per_step(step, data: torch.Tensor) -> float:
    """The CPU's time to issue one step (median over data's batches, the GPU drained before each, so
    no launch waits for a free slot in the queue): what an eager step costs the host, apart from the
    GPU's time. Taken after the timed steps; the model trains on these batches again."""
    times = []
    for idx in data:
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(idx)
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def train(impl: str, data: torch.Tensor, warmup: int) -> dict:
    """impl's model trained twice on data [steps, B, S + 1] from the same weights, eagerly and with
    the step in a CUDA graph: one row (time per step after `warmup` steps, tokens/s, loss and peak
    memory of the eager run; graph_* of the graphed run) and the eager run's loss curve."""
    steps, B, S = data.shape[0], data.shape[1], data.shape[2] - 1
    eager, graphed = (run_steps(impl, data, warmup, graph) for graph in (False, True))
    curve = eager["losses"]

    def tail_mean(losses):
        tail = losses[-min(10, steps):]
        return sum(tail) / len(tail)

    row = {"impl": impl, "op": "train", "B": B, "S": S, "dtype": IMPLS[impl][0], "steps": steps,
           "timed_steps": steps - warmup, "ms": eager["ms"],
           "tokens_per_s": B * S / (eager["ms"] * 1e-3), "first_loss": curve[0], "final_loss": tail_mean(curve),
           "peak_mb": eager["peak_mb"], "host_ms": eager["host_ms"], "graph_ms": graphed["ms"],
           "graph_tokens_per_s": B * S / (graphed["ms"] * 1e-3), "graph_final_loss": tail_mean(graphed["losses"])}
    print(f"  {impl:16s} {row['ms']:8.2f} ms/step {row['tokens_per_s']:12,.0f} tok/s  host {row['host_ms']:.2f} ms  "
          f"graph {row['graph_ms']:.2f} ms/step  loss {curve[0]:.3f} -> {row['final_loss']:.3f} "
          f"(graph {row['graph_final_loss']:.3f})  peak {row['peak_mb']:.0f} MB", flush=True)
    return {"row": row, "curve": [{"impl": impl, "dtype": IMPLS[impl][0], "step": n, "loss": v}
                                  for n, v in enumerate(curve)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps at a small shape (results/quick/)")
    parser.add_argument("--steps", type=int, help=f"training steps per run (default {STEPS})")
    parser.add_argument("--text", help="a local text file to train on (default: the synthetic corpus)")
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("final.train: no CUDA GPU visible, nothing trained (the committed results are unchanged)")
        return 0
    from utils.render import render
    from utils.results import write_results

    shape = (dict(QUICK) if args.quick else {"steps": STEPS, "batch": BATCH, "seq": SEQ, "warmup": WARMUP})
    if args.steps is not None:
        if args.steps <= shape["warmup"]:
            raise SystemExit(f"--steps must be more than the {shape['warmup']} warm-up steps")
        shape["steps"] = args.steps
    if torch.backends.cuda.matmul.allow_tf32:
        print("note: TF32 matmuls are enabled; FP32 rows then use TF32 tensor cores", flush=True)
    data = batches(load_corpus(args.text), shape["steps"], shape["batch"], shape["seq"])
    print(f"training {len(args.impls)} models, {shape['steps']} steps of batch {shape['batch']} x seq "
          f"{shape['seq']}", flush=True)
    start = time.perf_counter()
    runs = [train(impl, data, shape["warmup"]) for impl in args.impls]
    out = QUICK_PATH if args.quick else RESULTS_PATH
    setup = {**shape, "lr": LR, "betas": BETAS, "weight_decay": WEIGHT_DECAY,
             "data": args.text and Path(args.text).name or "synthetic_corpus",
             "impls": {k: {"dtype": d, "what": w} for k, (d, w) in IMPLS.items() if k in args.impls},
             "tf32": bool(torch.backends.cuda.matmul.allow_tf32)}
    path = write_results(out, [r["row"] for r in runs], {}, curves=[p for r in runs for p in r["curve"]],
                         setup=setup, wall_s=time.perf_counter() - start)
    from utils.build import shown
    print(f"wrote {shown(path)} in {time.perf_counter() - start:.0f} s")
    if not args.quick:
        render(HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
