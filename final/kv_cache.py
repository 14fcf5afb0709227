"""A KV cache for generation: the keys and values of every token a sequence has seen, kept so that
each new token attends to them without recomputing them.

    cache = KVCache.for_model(model, batch=B, max_len=S + new_tokens)
    start = cache.append(n)              # n new tokens per sequence go to positions start .. start + n - 1
    cache.write(layer, start, kv)        # kv [2, B, H, n, D]: the new tokens' K and V of one layer
    cache.keys(layer), cache.values(layer)   # [B, H, max_len, D], contiguous (what decode.attention reads)
    cache.lengths                        # [B] int32 on the cache's device: keys held per sequence

One preallocated tensor kv [layers, 2, B, H, max_len, D] in the model's dtype: nothing is allocated
or copied as the sequences grow, and kv[layer, 0] is the contiguous [B, H, max_len, D] block that
phase5_fused.decode.attention takes. Every sequence of the batch holds the same number of tokens
(prompts of one length; ragged prompts are an exercise of final/README.md), so the length is known
on the host (`length`, a Python int: no GPU sync to learn it) and mirrored on the device
(`lengths`, the kernel's cache_lengths).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of `layers` layers for `batch` sequences of up to `max_len` tokens."""

    def __init__(self, layers: int, batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cuda"):
        for name, value in (("layers", layers), ("batch", batch), ("heads", heads), ("max_len", max_len),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.kv = torch.empty(layers, 2, batch, heads, max_len, head_dim, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.positions = torch.arange(max_len, device=device)  # sliced for each step's position embedding
        self.length = 0

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        """A cache shaped for a phase 1 GPT or an OptimizedTransformer, in its dtype and on its device."""
        c = model.config
        weight = model.tok_emb.weight
        return cls(c.n_layer, batch, c.n_head, max_len, c.head_dim, weight.dtype, weight.device)

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    def keys(self, layer: int) -> torch.Tensor:
        """[B, H, max_len, D] keys of `layer` (positions >= length hold garbage)."""
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def append(self, n: int) -> int:
        """Make room for n more tokens per sequence; returns the position of the first of them.
        The device lengths are updated at once (every layer's attention of this step reads them)."""
        if self.length + n > self.max_len:
            raise ValueError(f"the cache holds {self.length} of max_len={self.max_len} tokens per sequence: "
                             f"no room for {n} more")
        start = self.length
        self.length += n
        self.lengths.fill_(self.length)  # a scalar fill: one tiny kernel, no host-device sync
        return start

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """Store the new tokens' K and V (kv [2, B, H, n, D], any strides) of `layer` at positions
        start .. start + n - 1 (one copy kernel for both)."""
        self.kv[layer, :, :, :, start:start + kv.shape[3]].copy_(kv)

    def reset(self) -> None:
        """Forget every token (the memory is kept for the next generation)."""
        self.length = 0
        self.lengths.zero_()

    def __repr__(self) -> str:
        L, _, B, H, S, D = self.kv.shape
        return (f"KVCache(layers={L}, batch={B}, heads={H}, max_len={S}, head_dim={D}, dtype={self.kv.dtype}, "
                f"length={self.length})")
