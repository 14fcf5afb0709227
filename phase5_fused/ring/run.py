"""`python -m phase5_fused.ring.run [--quick]`: measure ring attention on every GPU of this machine.

For each number of ranks N in (1, 2, 4, 8) up to the visible GPUs, N processes join an NCCL group
(torch.multiprocessing.spawn) and time, at B=1, H=8, D=128, FP16, causal and not, S from 16K up:
the ring and the all-gather version over the course's tensor-core block and over PyTorch's
FlashAttention-2 block (which returns its logsumexp), the time of a call being the slowest rank's
median. With N=1 the same blocks also run on the whole sequence in one call, the single-GPU time
t1 that the scaling efficiency t1 / (N * t_N) is taken against. TFLOP/s count the sequence's
FLOPs (utils.roofline.attention_flops), all ranks together. Then results/metrics.json and the
tables of manifest.json. Without a GPU it measures nothing and renders the committed results.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from phase5_fused.ring import BLOCKS, allgather_attention, ring_attention, shard
from utils.bench import timed_call
from utils.kernel_bench import lesson_main, results_dir

HERE = Path(__file__).resolve().parent
B, H, D = 1, 8, 128
SEQ_LENS = (16384, 32768, 65536, 131072, 262144)
QUICK_SEQ_LENS = (16384,)
WORLDS = (1, 2, 4, 8)
BLOCK_NAMES = ("course", "sdpa_flash")
VARIANTS = {"ring": ring_attention, "allgather": allgather_attention}
REPS = 5


def time_ms(fn) -> float:
    """The slowest rank's median time of fn() over REPS calls (after one warm-up), in ms."""
    fn()
    times = []
    for _ in range(REPS):
        dist.barrier()
        torch.cuda.synchronize()
        times.append(timed_call(fn)[1])
    slowest = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def bench_worker(rank: int, world: int, init_file: str, seq_lens, out_file: str) -> None:
    """One rank: time every configuration; rank 0 writes the rows to out_file."""
    from utils.roofline import attention_flops, tflops

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = []
    for S in seq_lens:
        for is_causal in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(S + is_causal)
            full = [torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3)]
            local = [shard(x, rank, world, is_causal) for x in full]
            flops = attention_flops(B, H, S, S, D, causal=is_causal)
            shape = {"op": "attention", "B": B, "H": H, "Sq": S, "Sk": S, "D": D, "causal": is_causal,
                     "dtype": "float16", "world": world}
            for block in BLOCK_NAMES:
                for variant, attend in VARIANTS.items():
                    ms = time_ms(lambda: attend(*local, seq_len=S, is_causal=is_causal, block=block))
                    rows.append({**shape, "impl": f"{variant}_{block}", "block": block, "ms": ms,
                                 "tflops": tflops(flops, ms)})
                if world == 1:
                    ms = time_ms(lambda: BLOCKS[block](*full, is_causal, D ** -0.5))
                    rows.append({**shape, "impl": f"single_{block}", "block": block, "ms": ms,
                                 "tflops": tflops(flops, ms)})
            del full, local
            torch.cuda.empty_cache()
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def with_efficiency(rows: list[dict]) -> list[dict]:
    """Each ring/allgather row with t1 / (N * t_N), t1 the single-GPU call of the same block and shape."""
    single = {(r["block"], r["Sq"], r["causal"]): r["ms"] for r in rows if r["impl"].startswith("single_")}
    for r in rows:
        t1 = single.get((r["block"], r["Sq"], r["causal"]))
        if t1 is not None and not r["impl"].startswith("single_"):
            r["scaling_efficiency"] = t1 / (r["world"] * r["ms"])
    return rows


def measure(args) -> Path:
    from utils.results import write_results
    from utils.roofline import get_ceilings

    seq_lens = QUICK_SEQ_LENS if args.quick else SEQ_LENS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (w for w in WORLDS if w <= torch.cuda.device_count()):
            out_file = Path(tmp) / f"rows_{world}.json"
            print(f"ring: {world} rank(s), S in {seq_lens}", flush=True)
            mp.spawn(bench_worker, args=(world, str(Path(tmp) / f"store_{world}"), seq_lens, str(out_file)),
                     nprocs=world, join=True)
            rows += json.loads(out_file.read_text())
    return write_results(results_dir(HERE, args.quick) / "metrics.json", with_efficiency(rows),
                         ceilings=get_ceilings(), gpus=torch.cuda.device_count())


def main(argv=None) -> int:
    return lesson_main(argv, HERE, __doc__.split("\n\n")[0], measure)


if __name__ == "__main__":
    sys.exit(main())
