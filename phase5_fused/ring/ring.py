"""Ring attention (context parallelism): attention over a sequence sharded across the ranks of a
torch.distributed process group, K/V travelling around the ring.

Each rank holds its shard of Q, K and V (sharding.shard). In step s = 0 .. world-1 rank r holds
the K/V shard of rank (r - s) mod world: it sends that shard on to rank r + 1 and receives the next
one from rank r - 1 while it computes attention between its queries and the keys it holds (the
transfer of block s + 1 overlaps the compute of block s), and merges each block's (o, lse) into
its running result exactly (merge.merge). After world steps every query has met every key.
allgather_attention gathers every K/V shard first and then computes: the simple version the ring
is measured against (it holds the whole K/V sequence on every rank).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from phase5_fused.ring.blocks import BLOCKS
from phase5_fused.ring.merge import merge
from phase5_fused.ring.sharding import chunk_ids, valid_keys
from utils.checks import check_tensor


def _group_info(group) -> tuple[int, int]:
    """(rank, world) of this process in group, or (0, 1) without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check(q, k, v, seq_len: int, world: int, is_causal: bool) -> None:
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(x, name, dim=4)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k and v shards must have one shape (self-attention), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (k.dtype == v.dtype == q.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    pieces = 2 * world if is_causal else world
    if q.shape[2] * world != -(-seq_len // pieces) * pieces or seq_len < 1:
        raise ValueError(f"seq_len {seq_len} does not match shards of length {q.shape[2]} on {world} ranks "
                         "(cut the sequence with phase5_fused.ring.sharding.shard)")


class _Attention:
    """The running (o, lse) of this rank's query chunks, and the block pairs it computes."""

    def __init__(self, q, seq_len: int, rank: int, world: int, is_causal: bool, scale: float, block: str):
        self.ids = chunk_ids(rank, world, is_causal)
        self.q_chunks = q.chunk(len(self.ids), dim=2)
        self.world, self.seq_len, self.is_causal, self.scale = world, seq_len, is_causal, scale
        self.block = BLOCKS[block]
        self.o: list = [None] * len(self.ids)
        self.lse: list = [None] * len(self.ids)

    def add(self, kv: torch.Tensor, src: int) -> None:
        """Attend this rank's query chunks to src's K/V shard (kv = stack(k, v)) and merge."""
        k_ids = chunk_ids(src, self.world, self.is_causal)
        chunk_len = kv.shape[3] // len(k_ids)
        for qi, q_id in enumerate(self.ids):
            for kj, k_id in enumerate(k_ids):
                if self.is_causal and k_id > q_id:
                    continue                                   # a later chunk: every key is hidden
                k, v = (x[:, :, kj * chunk_len:(kj + 1) * chunk_len] for x in kv)
                if not self.is_causal:                         # cut the end padding off
                    n = valid_keys(k_id, chunk_len, self.seq_len)
                    if n == 0:
                        continue
                    k, v = k[:, :, :n], v[:, :, :n]
                o_b, lse_b = self.block(self.q_chunks[qi], k, v, self.is_causal and k_id == q_id, self.scale)
                if self.o[qi] is None:
                    self.o[qi], self.lse[qi] = o_b, lse_b
                else:
                    self.o[qi], self.lse[qi] = merge(self.o[qi], self.lse[qi], o_b, lse_b)

    def result(self, dtype: torch.dtype, return_lse: bool):
        # Every query chunk has met at least one key chunk: its own diagonal (causal) or the
        # first chunk, which always holds a real key (non-causal).
        o = torch.cat(self.o, dim=2).to(dtype)
        return (o, torch.cat(self.lse, dim=2)) if return_lse else o


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def ring_attention(q, k, v, seq_len: int, is_causal: bool = False, scale: float | None = None,
                   block: str = "reference", group=None, return_lse: bool = False):
    """This rank's output shard of softmax(scale q k^T) v over the whole sequence.

    q, k, v: this rank's shards [B, H, S_local, D] (sharding.shard with the same world and
    is_causal); seq_len: the sequence's real length (before padding). block: a key of
    blocks.BLOCKS. group: the process group (default: the default group, or one process when none
    is initialized). Returns the output shard in q's dtype (and its logsumexp [B, H, S_local]).
    """
    rank, world = _group_info(group)
    _check(q, k, v, seq_len, world, is_causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    state = _Attention(q, seq_len, rank, world, is_causal, scale, block)
    kv = torch.stack([k, v])
    receive = torch.empty_like(kv)
    for step in range(world):
        # 1. Start passing the K/V shard on (and receiving the next) before computing with it.
        pending = []
        if step + 1 < world:
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, kv, _global(group, (rank + 1) % world), group),
                dist.P2POp(dist.irecv, receive, _global(group, (rank - 1) % world), group)])
        # 2. Attend to the shard of rank (rank - step) and merge by logsumexp.
        state.add(kv, (rank - step) % world)
        # 3. Wait for the transfer; the received shard is the next step's, the old buffer receives next.
        for request in pending:
            request.wait()
        if pending:
            kv, receive = receive, kv
    return state.result(q.dtype, return_lse)


def allgather_attention(q, k, v, seq_len: int, is_causal: bool = False, scale: float | None = None,
                        block: str = "reference", group=None, return_lse: bool = False):
    """The same result as ring_attention, after gathering every rank's K/V shard on every rank
    (all_gather: one collective, then no overlap, and world times the K/V memory)."""
    rank, world = _group_info(group)
    _check(q, k, v, seq_len, world, is_causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    state = _Attention(q, seq_len, rank, world, is_causal, scale, block)
    kv = torch.stack([k, v])
    gathered = [torch.empty_like(kv) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, kv, group=group)
    else:
        gathered = [kv]
    for src, shard_kv in enumerate(gathered):
        state.add(shard_kv, src)
    return state.result(q.dtype, return_lse)
