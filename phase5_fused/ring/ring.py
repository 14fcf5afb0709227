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

from phase5_fused.ring.blocks import BACKWARDS, BLOCKS
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


def block_pairs(q_ids, src: int, shard_len: int, world: int, is_causal: bool, seq_len: int):
    """The (query chunk, key block) pairs a rank computes against src's K/V shard: (index of the
    query chunk, slice of the shard's keys, whether the pair is causal-diagonal). Causal: a key
    chunk after the query chunk is skipped, the same chunk is the diagonal, an earlier one is
    computed unmasked. Non-causal: each key chunk cut to its real keys (the end padding off)."""
    k_ids = chunk_ids(src, world, is_causal)
    chunk_len = shard_len // len(k_ids)
    for qi, q_id in enumerate(q_ids):
        for kj, k_id in enumerate(k_ids):
            n = chunk_len if is_causal else valid_keys(k_id, chunk_len, seq_len)
            if (is_causal and k_id > q_id) or n == 0:
                continue
            yield qi, slice(kj * chunk_len, kj * chunk_len + n), is_causal and k_id == q_id


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
        for qi, keys, diagonal in block_pairs(self.ids, src, kv.shape[3], self.world, self.is_causal, self.seq_len):
            k, v = (x[:, :, keys] for x in kv)
            o_b, lse_b = self.block(self.q_chunks[qi], k, v, diagonal, self.scale)
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


def _pass_on(send: torch.Tensor, receive: torch.Tensor, rank: int, world: int, group) -> list:
    """Start sending `send` to the next rank of the ring and receiving the previous rank's into
    `receive`; returns the requests to wait for."""
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, _global(group, (rank + 1) % world), group),
        dist.P2POp(dist.irecv, receive, _global(group, (rank - 1) % world), group)])


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def ring_attention(q, k, v, seq_len: int, is_causal: bool = False, scale: float | None = None,
                   block: str = "reference", group=None, return_lse: bool = False):
    """This rank's output shard of softmax(scale q k^T) v over the whole sequence.

    q, k, v: this rank's shards [B, H, S_local, D] (sharding.shard with the same world and
    is_causal); seq_len: the sequence's real length (before padding). block: a key of
    blocks.BLOCKS. group: the process group (default: the default group, or one process when none
    is initialized). Returns the output shard in q's dtype (and its logsumexp [B, H, S_local]).
    Differentiable in q, k, v (ring_attention_backward) for the blocks of blocks.BACKWARDS.
    """
    rank, world = _group_info(group)
    _check(q, k, v, seq_len, world, is_causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        if block not in BACKWARDS:
            raise ValueError(f"block {block!r} has no backward here (blocks with one: {sorted(BACKWARDS)})")
        out, lse = _RingAttention.apply(q, k, v, seq_len, is_causal, scale, block, group)
    else:
        out, lse = _ring_forward(q, k, v, seq_len, is_causal, scale, block, group)
    return (out, lse) if return_lse else out


def _ring_forward(q, k, v, seq_len, is_causal, scale, block, group):
    rank, world = _group_info(group)
    state = _Attention(q, seq_len, rank, world, is_causal, scale, block)
    kv = torch.stack([k, v])
    receive = torch.empty_like(kv)
    for step in range(world):
        # 1. Start passing the K/V shard on (and receiving the next) before computing with it.
        pending = _pass_on(kv, receive, rank, world, group) if step + 1 < world else []
        # 2. Attend to the shard of rank (rank - step) and merge by logsumexp.
        state.add(kv, (rank - step) % world)
        # 3. Wait for the transfer; the received shard is the next step's, the old buffer receives next.
        _wait(pending)
        if pending:
            kv, receive = receive, kv
    return state.result(q.dtype, return_lse=True)


def ring_attention_backward(q, k, v, out, lse, dout, seq_len: int, is_causal: bool = False,
                            scale: float | None = None, block: str = "reference", group=None):
    """(dq, dk, dv) of this rank's shards, from ring_attention's out and lse (return_lse=True) and
    the output's gradient dout (all this rank's shards).

    The K/V shards travel the ring again, each with an accumulator of its dK, dV: in step s rank r
    adds its queries' share to the gradients of the shard it holds (blocks.BACKWARDS, from the
    whole rows' out and lse) and passes shard and accumulator on; after the last step every
    accumulator holds every rank's share, and one more hop returns it to the shard's owner. dQ
    stays home. The gradients are summed in float32 (float64 for the reference block)."""
    rank, world = _group_info(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    block_backward = BACKWARDS[block]
    ids = chunk_ids(rank, world, is_causal)
    q_chunks, out_chunks, dout_chunks, lse_chunks = (x.chunk(len(ids), dim=2) for x in (q, out, dout, lse))
    acc = torch.float64 if block == "reference" else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dq_chunks = dq.chunk(len(ids), dim=2)
    kv = torch.stack([k, v])
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    kv_next, dkv_next = torch.empty_like(kv), torch.empty_like(dkv)
    for step in range(world):
        # 1. Start passing the K/V shard on; its gradient accumulator goes once this rank's share is in.
        pending = _pass_on(kv, kv_next, rank, world, group) if step + 1 < world else []
        # 2. This rank's share of the gradients against the shard of rank (rank - step).
        src = (rank - step) % world
        for qi, keys, diagonal in block_pairs(ids, src, kv.shape[3], world, is_causal, seq_len):
            dq_b, dk_b, dv_b = block_backward(q_chunks[qi], kv[0][:, :, keys], kv[1][:, :, keys], out_chunks[qi],
                                              lse_chunks[qi], dout_chunks[qi], diagonal, scale)
            dq_chunks[qi].add_(dq_b)
            dkv[0][:, :, keys] += dk_b
            dkv[1][:, :, keys] += dv_b
        # 3. Pass the accumulator on with its shard (the last one goes home: step 4).
        if pending:
            _wait(pending + _pass_on(dkv, dkv_next, rank, world, group))
            kv, kv_next, dkv, dkv_next = kv_next, kv, dkv_next, dkv
    # 4. After the last step rank r holds rank r+1's accumulator: one hop brings each home.
    if world > 1:
        _wait(_pass_on(dkv, dkv_next, rank, world, group))
        dkv = dkv_next
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """ring_attention with its backward: the forward saves its shards, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, seq_len, is_causal, scale, block, group):
        out, lse = _ring_forward(q, k, v, seq_len, is_causal, scale, block, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (seq_len, is_causal, scale, block, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout.contiguous(), *ctx.args)
        return dq, dk, dv, None, None, None, None, None


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
