"""Generation: OptimizedTransformer.generate (prefill through final.attention, decode through
phase5_fused.decode over a KV cache) against the phase 1 GPT generating without a cache.

CPU tests: the argument checks (they run before any GPU work), KVCache, the sampling, the PyTorch
peer's step (final.generation.torch_step) against the no-cache definition, and the whole generate
loop of the OptimizedTransformer with its kernels replaced by PyTorch stand-ins (the cache
bookkeeping, positions and masks, tested before the kernels meet a GPU). Toolkit test (skipped
without nvcc): the cached forward traced on fake CUDA tensors through the real kernels' Python
checks and fake implementations. GPU tests (skipped without a GPU): the real thing.

How tokens are compared. Greedy tokens of two models agree only as long as no step is a near tie:
where the top two logits differ by less than the models' rounding, either token is right. So:
  - every dtype: the tokens are the argmax of the logits generate returns, and those logits match
    the phase 1 GPT's (FP32, on the same generated prefix, one causal forward: the logits a no-cache
    step would give) within MODEL_TOLERANCE, the bound final/test_final.py holds the forward to;
  - FP32 also token for token against greedy_without_cache (the phase 1 GPT re-run on the whole
    sequence for each token): identical, or diverging first at a step whose top two reference logits
    differ by no more than twice the largest logit error measured there (a near tie, reported).
"""

from __future__ import annotations

import copy
import functools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from final import generation as G
from final.kv_cache import KVCache
from final.test_final import MODEL_TOLERANCE
from phase1_baseline.pytorch_transformer import GPTConfig, build_model
from phase5_fused import decode
from utils import reference
from utils.testing import new_seed, rel_error, requires_gpu, requires_toolkit

# hidden 128 / 2 heads = D 64 (decode.SUPPORTED_D); a max_seq small enough to reach.
SMALL = GPTConfig(max_seq=64, n_layer=2, hidden=128, n_head=2)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _optimized(base, dtype=torch.float32):
    from final.optimized_transformer import OptimizedTransformer

    return OptimizedTransformer.from_baseline(base, dtype=dtype)


def _float64(base):
    """A float64 copy of a phase 1 GPT (the reference logits)."""
    return copy.deepcopy(base).double()


def _prompt(B, S, vocab=256, device="cuda", seed=None):
    gen = torch.Generator().manual_seed(new_seed() if seed is None else seed)
    return torch.randint(0, vocab, (B, S), generator=gen).to(device)


# ------------------------------------------------------------------------------------------------
# CPU: argument checks (before any GPU work)


@pytest.fixture(scope="module")
def cpu_model():
    return _optimized(build_model(0, config=SMALL))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"idx": [[1, 2]]}, TypeError, "idx must be a tensor"),
    ({"idx": torch.zeros(5, dtype=torch.long)}, ValueError, r"idx must be \[B, S\]"),
    ({"idx": torch.zeros(2, 0, dtype=torch.long)}, ValueError, r"idx must be \[B, S\].*S >= 1"),
    ({"idx": torch.zeros(2, 3, dtype=torch.int32)}, TypeError, "idx must be int64"),
    ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be an integer >= 0"),
    ({"max_new_tokens": 2.0}, ValueError, "max_new_tokens must be an integer"),
    ({"max_new_tokens": True}, ValueError, "max_new_tokens must be an integer"),
    ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, ValueError, "temperature must be a finite number"),
    ({"temperature": "1"}, ValueError, "temperature must be"),
    ({"top_k": 0}, ValueError, "top_k must be None or an integer >= 1"),
    ({"top_k": 3.0}, ValueError, "top_k must be"),
    ({"top_k": True}, ValueError, "top_k must be"),
    ({"generator": 0}, TypeError, "generator must be a torch.Generator"),
    ({"max_new_tokens": 48}, ValueError, "max_new_tokens=48 after a prompt of 17 tokens makes 65 tokens, "
                                          "more than the model's max_seq=64"),
])
def test_bad_arguments_are_named_before_any_gpu_work(cpu_model, kwargs, error, match):
    args = {"idx": torch.zeros(3, 17, dtype=torch.long), "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        cpu_model.generate(**args)


def test_a_cpu_model_is_refused_after_the_arguments(cpu_model):
    with pytest.raises(ValueError, match="CUDA kernels: the model is on cpu"):
        cpu_model.generate(torch.zeros(3, 17, dtype=torch.long), 47)  # reaches max_seq exactly: accepted


def test_unsupported_head_dim_is_refused():
    from final.optimized_transformer import OptimizedTransformer

    model = OptimizedTransformer(GPTConfig(max_seq=32, n_layer=1, hidden=96, n_head=2))  # D = 48
    with pytest.raises(ValueError, match=re.escape(f"head dims {decode.SUPPORTED_D}; this model's is 48")):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 2)


