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

from pathlib import Path

from utils.unfused_api import UnfusedAttention

NAME = "phase2_naive"
SOURCES = ["ops.cpp", "naive_qk.cu", "naive_softmax.cu", "naive_av.cu"]

_api = UnfusedAttention(NAME, Path(__file__).parent, SOURCES)
load = _api.load


def matmul_qk(q, k, scale=None):
    """S = scale * q k^T as float32 [B, H, Sq, Sk]; scale defaults to 1/sqrt(D)."""
    return _api.matmul_qk(q, k, scale)


def softmax(s, mask=None, is_causal: bool = False):
    """Row softmax of s [B, H, Sq, Sk] after causal masking and the mask; fully masked rows -> 0."""
    return _api.softmax(s, mask, is_causal)


def matmul_av(p, v):
    """O = p v as float32 [B, H, Sq, D], for p [B, H, Sq, Sk] and v [B, H, Sk, D]."""
    return _api.matmul_av(p, v)


def attention(q, k, v, mask=None, is_causal: bool = False, scale=None):
    """softmax(scale q k^T + mask) v through the three naive kernels (one S x S float32 buffer)."""
    return _api.attention(q, k, v, mask, is_causal, scale)
