"""The ring's correctness cases, run on every rank of a process group (the tests spawn the group:
gloo on CPU, NCCL on GPUs). Each rank draws the same full q, k, v, attends with its shard, gathers
every rank's output and compares the whole sequence with utils.reference in float64."""

from __future__ import annotations

import torch
import torch.distributed as dist

from phase5_fused.ring import allgather_attention, ring_attention, shard, unshard
from phase5_fused.ring.blocks import BACKWARDS
from utils import reference
from utils.testing import assert_close, randn

# (B, H, S, D): S = 1, lengths no number of ranks divides, and one that all of 1-4 divide twice over;
# small D for the reference block on CPU, the kernels' head sizes on GPUs.
CPU_SHAPES = [(1, 1, 1, 8), (2, 3, 13, 16), (1, 2, 67, 32), (2, 2, 96, 16)]
GPU_SHAPES = [(1, 1, 1, 64), (2, 3, 13, 128), (1, 2, 1000, 64), (2, 2, 96, 128)]
VARIANTS = {"ring": ring_attention, "allgather": allgather_attention}
# Gradients of half-precision blocks: the backward kernels' own error (their lesson allows 2x
# PyTorch's) plus the FP32 sums over the ring's blocks; float32 and float64 keep the output's.
GRAD_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def check_cases(rank: int, world: int, device: str, blocks: list[str], dtypes: list[torch.dtype],
                seed: int) -> None:
    for n, (B, H, S, D) in enumerate(CPU_SHAPES if device == "cpu" else GPU_SHAPES):
        for is_causal in (False, True):
            for dtype in dtypes:
                full = [randn(B, H, S, D, dtype=dtype, device=device, seed=seed + 7 * n + i) for i in range(3)]
                ref, ref_lse = reference.attention(*full, is_causal=is_causal, return_lse=True)
                local = [shard(x, rank, world, is_causal) for x in full]
                for block in blocks:
                    for name, attend in VARIANTS.items():
                        out, lse = attend(*local, seq_len=S, is_causal=is_causal, block=block, return_lse=True)
                        what = f"{name} {block} world={world} rank={rank} {(B, H, S, D)} causal={is_causal} {dtype}"
                        assert_close(unshard(_gather(out, world), S, is_causal), ref, dtype=dtype, what=what,
                                     seed_info=f"(seed {seed})")
                        full_lse = unshard([x.unsqueeze(-1) for x in _gather(lse, world)], S, is_causal)
                        assert_close(full_lse.squeeze(-1), ref_lse, dtype=torch.float32, what=what + " lse",
                                     seed_info=f"(seed {seed})")
                    if block in BACKWARDS:
                        check_gradients(full, S, is_causal, block, rank, world, seed + 7 * n + 3,
                                        f"{block} world={world} rank={rank} {(B, H, S, D)} causal={is_causal} {dtype}")


def check_gradients(full: list[torch.Tensor], S: int, is_causal: bool, block: str, rank: int, world: int,
                    seed: int, what: str) -> None:
    """The gradients of the ring (autograd through ring_attention) against float64 autograd of
    the whole sequence, for a random output gradient."""
    q, k, v = full
    dout = randn(*q.shape, dtype=q.dtype, device=q.device, seed=seed)
    local = [shard(x, rank, world, is_causal).requires_grad_() for x in full]
    out = ring_attention(*local, seq_len=S, is_causal=is_causal, block=block)
    out.backward(shard(dout, rank, world, is_causal))
    refs = reference.attention_grads(q, k, v, dout, is_causal=is_causal)
    for name, x, ref in zip(("dq", "dk", "dv"), local, refs):
        grad = unshard(_gather(x.grad, world), S, is_causal)
        assert_close(grad, ref, dtype=q.dtype, rel_tol=GRAD_TOL.get(q.dtype), what=f"ring backward {what} {name}",
                     seed_info=f"(seed {seed})")


def _gather(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    if world == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return parts


def spawned_worker(rank: int, world: int, init_file: str, backend: str, blocks: list[str],
                   dtypes: list[torch.dtype], seed: int) -> None:
    """torch.multiprocessing.spawn's entry: join the group, run every case, leave."""
    device = "cpu" if backend == "gloo" else f"cuda:{rank}"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        check_cases(rank, world, device, blocks, dtypes, seed)
    finally:
        dist.destroy_process_group()