def test_device_and_value_checks():
    base = build_model(0, config=SMALL)
    step = functools.partial(G.torch_step, base)
    idx = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"idx holds token ids in \[0, 256\], outside the vocabulary \[0, 256\)"):
        G.generate(base, step, torch.cat([idx, torch.full((2, 1), 256)], dim=1), 1)
    with pytest.raises(ValueError, match=r"idx holds token ids in \[-1"):
        G.generate(base, step, idx - 1, 1)
    with pytest.raises(ValueError, match="idx must be on the model's device cpu, got meta"):
        G.generate(base, step, idx.to("meta"), 1)


# ------------------------------------------------------------------------------------------------
# CPU: KVCache and sampling


def test_kv_cache_append_write_and_bounds():
    cache = KVCache(layers=2, batch=3, heads=2, max_len=6, head_dim=4, device="cpu")
    assert cache.keys(1).shape == (3, 2, 6, 4) and cache.keys(1).is_contiguous() and cache.values(0).is_contiguous()
    assert cache.append(4) == 0 and cache.length == 4 and cache.lengths.tolist() == [4, 4, 4]
    kv = torch.randn(2, 3, 2, 4, 4)
    cache.write(1, slice(0, 4), kv)
    assert cache.append(2) == 4 and cache.lengths.dtype == torch.int32 and cache.lengths.tolist() == [6, 6, 6]
    new = torch.randn(3, 1, 2, 2, 4).permute(1, 0, 2, 3, 4)[:, :, :, :1].expand(2, 3, 2, 2, 4)  # any strides
    cache.write(1, slice(4, 6), new)
    assert torch.equal(cache.keys(1)[:, :, :4], kv[0]) and torch.equal(cache.values(1)[:, :, :4], kv[1])
    assert torch.equal(cache.keys(1)[:, :, 4:], new[0]) and torch.equal(cache.values(1)[:, :, 4:], new[1])
    with pytest.raises(ValueError, match="holds 6 of max_len=6 tokens per sequence: no room for 1 more"):
        cache.append(1)
    cache.reset()
    assert cache.length == 0 and cache.lengths.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        KVCache(1, 1, 1, 0, 4, device="cpu")


def test_paged_kv_cache_holds_what_the_contiguous_one_holds():
    flat = KVCache(layers=2, batch=3, heads=2, max_len=40, head_dim=4, device="cpu")
    paged = KVCache(layers=2, batch=3, heads=2, max_len=40, head_dim=4, device="cpu", page_size=16)
    assert paged.kv.shape == (2, 2, 9, 2, 16, 4) and paged.keys(1).shape == (9, 2, 16, 4)
    assert paged.page_table.dtype == torch.int32 and paged.page_table.shape == (3, 3)
    assert sorted(paged.page_table.flatten().tolist()) == list(range(9))      # every page once
    assert not torch.equal(paged.page_table.flatten(), torch.arange(9, dtype=torch.int32))  # shuffled
    for cache in (flat, paged):
        cache.kv.fill_(float("nan"))
    for n in (17, 1, 15, 1):  # across page boundaries
        kv = torch.randn(2, 3, 2, n, 4).transpose(3, 4).contiguous().transpose(3, 4)  # any strides
        for cache in (flat, paged):
            start = cache.append(n)
            if n == 1:  # a position tensor, as a step captured in a CUDA graph gives
                cache.write(1, torch.tensor([start]), kv)
            else:
                cache.write(1, slice(start, start + n), kv)
    assert paged.length == 34 and paged.lengths.tolist() == [34] * 3
    assert torch.equal(paged.logical(1)[..., :34, :], flat.logical(1)[..., :34, :])
    assert torch.isnan(paged.logical(1)[..., 34:, :]).all() and torch.isnan(paged.logical(0)).all()
    with pytest.raises(ValueError, match=r"page_size must be None \(contiguous\) or one of decode.PAGE_SIZES"):
        KVCache(1, 1, 1, 8, 4, device="cpu", page_size=8)
    with pytest.raises(ValueError, match="reads a contiguous cache"):
        G.torch_step(build_model(0, config=SMALL), torch.zeros(3, 1, dtype=torch.long),
                     KVCache.for_model(build_model(0, config=SMALL), 3, 8, page_size=16))


