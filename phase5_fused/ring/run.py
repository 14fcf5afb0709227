"""`python -m phase5_fused.ring.run [--quick]`: measure ring attention on every GPU of this machine.

For each number of ranks N in (1, 2, 4, 8) up to the visible GPUs, N processes join an NCCL group
(torch.multiprocessing.spawn) and time, at B=1, H=8, D=128, FP16, causal and not, S from 16K up:
the ring and the all-gather version over the course's tensor-core block and over PyTorch's
FlashAttention-2 block (which returns its logsumexp), the time of a call being the slowest rank's
median. With N=1 the same blocks also run on the whole sequence in one call, the single-GPU time
t1 that the scaling efficiency t1 / (N * t_N) is taken against. With N > 1 the ring's two halves
are also timed apart: its block computations and merges with no transfer (each step attends to the
rank's own K/V shard in place of the one it would receive: the same calls on the same shapes), and
its N - 1 K/V transfers with no compute; the share of the transfer time the ring hides is
1 - max(0, t_ring - t_compute) / t_transfer. TFLOP/s count the sequence's
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
from phase5_fused.ring.ring import _Attention, _pass_on, _wait
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


def compute_only(q, k, v, seq_len: int, is_causal: bool, block: str, rank: int, world: int):
    """The ring's block calls and merges without its transfers: every step attends to this rank's
    own K/V shard, standing in for the shard of rank (rank - step) (same shapes, same calls)."""
    state = _Attention(q, seq_len, rank, world, is_causal, D ** -0.5, block)
    kv = torch.stack([k, v])
    for step in range(world):
        state.add(kv, (rank - step) % world)
    return state.result(q.dtype, return_lse=True)


def transfers_only(kv: torch.Tensor, receive: torch.Tensor, rank: int, world: int) -> None:
    """The ring's world - 1 K/V transfers, each waited for, with no compute between them."""
    for _ in range(world - 1):
        _wait(_pass_on(kv, receive, rank, world, None))
        kv, receive = receive, kv


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
                else:
                    ms = time_ms(lambda: compute_only(*local, S, is_causal, block, rank, world))
                    rows.append({**shape, "op": "ring_parts", "impl": f"compute_{block}", "block": block, "ms": ms})
            if world > 1:
                kv = torch.stack(local[1:])
                receive = torch.empty_like(kv)
                ms = time_ms(lambda: transfers_only(kv, receive, rank, world))
                rows.append({**shape, "op": "ring_parts", "impl": "transfers", "ms": ms,
                             "gb_s": kv.numel() * kv.element_size() * (world - 1) / ms / 1e6})
                del kv, receive
            del full, local
            torch.cuda.empty_cache()
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def with_efficiency(rows: list[dict]) -> list[dict]:
    """Each ring/allgather row with t1 / (N * t_N), t1 the single-GPU call of the same block and
    shape; each multi-GPU ring row with its compute and transfer times apart and the share of the
    transfer it hides, 1 - max(0, t_ring - t_compute) / t_transfer."""
    by_impl = {(r["impl"], r["world"], r["Sq"], r["causal"]): r["ms"] for r in rows}
    for r in rows:
        variant, _, block = r["impl"].partition("_")
        t1 = by_impl.get((f"single_{block}", 1, r["Sq"], r["causal"]))
        if t1 is not None and variant in VARIANTS:
            r["scaling_efficiency"] = t1 / (r["world"] * r["ms"])
        compute = by_impl.get((f"compute_{block}", r["world"], r["Sq"], r["causal"]))
        transfer = by_impl.get(("transfers", r["world"], r["Sq"], r["causal"]))
        if variant == "ring" and compute is not None and transfer is not None:
            r["compute_ms"], r["transfer_ms"] = compute, transfer
            r["hidden"] = 1 - max(0.0, r["ms"] - compute) / transfer
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
