"""Final: the phases put together.

- final.attention: cuda_attention_forward(q, k, v, mode=...) over every phase's kernels, CUDAAttention,
  supported_modes, the GPT-2 layout helpers;
- final.optimized_transformer: the phase 1 GPT with the phase 5 attention and phase 6 LayerNorm / MLP;
- final.benchmark (`python -m final.benchmark`): the end-to-end benchmark -> final/results/metrics.json.

Importing this package (or any of those modules) builds nothing: each extension is built on first use.
"""