def test_kv_cache_for_model_takes_its_shape_dtype_and_device():
    cache = KVCache.for_model(build_model(0, config=SMALL).to(torch.bfloat16), batch=2, max_len=10)
    assert cache.kv.shape == (2, 2, 2, 2, 10, 64) and cache.kv.dtype == torch.bfloat16
    assert cache.positions.tolist() == list(range(10))


def test_next_token_greedy_top_k_and_reproducible_draws():
    logits = torch.randn(4, 256, dtype=torch.float64)
    greedy = G.next_token(logits)
    assert greedy.shape == (4, 1) and torch.equal(greedy[:, 0], logits.argmax(-1))
    draw = functools.partial(G.next_token, logits, 1.0)
    assert torch.equal(draw(top_k=1, generator=torch.Generator().manual_seed(1)), greedy)
    first = draw(generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, draw(generator=torch.Generator().manual_seed(7)))
    top3 = logits.topk(3, dim=-1).indices
    for seed in range(20):
        token = draw(top_k=3, generator=torch.Generator().manual_seed(seed))
        assert bool((token == top3).any(dim=-1).all())
    # a low temperature concentrates the draws on the argmax, a high one spreads them
    gen = torch.Generator().manual_seed(3)
    cold = torch.cat([G.next_token(logits, 1e-3, generator=gen) for _ in range(10)], dim=1)
    hot = torch.cat([G.next_token(logits, 100.0, generator=gen) for _ in range(50)], dim=1)
    assert bool((cold == greedy).all()) and not bool((hot == greedy).all())


# ------------------------------------------------------------------------------------------------
# CPU: the loop, with the phase 1 GPT's PyTorch step and with the optimized model's stand-ins


def assert_greedy_tokens_match(tokens, ref_tokens, ref_logits, S, tol):
    """tokens == ref_tokens, or the first difference is at a near tie of the reference: its top two
    logits closer than 2 * tol * ||logits|| (what two models within relative error tol of each other
    may swap). ref_logits [B, steps, vocab]: the reference's logits at each of its steps."""
    differs = tokens[:, S:] != ref_tokens[:, S:]
    if not differs.any():
        return
    b, t = (int(i) for i in torch.nonzero(differs)[0])
    row = ref_logits[b, t].double()
    top2 = row.topk(2).values
    gap, bound = float(top2[0] - top2[1]), 2 * tol * float(row.norm())
    assert gap <= bound, (f"sequence {b} differs first at new token {t}, where the reference's top two logits "
                          f"differ by {gap:.2e}, more than {bound:.2e}: not a near tie")
    warnings.warn(f"greedy tokens diverge at a near tie (sequence {b}, new token {t}, gap {gap:.1e} <= {bound:.1e})")


