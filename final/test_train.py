"""Training: the OptimizedTransformer's gradients against the phase 1 baseline's, a few AdamW steps
of both on the same data, and final.train's data and step on CPU."""

import pytest
import torch

from final import train as T
from phase1_baseline.pytorch_transformer import GPTConfig, build_model, next_token_loss, synthetic_batch
from utils.testing import rel_error, requires_gpu

# hidden 128 / 2 heads = D 64, which both the FP32 and the tensor-core attention take.
SMALL = GPTConfig(max_seq=128, n_layer=2, hidden=128, n_head=2)
# Per-parameter relative error of the gradients (||g - g_ref|| / ||g_ref||) against the baseline in
# float64: FP32 like the logits' bound; BF16 against a bound of 3x what PyTorch's own BF16 model
# reaches on the same data (at least 2e-2).
FP32_GRAD_TOL = 1e-4


# --- CPU ----------------------------------------------------------------------------------------

def test_synthetic_corpus_is_deterministic_text():
    a, b = T.synthetic_corpus(4096, seed=3), T.synthetic_corpus(4096, seed=3)
    assert torch.equal(a, b) and a.dtype == torch.uint8 and a.numel() == 4096
    assert not torch.equal(a, T.synthetic_corpus(4096, seed=4))
    letters = (a >= ord("a")) & (a <= ord("z"))
    assert bool((letters | (a == ord(" "))).all()) and (a == ord(" ")).sum() > 4096 // 10
    words = bytes(a.tolist()).split()
    assert len(set(words)) < len(words) // 2  # a small dictionary: words repeat


def test_batches_are_windows_of_the_corpus():
    corpus = torch.arange(1000) % 251
    data = T.batches(corpus.to(torch.uint8), steps=3, batch=2, seq=16, device="cpu")
    assert data.shape == (3, 2, 17) and data.dtype == torch.int64
    step = (data[..., 1:] - data[..., :-1]) % 251
    assert bool((step == 1).all())
    with pytest.raises(ValueError, match="fewer than seq"):
        T.batches(corpus[:10].to(torch.uint8), 1, 1, 16, device="cpu")


def test_train_step_lowers_the_loss_on_cpu():
    model = build_model(config=SMALL).train()
    opt = T.make_optimizer(model, lr=3e-3)
    idx = synthetic_batch(2, 33, seed=1)
    losses = [T.train_step(model, opt, idx).item() for _ in range(8)]
    assert losses[-1] < losses[0] - 0.3, losses


