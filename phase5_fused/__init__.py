"""Phase 5: fused attention, one sub-package per lesson of the same shape.

    phase5_fused.fp32          FlashAttention's forward pass in FP32 (online softmax, no S x S buffer)
    phase5_fused.tensor_cores  the same algorithm in FP16 / BF16 on mma.sync tensor cores
    phase5_fused.hopper        the same on Hopper's TMA + wgmma, warp-specialized (FlashAttention-3 style, sm_90a)
    phase5_fused.backward      FlashAttention-2's backward pass (FP32, mma.sync FP16/BF16), the autograd of the fused forwards
    phase5_fused.decode        a few new tokens against a long (paged, grouped-query) KV cache: split-KV decoding
    phase5_fused.ring          one sequence over several GPUs: K/V passed around a ring, merged by logsumexp

Each lesson holds its kernels, its Python API (its __init__.py), run.py, tests, sanitizer cases,
manifest.json, README.md and results/. Importing any of them builds nothing.
"""
