"""A model somebody else wrote, on the course's kernels: a Llama-style Transformers model, prefill and
decode, with attn_implementation="course" (final.hf_backend) against Transformers' own "sdpa".

`python -m final.hf_benchmark` on a GPU builds CONFIG (Llama architecture: RoPE, grouped-query
attention, SwiGLU; random weights, nothing downloaded) in FP16 twice, with the same weights, and
measures in the same run:
    hf_prefill   one forward over B=1 x PROMPT tokens (causal, no padding): ms, tokens/s
    hf_decode    DECODE_STEPS single-token forwards against the KV cache the prefill left
                 (Transformers passes each step a mask, so the course backend runs its masked path): ms per token
Each time is the median over REPS (CUDA events; a decode rep starts from a fresh prefill, untimed).
The course backend's prefill logits are compared with sdpa's (rel_err). Writes
final/results/hf.json (utils.results) and redraws final/README.md's table `hf_llama`
(final/manifest.json). Needs transformers (the optional extra `hf`); without a GPU or without
transformers it measures nothing and says so.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "results" / "hf.json"
DEVICE, DTYPE = "cuda", torch.float16
# A 1B-class Llama shape, 4 layers deep: D = 2048 / 16 = 128, 4 K/V heads shared by 16 query heads
CONFIG = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4,
          "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 4096}
PROMPT, DECODE_STEPS, REPS = 2048, 32, 5
IMPLS = ("sdpa", "course")


def build_models(config_kwargs: dict, device, dtype, mode: str = "auto") -> dict:
    """{impl: model} with the same random weights, in eval mode; "course" runs final.attention's
    `mode` (auto in the benchmark; the CPU test takes the float64 reference)."""
    import copy

    import transformers

    from final.hf_backend import register

    config = transformers.LlamaConfig(**config_kwargs)
    names = {"sdpa": "sdpa", "course": register(mode)}
    torch.manual_seed(0)
    models = {impl: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
              for impl, name in names.items()}
    models["course"].load_state_dict(models["sdpa"].state_dict())
    return {impl: m.to(device, dtype).eval() for impl, m in models.items()}


def elapsed_ms(fn, device) -> float:
    """fn()'s time in ms: CUDA events on a GPU, the wall clock elsewhere (the CPU test)."""
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from utils.bench import timed_call

    return timed_call(fn)[1]


@torch.no_grad()
def measure(models: dict, prompt: int, steps: int, reps: int, device) -> list[dict]:
    from utils.testing import rel_error

    ids = torch.randint(1, models["sdpa"].config.vocab_size, (1, prompt),
                        generator=torch.Generator().manual_seed(1)).to(device)
    reference_logits = models["sdpa"](ids).logits
    rows = []
    for impl, model in models.items():
        logits = model(ids).logits                                    # warm-up, and the accuracy check
        err = rel_error(logits, reference_logits)
        prefill = statistics.median(elapsed_ms(lambda: model(ids), device) for _ in range(reps))
        decode = []
        for _ in range(reps):
            out = model(ids, use_cache=True)                          # the cache a decode starts from (untimed)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)

            def step_all(cache=cache, token=token):
                for _ in range(steps):
                    token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

            decode.append(elapsed_ms(step_all, device) / steps)
        shape = {"B": 1, "prompt": prompt, "dtype": str(model.dtype).replace("torch.", ""),
                 "layers": model.config.num_hidden_layers, "H": model.config.num_attention_heads,
                 "H_kv": model.config.num_key_value_heads}
        rows.append({"impl": impl, "op": "hf_prefill", **shape, "ms": prefill, "tokens_per_s": prompt / prefill * 1e3,
                     "rel_err": err})
        rows.append({"impl": impl, "op": "hf_decode", **shape, "steps": steps, "ms": statistics.median(decode),
                     "tokens_per_s": 1e3 / statistics.median(decode)})
        print(f"  {impl:8s} prefill {prefill:8.2f} ms, decode {statistics.median(decode):6.2f} ms/token, "
              f"logits rel err {err:.1e}", flush=True)
    return rows


def run(out: Path = RESULTS_PATH) -> Path:
    from utils.results import write_results

    start = time.perf_counter()
    print(f"Transformers Llama-style model, FP16, prompt {PROMPT}, {DECODE_STEPS} decode steps: course vs sdpa",
          flush=True)
    rows = measure(build_models(CONFIG, DEVICE, DTYPE), PROMPT, DECODE_STEPS, REPS, DEVICE)
    path = write_results(out, rows, config=CONFIG, reps=REPS, wall_s=time.perf_counter() - start)
    from utils.build import shown
    print(f"wrote {shown(path)} in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def main(argv=None) -> int:
    if not torch.cuda.is_available():
        print("final.hf_benchmark: no CUDA GPU visible, nothing measured")
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("final.hf_benchmark: transformers is not installed (pip install -e .[hf]), nothing measured")
        return 0
    run()
    from utils.render import render

    render(HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