def test_host_time_is_the_median_issue_time_with_the_gpu_drained(monkeypatch):
    """host_ms_per_step: one step per batch, each timed alone after a drain, the median in ms."""
    clock = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.009])  # three steps: 4, 2 and 9 ms
    events = []
    monkeypatch.setattr(T.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(T.torch.cuda, "synchronize", lambda: events.append("drain"))
    ms = T.host_ms_per_step(lambda idx: events.append(int(idx)), torch.tensor([7, 8, 9]))
    assert ms == pytest.approx(4.0)
    assert events == ["drain", 7, "drain", 8, "drain", 9, "drain"]


def test_without_a_gpu_nothing_is_trained(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    assert T.main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


# --- GPU ----------------------------------------------------------------------------------------

def _gradients(model, idx) -> dict:
    model.zero_grad(set_to_none=True)
    next_token_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
    return {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}


def _grad_errors(grads: dict, ref: dict) -> dict:
    out = {}
    for name, g in ref.items():
        assert name in grads, f"{name}: no gradient"
        norm = g.norm().item()
        out[name] = rel_error(grads[name], g) if norm > 0 else grads[name].norm().item()
    return out


@requires_gpu
@pytest.mark.parametrize("mlp", ("phase6", "cublas"))
@pytest.mark.parametrize("B,S", [(2, 67), (1, 128)])
def test_fp32_gradients_match_the_baseline(mlp, B, S):
    from final.optimized_transformer import OptimizedTransformer

    base = build_model(0, "cuda", config=SMALL)
    fast = OptimizedTransformer.from_baseline(base, mlp=mlp).train()
    idx = synthetic_batch(B, S + 1, seed=B * 100 + S, device="cuda")
    ref = _gradients(base.double(), idx)
    torch_errors = _grad_errors(_gradients(base.float(), idx), ref)
    errors = _grad_errors(_gradients(fast, idx), ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FP32_GRAD_TOL, (f"{worst}: gradient rel error {errors[worst]:.2e} > {FP32_GRAD_TOL:.0e} "
                                            f"(the FP32 baseline's own: {torch_errors[worst]:.2e})")


@requires_gpu
def test_bf16_gradients_as_close_as_pytorchs_bf16_model():
    from final.optimized_transformer import OptimizedTransformer

    base = build_model(0, "cuda", config=SMALL)
    fast = OptimizedTransformer.from_baseline(base, dtype=torch.bfloat16).train()
    idx = synthetic_batch(2, 97, seed=11, device="cuda")
    ref = _gradients(build_model(0, "cuda", config=SMALL).double(), idx)
    torch_errors = _grad_errors(_gradients(base.to(torch.bfloat16), idx), ref)
    errors = _grad_errors(_gradients(fast, idx), ref)
    for name, err in errors.items():
        bound = max(3 * torch_errors[name], 2e-2)
        assert err <= bound, f"{name}: BF16 gradient rel error {err:.2e} > {bound:.2e} (PyTorch BF16: {torch_errors[name]:.2e})"


@requires_gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_a_few_training_steps_follow_the_baseline(dtype, tol):
    """Same weights, same batches, AdamW: the two models' losses stay together step by step, and
    both fall (a wrong gradient anywhere would send the optimized model elsewhere)."""
    from final.optimized_transformer import OptimizedTransformer

    base = build_model(0, "cuda", attention="sdpa", config=SMALL)
    fast = OptimizedTransformer.from_baseline(base, dtype=dtype).train()
    base = base.to(dtype).train()
    data = T.batches(T.synthetic_corpus(1 << 16), steps=8, batch=4, seq=96, device="cuda")
    losses = {}
    for name, model in (("baseline", base), ("optimized", fast)):
        opt = T.make_optimizer(model, lr=3e-3)
        losses[name] = [T.train_step(model, opt, data[i]).item() for i in range(data.shape[0])]
    for step, (a, b) in enumerate(zip(losses["baseline"], losses["optimized"])):
        assert abs(a - b) <= tol * abs(a), f"step {step}: baseline loss {a:.5f}, optimized {b:.5f}"
    assert losses["optimized"][-1] < losses["optimized"][0] - 1.0, losses["optimized"]


@requires_gpu
def test_inference_keeps_its_fast_path():
    """Under no_grad nothing is recorded and the logits equal those of the training-mode forward
    (the MLP's fused GELU epilogue against GEMM + GELU kernel)."""
    from final.optimized_transformer import OptimizedTransformer

    fast = OptimizedTransformer.from_baseline(build_model(0, "cuda", config=SMALL))
    idx = synthetic_batch(2, 50, seed=5, device="cuda")
    with torch.no_grad():
        inference = fast(idx)
    training = fast(idx)
    assert not inference.requires_grad and training.requires_grad
    assert rel_error(inference, training.detach()) < 1e-6


@requires_gpu
@pytest.mark.parametrize("impl,tol", [("torch_sdpa", 1e-4), ("optimized", 1e-4), ("optimized_bf16", 2e-2)])
def test_graphed_steps_train_like_eager_steps(impl, tol):
    """The step replayed from a CUDA graph takes the same steps as the eager one: same losses after
    the warm-up (AdamW capturable or not computes the same update), so the graph run's timing is
    that of real training. A step the capture missed (an op run on the host, a kernel left out)
    would send the losses elsewhere from the first replay on."""
    data = T.batches(T.synthetic_corpus(1 << 16), steps=8, batch=2, seq=96, device="cuda")
    eager, graphed = (T.run_steps(impl, data, warmup=3, graph=graph)["losses"] for graph in (False, True))
    for step, (a, b) in enumerate(zip(eager, graphed)):
        assert abs(a - b) <= tol * abs(a), f"step {step}: eager loss {a:.5f}, graphed {b:.5f}"
