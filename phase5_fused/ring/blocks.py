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


# ------------------------------------------------------------------------------------------------
# The backward of one block pair. With the whole row's out and lse (not the block's), FlashAttention's
# backward of a block gives exactly that block's share of the gradients: P_ij = exp(s_ij - lse_i) is
# the true softmax probability and D_i = rowsum(dO_i * O_i) the true row term, so
# dS = P * (dP - D_i) needs nothing else from the other blocks.


def reference_block_backward(q, k, v, out, lse, dout, is_causal: bool, scale: float):
    """(dq, dk, dv) of one block pair in float64 (FlashAttention-2, Algorithm 2, unblocked)."""
    q, k, v, out, lse, dout = (x.detach().to(torch.float64) for x in (q, k, v, out, lse, dout))
    B, H, Sq, _ = q.shape
    s = scale * (q @ k.transpose(-1, -2)) + reference.attention_bias(B, H, Sq, k.shape[2], is_causal=is_causal,
                                                                   device=q.device)
    seen = torch.isfinite(lse).unsqueeze(-1)
    p = torch.where(seen, torch.exp(s - torch.where(seen, lse.unsqueeze(-1), 0.0)), 0.0)
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return scale * (ds @ k), scale * (ds.transpose(-1, -2) @ q), p.transpose(-1, -2) @ dout


def course_block_backward(q, k, v, out, lse, dout, is_causal: bool, scale: float):
    """The course's backward kernels (phase5_fused.backward: mma.sync FP16/BF16, or FP32)."""
    from phase5_fused import backward

    return tuple(g.float() for g in backward.attention_backward(q, k, v, out, lse, dout, is_causal=is_causal,
                                                                scale=scale))


BACKWARDS = {"reference": reference_block_backward, "course": course_block_backward}
