"""The phase 1 GPT with the course's kernels swapped in: same weights, same logits.

    from phase1_baseline.pytorch_transformer import build_model
    from final.optimized_transformer import OptimizedTransformer
    base = build_model(seed=0, device="cuda")
    fast = OptimizedTransformer.from_baseline(base)                        # FP32
    half = OptimizedTransformer.from_baseline(base, dtype=torch.float16)   # FP16 (or torch.bfloat16)
    logits = fast(idx)                                                     # == base(idx), rel err <= 1e-4

What runs where, per block (the baseline computes x + attn(ln1(x)), then + mlp(ln2(x))):

    step                 FP32 model                              FP16 / BF16 model
    ln1 (block 0 only)   phase 6 layer_norm                      phase 6 layer_norm
    qkv, proj, lm_head   cuBLAS (F.linear), as the baseline      cuBLAS (F.linear)
    attention            final.attention mode "fused" (phase 5)  mode "auto": fused_hopper on an H100
                                                                 (training too), else fused_tc (phase 5)
    residual + ln2       phase 6 add_layer_norm (one pass)       phase 6 add_layer_norm
    mlp                  phase 6 mlp (two 3xTF32 GEMMs, fused     cuBLAS GEMMs + phase 6 gelu (phase 6's
                         bias/GELU/residual epilogues)            GEMMs are FP32 only)
    residual + next ln   phase 6 add_layer_norm (the next block's ln1, or ln_f after the last block)

Every residual add is fused into the LayerNorm that follows it, so no separate add kernel runs.
The attention takes Q/K/V as [B, H, S, D] views of the qkv projection ([B, S, 3, H, D]): the Hopper
kernel reads them in place (its TMA maps carry the strides) and writes O as [B, S, H, D], so merging
the heads back is a view too, as with the baseline's SDPA; the other kernels copy their inputs
contiguous and their output is merged with one copy.
mlp="cublas" runs the FP32 model's MLP on cuBLAS SGEMM too (F.linear, phase 6 gelu, F.linear), for
comparison: phase 6's default GEMM (3xTF32 on tensor cores) is the faster of the two in phase 6's
results, and the benchmark measures both models at its profile shape.

Profiler ranges carry the baseline's names ("attention", "layer_norm", "mlp") so final.benchmark
splits both models' GPU time the same way.

Training: the forward records autograd (callers that only run inference use torch.no_grad()), and
every step above has a backward: the attention's from the phase 5 ops' registered autograd,
LayerNorm (with its residual add), GELU and phase 6's GEMMs from phase 6's backward kernels
(phase6_layernorm_mlp/__init__.py), the rest from PyTorch (F.linear on cuBLAS, embeddings, copies).
With autograd on, phase 6's MLP runs GEMM 1 without its GELU epilogue and the GELU kernel after
it, so that the backward has the pre-activation; with grad off it keeps the fused epilogue.
final.train trains it beside the baseline.

Generation: model.generate(idx, max_new_tokens, temperature=0.0, top_k=None, generator=None) runs
the prompt once through forward(idx, cache) (the prefill: the attention above, and every layer's K
and V stored in a final.kv_cache.KVCache), then one token per sequence per step through the same
forward, whose attention is then phase5_fused.decode's flash-decoding over the cache
(final.generation holds the loop and the sampling, shared with final.generate_benchmark's PyTorch peer).
page_size=N keeps the cache in pages (decode's page table); cuda_graph=True replays the decode steps
from a CUDA graph (decode_step: the position read on the GPU, so one recording serves every step).
Importing this module builds nothing; the extensions are built on the first forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

import phase6_layernorm_mlp as p6
from final import generation
from final.attention import cuda_attention_forward, merge_heads
from final.kv_cache import KVCache
from phase1_baseline.pytorch_transformer import GPT, GPTConfig
from phase5_fused import decode

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MLP_IMPLS = ("phase6", "cublas")
# Devices generate() runs on: the kernels' (a CPU test widens it, with the kernels replaced by PyTorch).
GENERATE_DEVICES = ("cuda",)


class OptimizedTransformer(nn.Module):
    """The phase 1 GPT's modules and parameter names (state dicts load both ways), a faster forward."""

    def __init__(self, config: GPTConfig | None = None, dtype: torch.dtype = torch.float32,
                 mlp: str | None = None):
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {[str(d) for d in DTYPES]}, got {dtype}")
        mlp = mlp or ("phase6" if dtype == torch.float32 else "cublas")
        if mlp not in MLP_IMPLS:
            raise ValueError(f"mlp must be one of {MLP_IMPLS}, got {mlp!r}")
        if mlp == "phase6" and dtype != torch.float32:
            raise ValueError(f"mlp='phase6' runs FP32 only (phase 6's GEMMs); use mlp='cublas' for {dtype}")
        with torch.random.fork_rng(devices=[]):  # the throwaway initial weights leave the caller's RNG alone
            base = GPT(config)  # borrow its modules: same names, so the baseline's state_dict loads as is
        self.config = base.config
        self.tok_emb, self.pos_emb, self.blocks = base.tok_emb, base.pos_emb, base.blocks
        self.ln_f, self.lm_head = base.ln_f, base.lm_head
        self.dtype, self.mlp_impl = dtype, mlp
        # FP16/BF16: auto takes the Hopper kernels on an H100 (forward and backward), the mma.sync
        # kernels elsewhere.
        self.attention_mode = "fused" if dtype == torch.float32 else "auto"
        self.to(dtype).eval()

    @classmethod
    def from_baseline(cls, model: GPT, dtype: torch.dtype = torch.float32, mlp: str | None = None):
        """The same weights as a phase 1 GPT, on its device (converted to dtype)."""
        device = next(model.parameters()).device
        return cls.from_state_dict(model.state_dict(), model.config, dtype, mlp, device)

    @classmethod
    def from_state_dict(cls, state_dict: dict, config: GPTConfig | None = None,
                        dtype: torch.dtype = torch.float32, mlp: str | None = None, device=None):
        """From a phase 1 GPT's state_dict (strict: every parameter must be there)."""
        model = cls(config, dtype, mlp)
        model.load_state_dict(state_dict, strict=True)
        return model.to(device=device, dtype=dtype).eval() if device is not None else model

    # --------------------------------------------------------------------------------------------

    def _attention(self, attn, h: torch.Tensor, layer: int, cache: KVCache | None, where,
                   prefill: bool) -> torch.Tensor:
        """proj(causal attention(qkv(h))): through the unified API without a cache or on an empty one
        (the prefill, which also stores K and V), else decode.attention over the cache. where: the
        new tokens' positions in the cache (KVCache.write)."""
        B, S, C = h.shape
        H = attn.n_head
        qkv = F.linear(h, attn.qkv.weight, attn.qkv.bias).view(B, S, 3, H, C // H)
        if cache is not None:
            cache.write(layer, where, qkv[:, :, 1:].permute(2, 0, 3, 1, 4))  # the new K and V, one copy
        with record_function("attention"):
            if prefill:
                q, k, v = qkv.permute(2, 0, 3, 1, 4)  # [B, H, S, D] views of the projection: no copy here
                out = cuda_attention_forward(q, k, v, mode=self.attention_mode, is_causal=True)
            else:  # the new queries against every cached key (flash-decoding)
                out = decode.attention(qkv[:, :, 0].transpose(1, 2), cache.keys(layer), cache.values(layer),
                                       cache.lengths, page_table=cache.page_table)
        return F.linear(merge_heads(out), attn.proj.weight, attn.proj.bias)

    def _mlp(self, mlp, h: torch.Tensor) -> torch.Tensor:
        if self.mlp_impl == "phase6":
            return p6.mlp(h, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, approximate="tanh")
        return F.linear(p6.gelu(F.linear(h, mlp.fc1.weight, mlp.fc1.bias), "tanh"), mlp.fc2.weight, mlp.fc2.bias)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """idx [B, S] int64 tokens (CUDA) -> logits [B, S, vocab] in the model's dtype.

        With a cache (final.kv_cache.KVCache), idx are the next S tokens of every sequence it holds:
        their K and V are stored at positions cache.length .. cache.length + S - 1 and they attend
        to every cached key. On an empty cache that is the prefill (any S); after it, a step of at
        most decode.MAX_SQ tokens (one, when generating). Inference only (under torch.no_grad())."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, S] tokens, got shape {tuple(idx.shape)}")
        B, S = idx.shape
        if cache is None:
            if S > self.config.max_seq:
                raise ValueError(f"sequence length {S} exceeds max_seq {self.config.max_seq}")
            return self._run(idx, torch.arange(S, device=idx.device), None, None, prefill=True)
        self._check_cache(cache, B, S)
        start = cache.append(S)
        where = slice(start, start + S)
        return self._run(idx, cache.positions[where], cache, where, prefill=start == 0)

    def decode_step(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step, token [B, 1] -> logits [B, 1, vocab], with its position read on the GPU.

        The work of forward(token, cache) after the prefill, but the position comes from
        cache.lengths on the device (advanced there by one) instead of from the host, so nothing in
        it changes from step to step: it can be captured in a CUDA graph and replayed
        (final.generation.CUDAGraphStep). The caller advances cache.length and checks the room
        (generate(cuda_graph=True) does both)."""
        cache.lengths.add_(1)
        position = cache.lengths[:1].long() - 1  # [1]: every sequence is at the same position
        return self._run(token, position, cache, position, prefill=False)

    def _run(self, idx: torch.Tensor, positions: torch.Tensor, cache: KVCache | None, where,
             prefill: bool) -> torch.Tensor:
        """The blocks: idx [B, S] at positions [S] -> logits [B, S, vocab] (forward's body)."""
        x = self.tok_emb(idx) + self.pos_emb(positions)
        blocks = list(self.blocks)
        norms = [b.ln1 for b in blocks[1:]] + [self.ln_f]  # the LayerNorm after each block's MLP
        first = blocks[0].ln1 if blocks else self.ln_f
        with record_function("layer_norm"):
            h = p6.layer_norm(x, first.weight, first.bias, first.eps)
        for layer, (block, next_norm) in enumerate(zip(blocks, norms)):
            a = self._attention(block.attn, h, layer, cache, where, prefill)
            with record_function("layer_norm"):
                h, x = p6.add_layer_norm(a, x, block.ln2.weight, block.ln2.bias, block.ln2.eps)
            with record_function("mlp"):
                m = self._mlp(block.mlp, h)
            with record_function("layer_norm"):
                h, x = p6.add_layer_norm(m, x, next_norm.weight, next_norm.bias, next_norm.eps)
        return F.linear(h, self.lm_head.weight)

    def _check_cache(self, cache: KVCache, B: int, S: int) -> None:
        """The cache fits this model and these tokens (metadata only: no GPU sync)."""
        c = self.config
        if torch.is_grad_enabled() and self.tok_emb.weight.requires_grad:
            raise RuntimeError("forward with a cache is inference only (decode.attention has no backward): "
                               "run it under torch.no_grad(), as generate does")
        dtype = self.tok_emb.weight.dtype
        if (cache.layers, cache.heads, cache.head_dim, cache.kv.dtype) != (c.n_layer, c.n_head, c.head_dim, dtype):
            raise ValueError(f"cache must hold {c.n_layer} layers of {c.n_head} heads of D={c.head_dim} in "
                             f"{dtype} (KVCache.for_model), got {cache!r}")
        if cache.batch != B:
            raise ValueError(f"idx has {B} sequences but the cache holds {cache.batch}")
        if cache.length + S > min(cache.max_len, c.max_seq):
            raise ValueError(f"{S} more tokens after the cache's {cache.length} exceed its max_len={cache.max_len} "
                             f"or the model's max_seq={c.max_seq}")
        if cache.length > 0 and S > decode.MAX_SQ:
            raise ValueError(f"a step after the prefill takes at most decode.MAX_SQ={decode.MAX_SQ} tokens "
                             f"per sequence, got {S}")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, return_logits: bool = False, page_size: int | None = None,
                 cuda_graph: bool = False):
        """idx [B, S] int64 prompts (CUDA) -> [B, S + max_new_tokens] int64: the prompts and what follows.

        The prompt runs once (the prefill, final.attention, writing K and V of every layer into a
        KVCache), then one token per sequence per step (phase5_fused.decode over the cache).
        temperature 0: greedy (argmax); > 0: sampled from softmax(logits / temperature), over the
        top_k most likely tokens if top_k is given, with `generator` (a CUDA torch.Generator) for
        reproducible draws. S + max_new_tokens must not exceed config.max_seq. return_logits: also
        return the logits each new token was chosen from [B, max_new_tokens, vocab]. page_size: keep
        the cache in pages of that many tokens (decode.PAGE_SIZES; None: contiguous). cuda_graph:
        replay the decode steps from a CUDA graph (decode_step, captured after the first step) instead
        of launching their ~50 kernels from Python each time. Every prompt of the batch has the same
        length (ragged prompts: an exercise of final/README.md).
        """
        generation.check_generate_args(idx, max_new_tokens, temperature, top_k, generator, self.config.max_seq)
        if self.config.head_dim not in decode.SUPPORTED_D:
            raise ValueError(f"generate decodes with phase5_fused.decode, which takes head dims "
                             f"{decode.SUPPORTED_D}; this model's is {self.config.head_dim}")
        device = self.tok_emb.weight.device
        if device.type not in GENERATE_DEVICES:
            raise ValueError(f"generate runs the course's CUDA kernels: the model is on {device}, move it to a GPU")
        decode_step = generation.CUDAGraphStep(self.decode_step) if cuda_graph else None
        return generation.generate(self, self.forward, idx, max_new_tokens, temperature, top_k, generator,
                                   return_logits, page_size, decode_step)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, attention={self.attention_mode!r}, mlp={self.mlp_impl!r}"


def build_optimized(seed: int = 0, device="cuda", dtype: torch.dtype = torch.float32, mlp: str | None = None,
                    config: GPTConfig | None = None) -> OptimizedTransformer:
    """The OptimizedTransformer with phase1_baseline.build_model(seed)'s weights."""
    from phase1_baseline.pytorch_transformer import build_model

    return OptimizedTransformer.from_baseline(build_model(seed, device, config=config), dtype, mlp)
