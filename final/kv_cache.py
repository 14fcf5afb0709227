"""A KV cache for generation: the keys and values of every token a sequence has seen, kept so that
each new token attends to them without recomputing them.

    cache = KVCache.for_model(model, batch=B, max_len=S + new_tokens)
    start = cache.append(n)              # n new tokens per sequence go to positions start .. start + n - 1
    cache.write(layer, slice(start, start + n), kv)   # kv [2, B, H, n, D]: the new tokens' K and V of one layer
    cache.keys(layer), cache.values(layer)   # [B, H, max_len, D], contiguous (what decode.attention reads)
    cache.lengths                        # [B] int32 on the cache's device: keys held per sequence
    cache.page_table                     # None, or [B, pages] int32 for a paged cache (page_size=...)

One preallocated tensor kv [layers, 2, B, H, max_len, D] in the model's dtype: nothing is allocated
or copied as the sequences grow, and kv[layer, 0] is the contiguous [B, H, max_len, D] block that
phase5_fused.decode.attention takes.

Paged (page_size given): kv [layers, 2, num_pages, H, page_size, D], a pool of pages, and
page_table [B, pages per sequence] int32: token t of sequence b lives in physical page
page_table[b, t // page_size] at slot t % page_size (decode.attention's page_table argument). The
pages are handed out once, in a shuffled order, so that no sequence's pages are adjacent and every
read really goes through the table; handing them out as sequences grow (and sharing a common
prompt's pages) is what a server adds on top (final/README.md's exercises).

Every sequence of the batch holds the same number of tokens (prompts of one length; ragged prompts
are an exercise of final/README.md), so the length is known on the host (`length`, a Python int: no
GPU sync to learn it) and mirrored on the device (`lengths`, the kernel's cache_lengths).
"""

from __future__ import annotations

import math

import torch

from phase5_fused.decode import PAGE_SIZES


class KVCache:
    """Keys and values of `layers` layers for `batch` sequences of up to `max_len` tokens
    (contiguous, or in pages of page_size tokens)."""

    def __init__(self, layers: int, batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cuda", page_size: int | None = None):
        for name, value in (("layers", layers), ("batch", batch), ("heads", heads), ("max_len", max_len),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if page_size is not None and (isinstance(page_size, bool) or page_size not in PAGE_SIZES):
            raise ValueError(f"page_size must be None (contiguous) or one of decode.PAGE_SIZES {PAGE_SIZES}, "
                             f"got {page_size!r}")
        self.layers, self.batch, self.heads, self.head_dim, self.max_len = layers, batch, heads, head_dim, max_len
        self.page_size, self.page_table = page_size, None
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.positions = torch.arange(max_len, device=device)  # sliced for each step's position embedding
        self.length = 0
        if page_size is None:
            self.kv = torch.empty(layers, 2, batch, heads, max_len, head_dim, dtype=dtype, device=device)
            return
        pages = math.ceil(max_len / page_size)  # per sequence
        self.kv = torch.empty(layers, 2, batch * pages, heads, page_size, head_dim, dtype=dtype, device=device)
        shuffled = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0))
        self.page_table = shuffled.view(batch, pages).to(device=device, dtype=torch.int32)
        # Where each token position goes: its physical page per sequence [B, max_len], its slot [max_len]
        self.slot_page = self.page_table.long()[:, self.positions // page_size]
        self.slot = self.positions % page_size

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, page_size: int | None = None) -> "KVCache":
        """A cache shaped for a phase 1 GPT or an OptimizedTransformer, in its dtype and on its device."""
        c = model.config
        weight = model.tok_emb.weight
        return cls(c.n_layer, batch, c.n_head, max_len, c.head_dim, weight.dtype, weight.device, page_size)

    def keys(self, layer: int) -> torch.Tensor:
        """Keys of `layer`, what decode.attention reads: [B, H, max_len, D] (positions >= length hold
        garbage), or paged [num_pages, H, page_size, D] (with page_table)."""
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

    def write(self, layer: int, where, kv: torch.Tensor) -> None:
        """Store the new tokens' K and V (kv [2, B, H, n, D], any strides) of `layer` at positions
        `where`: a slice start:start + n (known on the host), or a tensor of n positions on the
        device (a step captured in a CUDA graph). One copy or scatter kernel for K and V together."""
        if self.page_table is None:  # [2, B, H, max_len, D] at positions `where` of dim 3
            self.kv[layer][:, :, :, where] = kv
        else:  # [2, P, H, page_size, D] indexed by page [B, n] and slot [n]: the value is [B, n, 2, H, D]
            self.kv[layer][:, self.slot_page[:, where], :, self.slot[where]] = kv.permute(1, 3, 0, 2, 4)

    def logical(self, layer: int) -> torch.Tensor:
        """K and V of `layer` in token order, [2, B, H, max_len, D] (a copy when paged; for tests)."""
        if self.page_table is None:
            return self.kv[layer]
        return self.kv[layer][:, self.slot_page, :, self.slot].permute(2, 0, 3, 1, 4)

    def reset(self) -> None:
        """Forget every token (the memory is kept for the next generation)."""
        self.length = 0
        self.lengths.zero_()

    def __repr__(self) -> str:
        paged = f", page_size={self.page_size}" if self.page_size else ""
        return (f"KVCache(layers={self.layers}, batch={self.batch}, heads={self.heads}, max_len={self.max_len}, "
                f"head_dim={self.head_dim}{paged}, dtype={self.kv.dtype}, length={self.length})")
