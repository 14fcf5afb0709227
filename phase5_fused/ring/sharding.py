"""How a sequence is cut across the ranks of a ring, and put back together.

The sequence axis (dim 2 of [B, H, S, D]) is padded with zeros to a multiple of the number of
pieces, then cut:
- non-causal: `world` contiguous pieces, rank r holds piece r;
- causal (zig-zag): 2 * world chunks, rank r holds chunk r and chunk 2 * world - 1 - r, so every
  rank holds one early and one late chunk and does the same amount of causal work.
Padding sits at the end of the sequence. Causal, no real query sees a padded key (a padded key's
position is after every real query's); non-causal, the ring cuts padded keys off (valid_keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pieces(world: int, is_causal: bool) -> int:
    """How many equal pieces the padded sequence is cut into."""
    return 2 * world if is_causal else world


def padded_length(seq_len: int, world: int, is_causal: bool) -> int:
    n = pieces(world, is_causal)
    return -(-seq_len // n) * n


def chunk_ids(rank: int, world: int, is_causal: bool) -> tuple[int, ...]:
    """The pieces rank holds, in the order they sit in its local shard."""
    return (rank, 2 * world - 1 - rank) if is_causal else (rank,)


def shard(x: torch.Tensor, rank: int, world: int, is_causal: bool) -> torch.Tensor:
    """Rank's local shard of x [B, H, S, D] (padded, contiguous)."""
    S = x.shape[2]
    n = pieces(world, is_causal)
    x = F.pad(x, (0, 0, 0, padded_length(S, world, is_causal) - S))
    chunks = x.chunk(n, dim=2)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world, is_causal)], dim=2).contiguous()


def unshard(shards: list[torch.Tensor], seq_len: int, is_causal: bool) -> torch.Tensor:
    """The full sequence [B, H, seq_len, D] from every rank's shard (rank order)."""
    world = len(shards)
    chunks: list[torch.Tensor | None] = [None] * pieces(world, is_causal)
    for rank, local in enumerate(shards):
        ids = chunk_ids(rank, world, is_causal)
        for i, piece in zip(ids, local.chunk(len(ids), dim=2)):
            chunks[i] = piece
    return torch.cat(chunks, dim=2)[:, :, :seq_len]


def valid_keys(chunk: int, chunk_len: int, seq_len: int) -> int:
    """How many keys of a piece are real (the rest is the end padding)."""
    return max(0, min(chunk_len, seq_len - chunk * chunk_len))
