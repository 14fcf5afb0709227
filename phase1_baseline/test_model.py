"""The baseline model: shapes, determinism, math attention == SDPA, GPU == CPU, and its backward."""

import pytest
import torch

from phase1_baseline.pytorch_transformer import (GPTConfig, build_model, causal_attention_math,
                                                 causal_attention_sdpa, next_token_loss, synthetic_batch,
                                                 text_batch)
from utils import reference
from utils.testing import requires_gpu

SMALL = GPTConfig(max_seq=64, n_layer=2, hidden=64, n_head=4)


def test_logits_shape_and_finite():
    model = build_model(config=SMALL)
    logits = model(synthetic_batch(3, 17))
    assert logits.shape == (3, 17, 256) and torch.isfinite(logits).all()


def test_same_seed_same_weights_same_logits():
    idx = synthetic_batch(2, 16, seed=5)
    a, b = build_model(seed=1, config=SMALL)(idx), build_model(seed=1, config=SMALL)(idx)
    assert torch.equal(a, b)
    assert not torch.equal(a, build_model(seed=2, config=SMALL)(idx))


def test_model_is_causal():
    model = build_model(config=SMALL)
    idx = synthetic_batch(1, 20, seed=3)
    changed = idx.clone()
    changed[0, 15] = (changed[0, 15] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_math_attention_equals_reference_and_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64) for _ in range(3))
    expected = reference.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(causal_attention_math(q, k, v), expected)
    torch.testing.assert_close(causal_attention_sdpa(q, k, v), expected)


def test_sdpa_switch_keeps_logits():
    idx = synthetic_batch(2, 24)
    model = build_model(config=SMALL).double()
    math_logits = model(idx)
    model.set_attention("sdpa")
    torch.testing.assert_close(model(idx), math_logits)


def test_bad_attention_name_is_rejected():
    with pytest.raises(ValueError, match="attention"):
        build_model(config=SMALL, attention="flash9")


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="max_seq"):
        build_model(config=SMALL)(synthetic_batch(1, 65))


def test_text_batches_are_bytes(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(200)))
    batch = text_batch(path, 4, 32)
    assert batch.shape == (4, 32) and batch.max() < 256
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 31, dtype=torch.long))


@requires_gpu
def test_gpu_matches_cpu():
    idx = synthetic_batch(2, 128, seed=7)
    cpu = build_model(seed=3)(idx)
    gpu = build_model(seed=3, device="cuda")(idx.cuda())
    rel = (gpu.cpu().double() - cpu.double()).norm() / cpu.double().norm()
    assert rel < 1e-5, f"GPU logits differ from CPU by {rel:.2e} (relative)"


# --- backward (the model trains: final.train) ----------------------------------------------------

def _grads(model, idx):
    model.zero_grad(set_to_none=True)
    next_token_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_loss_backward_gives_every_parameter_a_gradient():
    model = build_model(config=SMALL)
    grads = _grads(model, synthetic_batch(2, 17, seed=4))
    for name, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), name
        if name != "pos_emb.weight" and not name.startswith("tok_emb"):
            assert g.abs().sum() > 0, f"{name}: zero gradient"
    # Positions past the sequence and tokens absent from the batch get none; those present do.
    assert grads["pos_emb.weight"][16:].abs().sum() == 0 and grads["pos_emb.weight"][:16].abs().sum() > 0


def test_math_and_sdpa_gradients_agree_and_match_finite_differences():
    """float64: the two attentions give the same gradients, and a directional derivative of the
    loss matches its central finite difference (so backward differentiates what forward computes)."""
    idx = synthetic_batch(2, 13, seed=6)
    model = build_model(config=SMALL).double()
    math_grads = _grads(model, idx)
    model.set_attention("sdpa")
    sdpa_grads = _grads(model, idx)
    for name, g in math_grads.items():
        torch.testing.assert_close(sdpa_grads[name], g, msg=name)
    gen = torch.Generator().manual_seed(1)
    direction = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in model.named_parameters()}
    norm = sum((d * d).sum() for d in direction.values()).sqrt()
    direction = {n: d / norm for n, d in direction.items()}  # a unit step in parameter space
    predicted = sum((math_grads[n] * d).sum() for n, d in direction.items()).item()
    h = 1e-4

    def loss_at(step):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.add_(direction[n], alpha=step)
            out = next_token_loss(model(idx[:, :-1]), idx[:, 1:]).item()
            for n, p in model.named_parameters():
                p.sub_(direction[n], alpha=step)
        return out

    measured = (loss_at(h) - loss_at(-h)) / (2 * h)
    assert abs(measured - predicted) <= 1e-6 * abs(predicted), (measured, predicted)


def test_adamw_steps_lower_the_loss_on_a_fixed_batch():
    model = build_model(config=SMALL).train()
    idx = synthetic_batch(4, 33, seed=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        opt.zero_grad(set_to_none=True)
        loss = next_token_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_no_grad_records_no_graph():
    model = build_model(config=SMALL)
    with torch.no_grad():
        logits = model(synthetic_batch(1, 9))
    assert not logits.requires_grad
    assert model(synthetic_batch(1, 9)).requires_grad
