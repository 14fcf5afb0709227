"""The course attention inside Transformers models: same weights under "sdpa" and the course backend
give the same logits, the same greedy tokens with the KV cache, and the same padded-batch logits.
Tiny models built from configs with random weights (no downloads). Skips without transformers."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from final.attention import UnsupportedModeError  # noqa: E402
from final.hf_backend import backend_name, register  # noqa: E402
from utils.testing import rel_error, requires_gpu  # noqa: E402

VOCAB = 97


def gpt2_config(**extra):
    """Two layers, 4 heads of D=32, learned positions."""
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                                   attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                   bos_token_id=None, eos_token_id=None, **extra)


def llama_config(**extra):
    """Two layers, 4 query heads of D=32 sharing 2 K/V heads (GQA), RoPE."""
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64, **extra)


CONFIGS = {"gpt2": gpt2_config, "llama_gqa": llama_config}


def model_pair(config, implementation, device="cpu", dtype=torch.float32):
    """The same random weights under "sdpa" and under `implementation`, in eval mode."""
    # Each model gets its own config: a model keeps its config object, attention implementation included
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    course = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
    assert (sdpa.config._attn_implementation, course.config._attn_implementation) == ("sdpa", implementation)
    course.load_state_dict(sdpa.state_dict())
    return sdpa.to(device, dtype).eval(), course.to(device, dtype).eval()


def tokens(B=2, S=11, device="cpu"):
    return torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(1)).to(device)


def check_model(config, mode, device, tol, dtype=torch.float32, generate=True):
    """Logits, a left-padded batch and greedy generation with the KV cache, course against sdpa."""
    sdpa, course = model_pair(config, register(mode), device, dtype)
    ids = tokens(device=device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second sequence left-padded by 4
    with torch.no_grad():
        # Full-sequence logits, no padding
        assert rel_error(course(ids).logits, sdpa(ids).logits) < tol
        # Left-padded batch: the real tokens' logits (padded positions attend to nothing)
        padded = [m(ids, attention_mask=mask).logits for m in (course, sdpa)]
        keep = mask.bool()
        assert rel_error(padded[0][keep], padded[1][keep]) < tol
        # Chunked prefill: 4 new queries after 7 cached keys (Transformers' bottom-right causal mask)
        chunked = []
        for m in (course, sdpa):
            cache = m(ids[:, :7], use_cache=True).past_key_values
            chunked.append(m(ids[:, 7:], past_key_values=cache).logits)
        assert rel_error(chunked[0], chunked[1]) < tol
        # Greedy decoding through the KV cache (Sq = 1 against the cached keys), padded batch included
        if not generate:
            return
        gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        for kwargs in ({}, {"attention_mask": mask}):
            out = [m.generate(ids, **kwargs, **gen) for m in (course, sdpa)]
            assert out[0].shape == (2, ids.shape[1] + 8)
            assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("name", CONFIGS)
def test_reference_mode_matches_sdpa(name):
    check_model(CONFIGS[name](), "reference", "cpu", 1e-4)


def test_names():
    assert register() == backend_name("auto") == "course"
    assert register("reference") == "course_reference"
    assert "course_reference" in transformers.AttentionInterface._global_mapping
    with pytest.raises(UnsupportedModeError, match="unknown attention mode"):
        register("fastest")


def test_the_course_function_runs(monkeypatch):
    # Once per layer and forward: the models above really ran the course attention
    import final.hf_backend as backend
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["mode"])
        return forward(*args, **kwargs)

    forward = backend.cuda_attention_forward
    monkeypatch.setattr(backend, "cuda_attention_forward", counting)
    _, course = model_pair(llama_config(), register("reference"))
    with torch.no_grad():
        course(tokens())
    assert calls == ["reference"] * 2


def test_grouped_heads_pass_through_where_the_mode_takes_them(monkeypatch):
    """llama_gqa's 2 K/V heads reach the reference mode as they are; a mode that cannot take grouped
    heads for the inputs (no such kernel, or a gradient through the fused kernels) gets a copy per
    query head instead."""
    import final.hf_backend as backend
    from torch._subclasses.fake_tensor import FakeTensorMode

    kv_heads = []

    def recording(query, key, value, **kwargs):
        kv_heads.append(key.shape[1])
        return forward(query, key, value, **kwargs)

    forward = backend.cuda_attention_forward
    monkeypatch.setattr(backend, "cuda_attention_forward", recording)
    _, course = model_pair(llama_config(), register("reference"))
    with torch.no_grad():
        course(tokens())
    assert kv_heads == [llama_config().num_key_value_heads] * 2
    with FakeTensorMode():
        q = torch.empty(1, 4, 8, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(1, 2, 8, 64, dtype=torch.float16, device="cuda")
        q32, k32 = q.float(), k.float()
        assert backend.takes_grouped_heads("fused_tc", q, k, k, None)
        assert not backend.takes_grouped_heads("coalesced", q32, k32, k32, None)
        assert not backend.takes_grouped_heads("fused_tc", q.requires_grad_(), k, k, None)


def test_dropout_is_refused():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=2, attn_pdrop=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=register("reference"))
    with pytest.raises(ValueError, match="no dropout"):
        model.train()(tokens())
    model.eval()(tokens())  # dropout is 0 in eval mode: runs


def test_unsupported_inputs_raise_the_course_error():
    # auto runs CUDA kernels only: CPU tensors get the course's error naming the modes that would
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(gpt2_config(), attn_implementation=register()).eval()
    with pytest.raises(UnsupportedModeError, match="mode='auto': no CUDA kernel"):
        model(tokens())


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_auto_mode_matches_sdpa_on_gpu(name):
    # float32 runs the fused FP32 kernel: logits and the greedy tokens match
    check_model(CONFIGS[name](), "auto", "cuda", 1e-3)
    # float16 runs the tensor-core kernel: logits within half precision (tokens may flip on near ties)
    check_model(CONFIGS[name](), "auto", "cuda", 2e-2, dtype=torch.float16, generate=False)


def test_hf_benchmark_pipeline_on_cpu(tmp_path):
    """final.hf_benchmark's measurement, results file and table, on a tiny Llama-style model on the
    CPU (the course backend in its float64 reference mode): both impls, both steps, matching logits."""
    import json
    import shutil

    from final import hf_benchmark as hb
    from utils.manifest import load_manifest
    from utils.render import render_tables
    from utils.results import write_results

    tiny = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    rows = hb.measure(hb.build_models(tiny, "cpu", torch.float32, mode="reference"), prompt=12, steps=3, reps=1,
                      device="cpu")
    assert sorted((r["op"], r["impl"]) for r in rows) == [("hf_decode", "course"), ("hf_decode", "sdpa"),
                                                           ("hf_prefill", "course"), ("hf_prefill", "sdpa")]
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert next(r for r in rows if r["op"] == "hf_prefill" and r["impl"] == "course")["rel_err"] < 1e-5
    for name in ("manifest.json", "README.md"):
        shutil.copy(hb.HERE / name, tmp_path / name)
    write_results(tmp_path / "results" / "hf.json", rows)
    manifest = load_manifest(tmp_path)
    render_tables({**manifest, "tables": [t for t in manifest["tables"] if t["name"] == "hf_llama"]})
    table = (tmp_path / "README.md").read_text().split("<!-- table:hf_llama -->")[1].split("<!--")[0]
    assert "| **hf_prefill** | course |" in table and "| hf_decode | sdpa |" in table, table
    assert len(json.loads((tmp_path / "results" / "hf.json").read_text())["rows"]) == 4