def check_against_baseline(base, tokens, logits, S, N, dtype, ref_tokens=None):
    """The module docstring's checks: tokens are the argmax of their logits, which match the phase 1
    GPT's logits on the same prefix (float64); FP32 (ref_tokens given) token for token too."""
    B = tokens.shape[0]
    assert tokens.shape == (B, S + N) and tokens.dtype == torch.int64
    assert logits.shape == (B, N, base.config.vocab_size) and logits.dtype == dtype
    assert torch.isfinite(logits).all()
    assert bool((tokens[:, S:] == logits.argmax(-1)).all()), "generated tokens are not the argmax of their logits"
    with torch.no_grad():
        ref = _float64(base)(tokens[:, :-1])[:, S - 1:]  # the logits a no-cache step gives each new token
    err = rel_error(logits, ref)
    assert err <= MODEL_TOLERANCE[dtype], f"logits rel error {err:.2e} > {MODEL_TOLERANCE[dtype]:.0e} ({dtype})"
    if ref_tokens is not None:
        assert_greedy_tokens_match(tokens, *ref_tokens, S, MODEL_TOLERANCE[dtype])


@pytest.mark.parametrize("B,S,N", [(1, 1, 20), (3, 17, 20), (2, 30, 1)])
def test_torch_step_peer_matches_greedy_without_cache(B, S, N):
    base = build_model(0, config=SMALL)
    idx = _prompt(B, S, device="cpu")
    tokens, logits = G.generate(base, functools.partial(G.torch_step, base), idx, N, return_logits=True)
    check_against_baseline(base, tokens, logits, S, N, torch.float32, G.greedy_without_cache(base, idx, N))


def test_torch_step_several_new_tokens_after_the_prefill():
    """A step of several tokens on a filled cache (bottom-right causal) gives the forward's logits."""
    base = build_model(0, config=SMALL)
    idx = _prompt(2, 20, device="cpu")
    cache = KVCache.for_model(base, 2, 20)
    with torch.no_grad():
        parts = [G.torch_step(base, idx[:, :13], cache), G.torch_step(base, idx[:, 13:], cache)]
        ref = base(idx)
    assert cache.length == 20
    assert rel_error(torch.cat(parts, dim=1), ref) <= 1e-5


