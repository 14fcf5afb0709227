"""The Python side of the three-kernel attention API that phases 2, 3 and 4 share.

Each of those phases exposes matmul_qk, softmax, matmul_av and attention with the same meaning and
the same checks; only the extension behind them and its extra arguments (phase 3's tile) differ.
`UnfusedAttention(name, folder, sources)` builds that API over a phase's extension: it validates every
argument in Python (errors name the argument), builds the extension on first use, registers the
fake implementations torch.compile needs, and passes `extra` arguments through to the ops.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from utils.build import op_loader
from utils.checks import check_attention_inputs, check_cuda_tensor, check_mask

MAX_HEAD_DIM = 128


def supported_head_dim(D: int) -> bool:
    return 1 <= D <= MAX_HEAD_DIM


def default_scale(scale, D: int) -> float:
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


class UnfusedAttention:
    """matmul_qk / softmax / matmul_av / attention over the ops of torch.ops.<name>."""

    def __init__(self, name: str, folder: Path, sources: list[str]):
        self.name = name
        self.load = op_loader(folder, name, sources, self._register_fakes)

    def _check_head_dim(self, D: int, where: str) -> None:
        if not supported_head_dim(D):
            raise ValueError(f"head dim D={D} ({where}.shape[-1]) is not supported: "
                             f"{self.name} supports 1 <= D <= {MAX_HEAD_DIM}")

    @staticmethod
    def _check_nonempty(x: torch.Tensor, name: str) -> None:
        if x.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")

    def matmul_qk(self, q, k, scale=None, *extra) -> torch.Tensor:
        """S = scale * q k^T as float32 [B, H, Sq, Sk]; scale defaults to 1/sqrt(D)."""
        check_cuda_tensor(q, "q", (torch.float32,), dim=4)
        check_cuda_tensor(k, "k", (torch.float32,), dim=4)
        if k.device != q.device:
            raise ValueError(f"k must be on q's device {q.device}, got {k.device}")
        B, H, _, D = q.shape
        if k.shape[:2] != (B, H) or k.shape[3] != D:
            raise ValueError(f"k must be [B={B}, H={H}, Sk, D={D}] to match q, got {tuple(k.shape)}")
        self._check_nonempty(q, "q")
        self._check_nonempty(k, "k")
        self._check_head_dim(D, "q")
        return self.load().matmul_qk(q.contiguous(), k.contiguous(), default_scale(scale, D), *extra)

    def softmax(self, s, mask=None, is_causal: bool = False) -> torch.Tensor:
        """Row softmax of s [B, H, Sq, Sk] after causal masking and the mask; fully masked rows -> 0."""
        check_cuda_tensor(s, "s", (torch.float32,), dim=4)
        self._check_nonempty(s, "s")
        if mask is not None:
            mask = check_mask(mask, tuple(s.shape), s.device)
        return self.load().softmax(s.contiguous(), mask, bool(is_causal))

    def matmul_av(self, p, v, *extra) -> torch.Tensor:
        """O = p v as float32 [B, H, Sq, D], for p [B, H, Sq, Sk] and v [B, H, Sk, D]."""
        check_cuda_tensor(p, "p", (torch.float32,), dim=4)
        check_cuda_tensor(v, "v", (torch.float32,), dim=4)
        if v.device != p.device:
            raise ValueError(f"v must be on p's device {p.device}, got {v.device}")
        B, H, _, Sk = p.shape
        if v.shape[:3] != (B, H, Sk):
            raise ValueError(f"v must be [B={B}, H={H}, Sk={Sk}, D] to match p {tuple(p.shape)}, "
                             f"got {tuple(v.shape)}")
        self._check_nonempty(p, "p")
        self._check_nonempty(v, "v")
        self._check_head_dim(v.shape[3], "v")
        return self.load().matmul_av(p.contiguous(), v.contiguous(), *extra)

    def attention(self, q, k, v, mask=None, is_causal: bool = False, scale=None, *extra) -> torch.Tensor:
        """softmax(scale q k^T + mask) v through the phase's three kernels."""
        q, k, v, mask, (_, _, _, _, D) = check_attention_inputs(
            q, k, v, mask, is_causal=is_causal, scale=scale, dtypes=(torch.float32,), supported_d=supported_head_dim)
        return self.load().attention(q, k, v, mask, bool(is_causal), default_scale(scale, D), *extra)

    def _register_fakes(self) -> None:
        """Shape-only implementations, so torch.compile can trace through the ops."""

        @torch.library.register_fake(f"{self.name}::matmul_qk")
        def _matmul_qk_fake(q, k, scale, *extra):
            return q.new_empty(q.shape[0], q.shape[1], q.shape[2], k.shape[2])

        @torch.library.register_fake(f"{self.name}::softmax")
        def _softmax_fake(s, mask, is_causal):
            return torch.empty_like(s)

        @torch.library.register_fake(f"{self.name}::matmul_av")
        def _matmul_av_fake(p, v, *extra):
            return v.new_empty(p.shape[0], p.shape[1], p.shape[2], v.shape[3])

        @torch.library.register_fake(f"{self.name}::attention")
        def _attention_fake(q, k, v, mask, is_causal, scale, *extra):
            return torch.empty_like(q)
