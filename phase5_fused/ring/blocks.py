"""The attention of one (query chunk, key chunk) pair, with its logsumexp: what a ring step computes.

A block function f(q, k, v, is_causal, scale) -> (o, lse) returns the chunk's output in its
accumulation dtype (float64 for the reference, float32 for the GPU kernels) and the row logsumexp
[B, H, Sq] (natural log, -inf where a row sees no key), the two things merge() needs.
"""

from __future__ import annotations

import torch

from utils import reference


def reference_block(q, k, v, is_causal: bool, scale: float):
    """utils.reference in float64 (any device, any dtype): the block CI runs on CPU with gloo."""
    return reference.attention(q, k, v, is_causal=is_causal, scale=scale, return_lse=True)


def sdpa_flash_block(q, k, v, is_causal: bool, scale: float):
    """PyTorch's FlashAttention-2 kernel (CUDA, FP16/BF16), which returns its logsumexp: the peer."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    return out.float(), lse


def course_block(q, k, v, is_causal: bool, scale: float):
    """The course's tensor-core kernel (CUDA, FP16/BF16) with its logsumexp."""
    from phase5_fused import tensor_cores

    out, lse = tensor_cores.attention(q, k, v, is_causal=is_causal, scale=scale, return_lse=True)
    return out.float(), lse


BLOCKS = {"reference": reference_block, "sdpa_flash": sdpa_flash_block, "course": course_block}
