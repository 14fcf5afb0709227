"""A GPT-style decoder in plain PyTorch: the baseline every later phase is measured against.

4 layers, hidden 512, 8 heads, pre-LayerNorm, MLP 4x with GELU (tanh), byte-level vocabulary.
The forward records autograd like any nn.Module: loss.backward() trains it (final.train does);
callers that only run inference wrap their calls in torch.no_grad(). Causal self-attention is
written as explicit math (QK^T, scale, mask, softmax, AV), each step in its own profiler range so
it shows by name in torch.profiler; `attention="sdpa"` switches to torch's
scaled_dot_product_attention.

Data: synthetic token batches by default; `--text FILE` reads a local text file at byte level.
`python -m phase1_baseline.pytorch_transformer [--text FILE] [--batch 8] [--seq 256]` runs one
forward and prints the loss of the untrained model on the batch (about ln(256) = 5.5).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

ATTENTION_IMPLS = ("math", "sdpa")


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    max_seq: int = 4096
    n_layer: int = 4
    hidden: int = 512
    n_head: int = 8
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head


def causal_attention_math(q, k, v):
    """softmax(q k^T / sqrt(D) + causal mask) v, one named step at a time (q, k, v: [B, H, S, D])."""
    S = q.shape[-2]
    with record_function("attention.qk"):
        scores = q @ k.transpose(-1, -2)
    with record_function("attention.scale"):
        scores = scores * (1.0 / math.sqrt(q.shape[-1]))
    with record_function("attention.mask"):
        hidden = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    with record_function("attention.softmax"):
        p = torch.softmax(scores, dim=-1)
    with record_function("attention.av"):
        return p @ v


def causal_attention_sdpa(q, k, v):
    with record_function("attention.sdpa"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attention: str = "math"):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.set_attention(attention)

    def set_attention(self, attention) -> None:
        """'math', 'sdpa', or any callable f(q, k, v) -> out on [B, H, S, D] tensors (causal)."""
        if callable(attention):
            self.attention_fn = attention
        elif attention in ATTENTION_IMPLS:
            self.attention_fn = causal_attention_math if attention == "math" else causal_attention_sdpa
        else:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS} or a callable, got {attention!r}")

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        # [B, S, C] -> [B, H, S, D]
        q, k, v = (t.view(B, S, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        with record_function("attention"):
            out = self.attention_fn(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, S, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden, config.mlp_ratio * config.hidden)
        self.fc2 = nn.Linear(config.mlp_ratio * config.hidden, config.hidden)

    def forward(self, x):
        with record_function("mlp"):
            return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm Transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig, attention: str = "math"):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config, attention)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)

    def forward(self, x):
        with record_function("layer_norm"):
            h = self.ln1(x)
        x = x + self.attn(h)
        with record_function("layer_norm"):
            h = self.ln2(x)
        return x + self.mlp(h)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None, attention: str = "math"):
        super().__init__()
        self.config = config or GPTConfig()
        c = self.config
        self.tok_emb = nn.Embedding(c.vocab_size, c.hidden)
        self.pos_emb = nn.Embedding(c.max_seq, c.hidden)
        self.blocks = nn.ModuleList(Block(c, attention) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        self.apply(_init_weights)

    def set_attention(self, attention) -> None:
        for block in self.blocks:
            block.attn.set_attention(attention)

    def forward(self, idx):
        """idx [B, S] int64 tokens -> logits [B, S, vocab]."""
        B, S = idx.shape
        if S > self.config.max_seq:
            raise ValueError(f"sequence length {S} exceeds max_seq {self.config.max_seq}")
        pos = torch.arange(S, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        with record_function("layer_norm"):
            x = self.ln_f(x)
        return self.lm_head(x)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, S, vocab] against the next tokens targets [B, S], in FP32
    (or float64 for float64 logits)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _init_weights(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(seed: int = 0, device="cpu", attention: str = "math", config: GPTConfig | None = None) -> GPT:
    """The baseline model with weights drawn from `seed` (the same weights on every device)."""
    torch.manual_seed(seed)
    return GPT(config, attention).to(device).eval()


def synthetic_batch(batch: int, seq: int, vocab: int = 256, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def text_batch(path: str | Path, batch: int, seq: int, seed: int = 0, device="cpu"):
    """`batch` windows of `seq` bytes from a local text file (e.g. WikiText-2), at random offsets."""
    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
    if data.numel() <= seq:
        raise ValueError(f"{path} has {data.numel()} bytes, fewer than seq + 1 = {seq + 1}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq, (batch,), generator=gen)
    return torch.stack([data[s:s + seq] for s in starts.tolist()]).long().to(device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="one forward of the baseline GPT")
    parser.add_argument("--text", help="a local text file to read at byte level (default: synthetic tokens)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--attention", choices=ATTENTION_IMPLS, default="math")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(device=device, attention=args.attention)
    idx = (text_batch(args.text, args.batch, args.seq + 1, device=device) if args.text
           else synthetic_batch(args.batch, args.seq + 1, device=device))
    with torch.no_grad():
        logits = model(idx[:, :-1])
    loss = next_token_loss(logits, idx[:, 1:])
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f} M parameters on {device}; logits {tuple(logits.shape)}; loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
