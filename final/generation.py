"""Text generation with a KV cache: the loop, the sampling, the argument checks, and two models' steps.

    from final.generation import generate, torch_step
    tokens = generate(base, functools.partial(torch_step, base), idx, 20)   # the phase 1 GPT, plain PyTorch
    tokens = fast.generate(idx, 20)          # OptimizedTransformer.generate: the same loop, the course's kernels

A step is step(tokens [B, n], cache) -> logits [B, n, vocab]: it runs the n new tokens of every
sequence, writes their K and V into the cache (final.kv_cache.KVCache) and attends against every
key the cache holds. generate() calls it twice over:
    prefill   the whole prompt [B, S] in one step (S tokens per sequence, causal attention among them)
    decode    then one step per new token: [B, 1], whose query attends to the S + i cached keys
The token after the prompt comes from the prefill's last logits; each decode step gives the next.

torch_step is the phase 1 GPT's step in plain PyTorch (its own modules, torch SDPA against slices
of the cache): final.generate_benchmark's peer. greedy_without_cache is the definition the tests
hold both to: re-run the whole sequence for every new token, no cache, argmax of the last logits.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable

import torch
import torch.nn.functional as F

from final.kv_cache import KVCache

Step = Callable[[torch.Tensor, KVCache], torch.Tensor]


# ------------------------------------------------------------------------------------------------
# Arguments


def check_generate_args(idx, max_new_tokens, temperature, top_k, generator, max_seq: int) -> None:
    """The arguments' types and ranges, from metadata only (so it runs on a CPU before any GPU work).
    Raises TypeError / ValueError naming the argument."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a tensor of token ids [B, S], got {type(idx).__name__}")
    if idx.dim() != 2 or idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError(f"idx must be [B, S] token ids with B >= 1 and S >= 1, got shape {tuple(idx.shape)}")
    if idx.dtype != torch.int64:
        raise TypeError(f"idx must be int64 token ids, got {str(idx.dtype).replace('torch.', '')}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    total = idx.shape[1] + max_new_tokens
    if total > max_seq:
        raise ValueError(f"max_new_tokens={max_new_tokens} after a prompt of {idx.shape[1]} tokens makes "
                         f"{total} tokens, more than the model's max_seq={max_seq}")


def check_generate_devices(idx, generator, device: torch.device, vocab_size: int) -> None:
    """idx (and the generator) on the model's device, and every token id in [0, vocab_size): the one
    check that reads values (a GPU sync, once per generate call, before any step)."""
    if idx.device != device:
        raise ValueError(f"idx must be on the model's device {device}, got {idx.device}")
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator must be a {device.type} generator (the model's device), "
                         f"got one on {generator.device}")
    low, high = (int(t) for t in torch.aminmax(idx))
    if low < 0 or high >= vocab_size:
        raise ValueError(f"idx holds token ids in [{low}, {high}], outside the vocabulary [0, {vocab_size})")


# ------------------------------------------------------------------------------------------------
# The loop


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, vocab] -> the next tokens [B, 1] int64: argmax for temperature 0 (the first of
    equal maxima), else a draw from softmax(logits / temperature) over the top_k largest (FP32)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model, step: Step, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, generator: torch.Generator | None = None, return_logits: bool = False,
             page_size: int | None = None, decode_step: Step | None = None):
    """idx [B, S] int64 prompts -> [B, S + max_new_tokens]: prefill, then one decode step per token.

    model: a phase 1 GPT or an OptimizedTransformer (its config, dtype and device size the cache);
    step: its step (module docstring). return_logits: also return the logits each new token was
    chosen from, [B, max_new_tokens, vocab] in the model's dtype. page_size: a paged cache
    (KVCache), for a step that reads one. decode_step: the step of the decode phase, if not `step`
    (a CUDAGraphStep).
    """
    config = model.config
    check_generate_args(idx, max_new_tokens, temperature, top_k, generator, config.max_seq)
    check_generate_devices(idx, generator, model.tok_emb.weight.device, config.vocab_size)
    B, S = idx.shape
    tokens, chosen_from = [idx], []
    if max_new_tokens > 0:
        # The last new token is returned, never fed back: the cache needs room for the others only.
        cache = KVCache.for_model(model, B, S + max_new_tokens - 1, page_size)
        decode_step = decode_step or step
        logits = step(idx, cache)[:, -1]                              # prefill: the whole prompt at once
        for i in range(max_new_tokens):
            token = next_token(logits, temperature, top_k, generator)
            tokens.append(token)
            chosen_from.append(logits)
            if i + 1 < max_new_tokens:
                logits = decode_step(token, cache)[:, -1]             # decode: one token per sequence
    out = torch.cat(tokens, dim=1)
    if not return_logits:
        return out
    empty = idx.new_empty((B, 0, config.vocab_size), dtype=model.tok_emb.weight.dtype)
    return out, torch.stack(chosen_from, dim=1) if chosen_from else empty


