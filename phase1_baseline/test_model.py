"""The baseline model: shapes, determinism, math attention == SDPA, GPU == CPU."""

import pytest
import torch

from phase1_baseline.pytorch_transformer import (GPTConfig, build_model, causal_attention_math,
                                                 causal_attention_sdpa, synthetic_batch, text_batch)
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
