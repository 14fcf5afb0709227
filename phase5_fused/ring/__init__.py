"""Phase 5, ring attention: attention over a sequence sharded across GPUs (context parallelism).

    import torch.distributed as dist
    from phase5_fused.ring import ring_attention, shard, unshard
    q_local = shard(q, rank, world, is_causal=True)            # likewise k, v
    out_local = ring_attention(q_local, k_local, v_local, seq_len=S, is_causal=True, block="course")

ring_attention is differentiable (its backward passes K/V and their gradient accumulators around
the ring again: ring_attention_backward). Launched by torchrun (NCCL on GPUs) or, on CPU, with the gloo backend and the float64 reference
block (how the tests run it with no GPU). Causal sequences are cut zig-zag (sharding.py) so every
rank does the same work. Pure Python over torch.distributed and the course's kernels: this lesson
builds no extension of its own.
"""

from phase5_fused.ring.blocks import BLOCKS
from phase5_fused.ring.merge import merge
from phase5_fused.ring.ring import allgather_attention, ring_attention, ring_attention_backward
from phase5_fused.ring.sharding import shard, unshard

__all__ = ["BLOCKS", "allgather_attention", "merge", "ring_attention", "ring_attention_backward", "shard", "unshard"]
