"""Final: the phases put together.

- final.attention: cuda_attention_forward(q, k, v, mode=...) over every phase's kernels, CUDAAttention,
  supported_modes, the GPT-2 layout helpers;
- final.optimized_transformer: the phase 1 GPT with the phase 5 attention and phase 6 LayerNorm / MLP,
  and its generate() (prefill, then decode steps through phase5_fused.decode);
- final.kv_cache, final.generation: the KV cache (contiguous or paged) and the generation loop;
- final.hf_backend: the course's attention as a Hugging Face Transformers attention backend;
- final.benchmark, final.train, final.hf_benchmark, final.generate_benchmark, final.api_overhead, final.api_speed
  (`python -m final.<name>`): the end-to-end, training, Transformers, generation and per-call
  benchmarks -> final/results/.

Importing this package (or any of those modules) builds nothing: each extension is built on first use.
"""