def _stand_ins(monkeypatch):
    """Replace the optimized model's kernels with PyTorch / utils.reference, so its generate runs on CPU."""
    import phase6_layernorm_mlp as p6
    from final import optimized_transformer as OT

    monkeypatch.setattr(OT, "GENERATE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(p6, "layer_norm", lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps))

    def add_layer_norm(x, residual, w, b, eps):
        total = x + residual
        return F.layer_norm(total, x.shape[-1:], w, b, eps), total

    monkeypatch.setattr(p6, "add_layer_norm", add_layer_norm)
    monkeypatch.setattr(p6, "gelu", lambda x, approximate: F.gelu(x, approximate=approximate))
    monkeypatch.setattr(p6, "mlp", lambda x, w1, b1, w2, b2, approximate: F.linear(
        F.gelu(F.linear(x, w1, b1), approximate=approximate), w2, b2))

    def prefill(q, k, v, mode, is_causal):
        assert is_causal and q.shape == k.shape
        return reference.attention(q, k, v, is_causal=True).to(q.dtype)

    def decode_attention(q, k_cache, v_cache, cache_lengths, page_table=None):
        assert k_cache.is_contiguous() and cache_lengths.dtype == torch.int32 and q.shape[2] <= decode.MAX_SQ
        return reference.decode_attention(q, k_cache, v_cache, cache_lengths, page_table=page_table).to(q.dtype)

    monkeypatch.setattr(OT, "cuda_attention_forward", prefill)
    monkeypatch.setattr(decode, "attention", decode_attention)


@pytest.mark.parametrize("B,S,N", [(1, 1, 20), (3, 17, 20), (3, 17, 47), (2, 64 - 1, 1)])
def test_optimized_generate_loop_on_cpu_with_stand_in_kernels(monkeypatch, B, S, N):
    _stand_ins(monkeypatch)
    base = build_model(0, config=SMALL)
    fast = _optimized(base)
    idx = _prompt(B, S, device="cpu")
    tokens, logits = fast.generate(idx, N, return_logits=True)
    check_against_baseline(base, tokens, logits, S, N, torch.float32, G.greedy_without_cache(base, idx, N))
    assert torch.equal(tokens[:, :S], idx)


def test_forward_with_a_cache_is_inference_only():
    fast = _optimized(build_model(0, config=SMALL))
    with pytest.raises(RuntimeError, match="inference only.*torch.no_grad"):
        fast(torch.zeros(1, 3, dtype=torch.long), KVCache.for_model(fast, 1, 4))


@pytest.mark.parametrize("page_size", [16, 32])
def test_optimized_generate_with_a_paged_cache_on_cpu_with_stand_in_kernels(monkeypatch, page_size):
    _stand_ins(monkeypatch)
    base = build_model(0, config=SMALL)
    fast = _optimized(base)
    idx = _prompt(3, 17, device="cpu")
    tokens, logits = fast.generate(idx, 30, return_logits=True, page_size=page_size)
    check_against_baseline(base, tokens, logits, 17, 30, torch.float32, G.greedy_without_cache(base, idx, 30))


@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_step_with_its_position_on_the_device_on_cpu_with_stand_in_kernels(monkeypatch, page_size):
    """decode_step (what generate(cuda_graph=True) records) run eagerly: the same tokens and logits."""
    _stand_ins(monkeypatch)
    base = build_model(0, config=SMALL)
    fast = _optimized(base)
    idx = _prompt(3, 17, device="cpu")

    def eager_decode_step(token, cache):  # what CUDAGraphStep does around each replay
        logits = fast.decode_step(token, cache)
        cache.length += 1
        assert cache.lengths.tolist() == [cache.length] * 3
        return logits

    with torch.no_grad():
        tokens, logits = G.generate(fast, fast.forward, idx, 25, return_logits=True, page_size=page_size,
                                    decode_step=eager_decode_step)
    check_against_baseline(base, tokens, logits, 17, 25, torch.float32, G.greedy_without_cache(base, idx, 25))


@torch.no_grad()
def test_optimized_forward_with_cache_on_cpu_with_stand_in_kernels(monkeypatch):
    """Prefill, a step of 5 tokens (bottom-right causal in decode.attention), then one: the forward's logits;
    and the errors of a cache that does not fit."""
    _stand_ins(monkeypatch)
    base = build_model(0, config=SMALL)
    fast = _optimized(base)
    idx = _prompt(2, 23, device="cpu")
    cache = KVCache.for_model(fast, 2, 23)
    parts = [fast(idx[:, :17], cache), fast(idx[:, 17:22], cache), fast(idx[:, 22:], cache)]
    ref = base(idx)
    assert rel_error(torch.cat(parts, dim=1), ref) <= 1e-5
    with pytest.raises(ValueError, match="1 more tokens after the cache's 23 exceed its max_len=23"):
        fast(idx[:, :1], cache)
    cache.reset()
    fast(idx[:, :1], cache)
    with pytest.raises(ValueError, match=f"at most decode.MAX_SQ={decode.MAX_SQ} tokens"):
        fast(idx[:, :decode.MAX_SQ + 1], cache)
    with pytest.raises(ValueError, match="idx has 1 sequences but the cache holds 2"):
        fast(idx[:1, :1], cache)
    with pytest.raises(ValueError, match="cache must hold 2 layers of 2 heads of D=64 in torch.float32"):
        fast(idx[:, :1], KVCache(2, 2, 2, 8, 64, torch.float16, "cpu"))


def test_max_new_tokens_zero_returns_the_prompt(monkeypatch):
    _stand_ins(monkeypatch)
    fast = _optimized(build_model(0, config=SMALL))
    idx = _prompt(3, 9, device="cpu")
    tokens, logits = fast.generate(idx, 0, return_logits=True)
    assert torch.equal(tokens, idx) and tokens.data_ptr() != idx.data_ptr() and logits.shape == (3, 0, 256)


def test_benchmark_without_a_gpu_measures_nothing(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    from final import generate_benchmark

    assert generate_benchmark.main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Toolkit: the cached forward on fake CUDA tensors (the real kernels' Python checks and fake impls)


@requires_toolkit
@pytest.mark.compile
@torch.no_grad()
def test_cached_forward_traces_on_fake_cuda_tensors(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(decode, "sm_count", lambda device_index: 132)  # an H100's (no GPU to ask)
    monkeypatch.setattr(decode, "smem_per_block", lambda device_index: 227 * 1024)  # likewise
    models = {dt: _optimized(build_model(0, config=SMALL), dt) for dt in DTYPES}
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")  # data_ptr of a fake tensor (the phase 5 alignment check)
        idx = torch.zeros(3, 37, dtype=torch.long, device="cuda")
        for dt, model in models.items():
            model = model.to("cuda")
            for page_size in (None, 16):
                cache = KVCache.for_model(model, 3, 48, page_size)
                assert model(idx, cache).shape == (3, 37, 256)
                assert model(idx[:, :1], cache).dtype == dt
                assert model(idx[:, :5], cache).shape == (3, 5, 256) and cache.length == 43
                assert model.decode_step(idx[:, :1], cache).shape == (3, 1, 256)


# ------------------------------------------------------------------------------------------------
# GPU


@pytest.fixture(scope="module")
def gpu_models():
    """The 4-layer phase 1 GPT (D = 64) and its OptimizedTransformer in each dtype."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    base = build_model(0, "cuda")
    return base, {dt: _optimized(base, dt) for dt in DTYPES}


@requires_gpu
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("S", [1, 17, 64])
@pytest.mark.parametrize("N", [1, 20])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_greedy_matches_the_baseline(gpu_models, B, S, N, dtype):
    base, models = gpu_models
    idx = _prompt(B, S)
    tokens, logits = models[dtype].generate(idx, N, return_logits=True)
    assert torch.equal(tokens[:, :S], idx)
    ref_tokens = G.greedy_without_cache(base, idx, N) if dtype == torch.float32 else None
    check_against_baseline(base, tokens, logits, S, N, dtype, ref_tokens)


@requires_gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_greedy_with_a_paged_cache(gpu_models, dtype, page_size):
    """The decode kernel reading K and V through the page table: the same checks, and the same
    logits as the contiguous cache's."""
    base, models = gpu_models
    idx = _prompt(3, 33)
    tokens, logits = models[dtype].generate(idx, 40, return_logits=True, page_size=page_size)
    ref_tokens = G.greedy_without_cache(base, idx, 40) if dtype == torch.float32 else None
    check_against_baseline(base, tokens, logits, 33, 40, dtype, ref_tokens)
    with torch.no_grad():  # the contiguous cache's logits on the paged run's tokens
        cache = KVCache.for_model(models[dtype], 3, 72)
        flat = torch.cat([models[dtype](tokens[:, :33], cache)[:, -1:]] +
                         [models[dtype](tokens[:, t:t + 1], cache) for t in range(33, 72)], dim=1)
    assert rel_error(logits, flat) <= MODEL_TOLERANCE[dtype] / 4


@requires_gpu
@pytest.mark.parametrize("N", [1, 2, 20])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_greedy_with_decode_steps_in_a_cuda_graph(gpu_models, dtype, page_size, N):
    """generate(cuda_graph=True): the first decode step eager, the others replayed; the same checks,
    and the eager generate's tokens and logits."""
    base, models = gpu_models
    idx = _prompt(3, 17)
    tokens, logits = models[dtype].generate(idx, N, return_logits=True, page_size=page_size, cuda_graph=True)
    ref_tokens = G.greedy_without_cache(base, idx, N) if dtype == torch.float32 else None
    check_against_baseline(base, tokens, logits, 17, N, dtype, ref_tokens)
    eager, eager_logits = models[dtype].generate(idx, N, return_logits=True, page_size=page_size)
    if torch.equal(tokens, eager):
        assert rel_error(logits, eager_logits) <= MODEL_TOLERANCE[dtype] / 4


@requires_gpu
def test_sampling_with_a_cuda_graph_is_reproducible(gpu_models):
    fast, idx = gpu_models[1][torch.float16], _prompt(2, 9)
    draws = [fast.generate(idx, 12, temperature=1.0, top_k=50, cuda_graph=True,
                           generator=torch.Generator("cuda").manual_seed(5)) for _ in range(2)]
    assert torch.equal(*draws) and bool(((draws[0] >= 0) & (draws[0] < 256)).all())


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_max_new_tokens_zero_returns_the_prompt_on_gpu(gpu_models, dtype):
    idx = _prompt(3, 17)
    tokens = gpu_models[1][dtype].generate(idx, 0)
    assert torch.equal(tokens, idx) and tokens.data_ptr() != idx.data_ptr()


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_prefill_fills_the_cache_with_the_baselines_keys_and_values(gpu_models, dtype):
    base, models = gpu_models
    fast = models[dtype]
    B, S, C, H = 3, 33, base.config.hidden, base.config.n_head
    idx = _prompt(B, S)
    cache = KVCache.for_model(fast, B, S + 7)
    cache.kv.fill_(float("nan"))  # poisoned: every slot the prefill should write must be written
    with torch.no_grad():
        fast(idx, cache)
        x = base.tok_emb(idx) + base.pos_emb(torch.arange(S, device="cuda"))
        for layer, block in enumerate(base.blocks):
            _, k, v = block.attn.qkv(block.ln1(x)).split(C, dim=-1)
            for got, want in ((cache.keys(layer), k), (cache.values(layer), v)):
                want = want.view(B, S, H, C // H).transpose(1, 2)
                assert torch.isfinite(got[:, :, :S]).all() and torch.isnan(got[:, :, S:]).all()
                assert rel_error(got[:, :, :S], want) <= MODEL_TOLERANCE[dtype], f"layer {layer}"
            x = block(x)
    assert cache.length == S and cache.lengths.tolist() == [S] * B


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_steps_of_several_tokens_match_the_forward(gpu_models, dtype):
    """Prefill 17, a step of 5 new tokens per sequence (decode's bottom-right causal mask), then 1."""
    base, models = gpu_models
    idx = _prompt(3, 23)
    cache = KVCache.for_model(models[dtype], 3, 23)
    with torch.no_grad():
        parts = [models[dtype](idx[:, a:b], cache) for a, b in ((0, 17), (17, 22), (22, 23))]
        ref = _float64(base)(idx)
    assert rel_error(torch.cat(parts, dim=1), ref) <= MODEL_TOLERANCE[dtype]


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("top_k", [None, 5])
def test_sampling_is_reproducible_and_in_the_vocabulary(gpu_models, dtype, top_k):
    fast = gpu_models[1][dtype]
    idx, seed = _prompt(3, 17), new_seed()

    def sample(seed):
        return fast.generate(idx, 20, temperature=0.8, top_k=top_k,
                             generator=torch.Generator("cuda").manual_seed(seed), return_logits=True)

    (tokens, logits), (again, _), (other, _) = sample(seed), sample(seed), sample(seed + 1)
    assert torch.equal(tokens, again), f"seed {seed}: the same generator seed gave different tokens"
    assert not torch.equal(tokens, other), f"seeds {seed} and {seed + 1} gave the same 60 draws"
    new = tokens[:, 17:]
    assert bool(((new >= 0) & (new < 256)).all()) and torch.equal(tokens[:, :17], idx)
    chosen = logits.gather(-1, new[..., None])
    if top_k is not None:  # each token among the top_k of the logits it was drawn from (ties included)
        assert bool((chosen >= logits.topk(top_k, dim=-1).values[..., -1:]).all())
    # top_k = 1 draws a largest logit every time (equal to greedy's token but where two logits tie)
    one, one_logits = fast.generate(idx, 20, temperature=1.0, top_k=1,
                                    generator=torch.Generator("cuda").manual_seed(seed), return_logits=True)
    assert bool((one_logits.gather(-1, one[:, 17:, None]) == one_logits.amax(-1, keepdim=True)).all())


@requires_gpu
def test_generating_up_to_max_seq_exactly_and_not_past_it():
    base = build_model(0, "cuda", config=SMALL)
    fast = _optimized(base, torch.float16)
    idx = _prompt(3, 17)
    tokens, logits = fast.generate(idx, 47, return_logits=True)
    assert tokens.shape == (3, 64)
    check_against_baseline(base, tokens, logits, 17, 47, torch.float16)
    with pytest.raises(ValueError, match="max_new_tokens=48 after a prompt of 17 tokens makes 65 tokens"):
        fast.generate(idx, 48)


@requires_gpu
def test_bad_devices_and_token_ids_on_gpu(gpu_models):
    fast = gpu_models[1][torch.float16]
    idx = _prompt(2, 5)
    with pytest.raises(ValueError, match="idx must be on the model's device cuda:0, got cpu"):
        fast.generate(idx.cpu(), 2)
    with pytest.raises(ValueError, match="generator must be a cuda generator"):
        fast.generate(idx, 2, temperature=1.0, generator=torch.Generator())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fast.generate(idx + 256, 2)


def test_benchmark_measure_rows_on_cpu(monkeypatch):
    """final.generate_benchmark's measurement loop and rows on CPU: the stand-in kernels, stand-in timers."""
    import utils.bench
    from final import generate_benchmark as GB
    from utils.results import validate

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 4.0

    class EagerGraphStep:  # CUDAGraphStep without the graph (none on a CPU): its device step, run eagerly
        def __init__(self, device_step):
            self.device_step = device_step

        def __call__(self, token, cache):
            logits = self.device_step(token, cache)
            cache.length += 1
            return logits

    _stand_ins(monkeypatch)
    monkeypatch.setattr(G, "CUDAGraphStep", EagerGraphStep)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(utils.bench, "timed_call", lambda fn: (fn(), 2.0))
    notes = []
    rows = GB.measure(list(GB.IMPLS), ["float32"], (1, 2), prompt=6, new_tokens=3, reps=1, device="cpu", notes=notes)
    assert not notes
    validate({"env": {k: "" for k in ("gpu", "sms", "torch", "cuda", "driver", "date", "commit")},
              "ceilings": {}, "rows": rows})
    assert [(r["impl"], r["B"]) for r in rows] == [(i, b) for b in (1, 2) for i in GB.IMPLS]
    for r in rows:
        assert r["op"] == "generate" and r["dtype"] == "float32" and (r["prompt"], r["new_tokens"]) == (6, 3)
        assert r["ms"] == 2.0 and r["tokens_per_s"] == pytest.approx(r["B"] * 3 / 2e-3)
        assert r["prefill_ms"] == 4.0 and r["decode_ms"] == 4.0  # 4 ms over the one step after the first
        assert r["rel_err"] < 1e-5, r
        if r["impl"] == "torch_sdpa_no_cache":
            assert r["step_mb"] is None and r["gbps"] is None
        else:
            assert r["gbps"] == pytest.approx(r["step_mb"] * 1e6 / 4e-3 / 1e9)


def test_step_bytes_counts_every_weight_once():
    from final.generate_benchmark import step_bytes

    base = build_model(0, config=SMALL)
    used = sum(p.numel() for name, p in base.named_parameters() if not name.endswith("_emb.weight"))
    C = SMALL.hidden
    cache = SMALL.n_layer * 2 * 3 * SMALL.n_head * (10 + 4 / 2) * SMALL.head_dim
    assert step_bytes(SMALL, 3, 10, 4, 2) == pytest.approx((used + 2 * 3 * C + cache) * 2)


def test_benchmark_failures_are_noted_and_skipped(monkeypatch):
    from final import generate_benchmark as GB

    monkeypatch.setattr(GB, "build", lambda dtype, device: {"optimized": GB.Impl(None, lambda idx, n: 1 / 0)})
    notes = []
    assert GB.measure(["optimized"], ["float32"], (1,), 4, 3, 1, device="cpu", notes=notes) == []
    assert notes == ["optimized float32 B=1: ZeroDivisionError: division by zero"]
    with pytest.raises(ValueError, match="new_tokens must be at least 3"):
        GB.measure(["optimized"], ["float32"], (1,), 4, 2, 1, device="cpu")
