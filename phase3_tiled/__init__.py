"""Phase 3: shared-memory tiled CUDA attention, three kernels.

    S = scale * Q K^T        matmul_qk(q, k, scale=None, tile=16)   tiled_qk.cu
    P = softmax(S + mask)    softmax(s, mask=None, is_causal=False) block_softmax.cu
    O = P V                  matmul_av(p, v, tile=16)               tiled_av.cu
    attention(q, k, v, mask=None, is_causal=False, scale=None, tile=16): the three composed.

tile (8, 16 or 32) is the T of the T x T tiles and T x T thread blocks of both matmuls.

float32 only; q [B, H, Sq, D], k and v [B, H, Sk, D], 1 <= D <= 128; mask bool (True = attend) or
additive float, broadcastable to [B, H, Sq, Sk]; causal as torch SDPA (query i sees keys j <= i);
a row whose keys are all hidden gives zeros. The extension is built on the first call of load()
(importing this package builds nothing).
"""

from __future__ import annotations

from pathlib import Path

from utils.unfused_api import UnfusedAttention

NAME = "phase3_tiled"
SOURCES = ["ops.cpp", "tiled_qk.cu", "block_softmax.cu", "tiled_av.cu"]
TILES = (8, 16, 32)
DEFAULT_TILE = 16

_api = UnfusedAttention(NAME, Path(__file__).parent, SOURCES)
load = _api.load


def _check_tile(tile) -> int:
    if isinstance(tile, bool) or not isinstance(tile, int) or tile not in TILES:
        raise ValueError(f"tile must be one of {TILES}, got {tile!r}")
    return tile


def matmul_qk(q, k, scale=None, tile: int = DEFAULT_TILE):
    """S = scale * q k^T as float32 [B, H, Sq, Sk] with T x T tiles; scale defaults to 1/sqrt(D)."""
    return _api.matmul_qk(q, k, scale, _check_tile(tile))


def softmax(s, mask=None, is_causal: bool = False):
    """Row softmax of s [B, H, Sq, Sk] after causal masking and the mask; fully masked rows -> 0."""
    return _api.softmax(s, mask, is_causal)


def matmul_av(p, v, tile: int = DEFAULT_TILE):
    """O = p v as float32 [B, H, Sq, D] with T x T tiles, for p [B, H, Sq, Sk] and v [B, H, Sk, D]."""
    return _api.matmul_av(p, v, _check_tile(tile))


def attention(q, k, v, mask=None, is_causal: bool = False, scale=None, tile: int = DEFAULT_TILE):
    """softmax(scale q k^T + mask) v through the three tiled kernels (one S x S float32 buffer)."""
    return _api.attention(q, k, v, mask, is_causal, scale, _check_tile(tile))