class CUDAGraphStep:
    """A decode step replayed from a CUDA graph: called as step(token, cache) like any step.

    device_step(token [B, 1], cache) -> logits must read its position from cache.lengths on the GPU
    and advance it there (OptimizedTransformer.decode_step), so that one recording serves every
    step. The first call runs it eagerly on a side stream (a real step, which also loads and warms up
    what capture cannot: the extensions, cuBLAS's handles), then records it reading a static token
    buffer; each later call copies the token in and replays the ~50 kernels with one launch. The
    host's cache.length is advanced here. One object serves one cache (the graph holds its tensors).
    """

    def __init__(self, device_step: Step):
        self.device_step = device_step
        self.graph = self.token = self.logits = None

    def __call__(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if cache.length + 1 > cache.max_len:
            raise ValueError(f"the cache holds {cache.length} of max_len={cache.max_len} tokens per sequence: "
                             "no room for 1 more")
        if self.graph is not None:
            self.token.copy_(token)
            self.graph.replay()
            cache.length += 1
            return self.logits.clone()  # the next replay overwrites self.logits
        self.token = token.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.device_step(self.token, cache)
        torch.cuda.current_stream().wait_stream(side)
        cache.length += 1
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run: the cache is untouched until a replay
            self.logits = self.device_step(self.token, cache)
        return logits


# ------------------------------------------------------------------------------------------------
# The phase 1 GPT's step, and the definition without a cache


def torch_step(model, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One step of a phase 1 GPT with a KV cache, in plain PyTorch: its modules, torch SDPA.

    Same computation as the GPT's forward (phase1_baseline.pytorch_transformer), except that the
    keys and values come from the cache: the new tokens' are written there first, then the new
    queries attend to the first `cache.length` of them (bottom-right causal among the new tokens)."""
    if cache.page_table is not None:
        raise ValueError("torch_step reads a contiguous cache (slices of it for SDPA), got a paged one")
    B, S = idx.shape
    H, D = model.config.n_head, model.config.head_dim
    start = cache.append(S)
    x = model.tok_emb(idx) + model.pos_emb(cache.positions[start:start + S])
    for layer, block in enumerate(model.blocks):
        qkv = block.attn.qkv(block.ln1(x)).view(B, S, 3, H, D)
        cache.write(layer, slice(start, start + S), qkv[:, :, 1:].permute(2, 0, 3, 1, 4))  # [2, B, H, S, D]
        q = qkv[:, :, 0].transpose(1, 2)
        k, v = cache.keys(layer)[:, :, :start + S], cache.values(layer)[:, :, :start + S]
        if start == 0:        # prefill: causal among the prompt's tokens
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif S == 1:          # decode: the new token sees every cached key
            out = F.scaled_dot_product_attention(q, k, v)
        else:                 # several new tokens after cached ones: new token i sees keys j <= start + i
            positions = cache.positions[:start + S]
            mask = positions[start:, None] >= positions[None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + block.attn.proj(out.transpose(1, 2).reshape(B, S, H * D))
        x = x + block.mlp(block.ln2(x))
    return model.lm_head(model.ln_f(x))


@torch.no_grad()
def greedy_without_cache(model, idx: torch.Tensor, max_new_tokens: int):
    """Greedy tokens the slow way: the whole sequence through model(seq) for every new token, the
    argmax of its last logits. Returns (tokens [B, S + max_new_tokens], logits [B, max_new_tokens, vocab])."""
    seq = idx
    chosen_from = [model(idx[:, :1])[:, :0]]  # [B, 0, vocab]: the logits' dtype, whatever max_new_tokens
    for _ in range(max_new_tokens):
        logits = model(seq)[:, -1:]
        chosen_from.append(logits)
        seq = torch.cat([seq, logits[:, 0].argmax(dim=-1, keepdim=True)], dim=1)
    return seq, torch.cat(chosen_from, dim=1)
