"""Phase 2: naive CUDA attention, three kernels with one thread per output element.

    S = scale * Q K^T        matmul_qk(q, k, scale=None)          naive_qk.cu
    P = softmax(S + mask)    softmax(s, mask=None, is_causal=False) naive_softmax.cu
    O = P V                  matmul_av(p, v)                      naive_av.cu
    attention(q, k, v, mask=None, is_causal=False, scale=None): the three composed.

float32 only; q [B, H, Sq, D], k and v [B, H, Sk, D], 1 <= D <= 128; mask bool (True = attend) or
additive float, broadcastable to [B, H, Sq, Sk]; causal as torch SDPA (query i sees keys j <= i);
a row whose keys are all hidden gives zeros. The extension is built on the first call of load()
(importing this package builds nothing).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from utils.checks import check_attention_inputs, check_cuda_tensor, check_mask

NAME = "phase2_naive"
SOURCES = ["ops.cpp", "naive_qk.cu", "naive_softmax.cu", "naive_av.cu"]
MAX_HEAD_DIM = 128

_ops = None


def load():
    """Build (first time) and load the extension; returns torch.ops.phase2_naive."""
    global _ops
    if _ops is None:
        from utils.build import load_phase

        load_phase(Path(__file__).parent, NAME, SOURCES)
        _register_fakes()
        _ops = getattr(torch.ops, NAME)
    return _ops


def supported_head_dim(D: int) -> bool:
    return 1 <= D <= MAX_HEAD_DIM


def _check_head_dim(D: int, where: str) -> None:
    if not supported_head_dim(D):
        raise ValueError(f"head dim D={D} ({where}.shape[-1]) is not supported: "
                         f"{NAME} supports 1 <= D <= {MAX_HEAD_DIM}")


def _check_nonempty(x: torch.Tensor, name: str) -> None:
    if x.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")


def _scale(scale, D: int) -> float:
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def matmul_qk(q, k, scale=None) -> torch.Tensor:
    """S = scale * q k^T as float32 [B, H, Sq, Sk]; scale defaults to 1/sqrt(D)."""
    check_cuda_tensor(q, "q", (torch.float32,), dim=4)
    check_cuda_tensor(k, "k", (torch.float32,), dim=4)
    if k.device != q.device:
        raise ValueError(f"k must be on q's device {q.device}, got {k.device}")
    B, H, _, D = q.shape
    if k.shape[:2] != (B, H) or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, H={H}, Sk, D={D}] to match q, got {tuple(k.shape)}")
    _check_nonempty(q, "q")
    _check_nonempty(k, "k")
    _check_head_dim(D, "q")
    return load().matmul_qk(q.contiguous(), k.contiguous(), _scale(scale, D))


def softmax(s, mask=None, is_causal: bool = False) -> torch.Tensor:
    """Row softmax of s [B, H, Sq, Sk] after causal masking and the mask; fully masked rows -> 0."""
    check_cuda_tensor(s, "s", (torch.float32,), dim=4)
    _check_nonempty(s, "s")
    if mask is not None:
        mask = check_mask(mask, tuple(s.shape), s.device)
    return load().softmax(s.contiguous(), mask, bool(is_causal))


def matmul_av(p, v) -> torch.Tensor:
    """O = p v as float32 [B, H, Sq, D], for p [B, H, Sq, Sk] and v [B, H, Sk, D]."""
    check_cuda_tensor(p, "p", (torch.float32,), dim=4)
    check_cuda_tensor(v, "v", (torch.float32,), dim=4)
    if v.device != p.device:
        raise ValueError(f"v must be on p's device {p.device}, got {v.device}")
    B, H, _, Sk = p.shape
    if v.shape[:3] != (B, H, Sk):
        raise ValueError(f"v must be [B={B}, H={H}, Sk={Sk}, D] to match p {tuple(p.shape)}, "
                         f"got {tuple(v.shape)}")
    _check_nonempty(p, "p")
    _check_nonempty(v, "v")
    _check_head_dim(v.shape[3], "v")
    return load().matmul_av(p.contiguous(), v.contiguous())


def attention(q, k, v, mask=None, is_causal: bool = False, scale=None) -> torch.Tensor:
    """softmax(scale q k^T + mask) v through the three naive kernels (one S x S float32 buffer)."""
    q, k, v, mask, (_, _, _, _, D) = check_attention_inputs(
        q, k, v, mask, dtypes=(torch.float32,), supported_d=supported_head_dim)
    return load().attention(q, k, v, mask, bool(is_causal), _scale(scale, D))


def _register_fakes() -> None:
    """Shape-only implementations, so torch.compile can trace through the ops."""

    @torch.library.register_fake(f"{NAME}::matmul_qk")
    def _matmul_qk_fake(q, k, scale):
        return q.new_empty(q.shape[0], q.shape[1], q.shape[2], k.shape[2])

    @torch.library.register_fake(f"{NAME}::softmax")
    def _softmax_fake(s, mask, is_causal):
        return torch.empty_like(s)

    @torch.library.register_fake(f"{NAME}::matmul_av")
    def _matmul_av_fake(p, v):
        return v.new_empty(p.shape[0], p.shape[1], p.shape[2], v.shape[3])

    @torch.library.register_fake(f"{NAME}::attention")
    def _attention_fake(q, k, v, mask, is_causal, scale):
        return torch.empty_like(q)
