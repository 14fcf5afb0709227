"""Phase 5, tensor cores: FlashAttention-2 forward in FP16 / BF16 on mma.sync (tc_attention.cu).

    from phase5_fused import tensor_cores
    out = tensor_cores.attention(q, k, v, is_causal=True)   # q, k, v: CUDA float16 or bfloat16

Supports D in SUPPORTED_D (every multiple of 8 from 8 to 256: D runs on the tiles of the next
multiple of 32, its padding columns zeros), any Sq and Sk (Sq != Sk too), causal (top-left aligned,
as torch SDPA), key padding by key_lengths [B], and boolean (True = attend) or additive float masks
broadcastable to [B, H, Sq, Sk] (a slower path). Rows with no visible key give zeros.
Grouped-query attention: k and v may have H_kv heads, H % H_kv == 0 (MQA: H_kv = 1); query head h
reads KV head h // (H // H_kv), and K/V are never copied per query head. window=w (with is_causal):
query i sees keys i - w < j <= i; key blocks below a query block's window are never loaded. Both
combine with masks and key_lengths.
Accumulation and the softmax statistics are FP32; the output has the inputs' dtype.
return_lse=True also returns the rows' logsumexp ([B, H, Sq] float32, natural log, -inf for a row
with no visible key; op attention_lse). Differentiable in q, k, v (not the mask): the backward is
phase5_fused.backward's tensor-core kernel, and the forward writes lse when an input requires grad;
that backward takes grouped heads, windows and every head dim the forward takes.

version= picks one of the lesson's versions (VERSIONS, in order, each one idea further; README
"Versions"): "v1_mma" (tc_v1_mma.cu), "v2_ldmatrix", "v3_swizzle", "v4_cp_async", "v5_exp2",
"v6_lazy", and "fast" (tc_attention.cu, the default, everything above). Versions other than "fast"
take the headline problem only: D in VERSION_D (64, 128), is_causal and scale, any Sq and Sk, out=; no mask,
key_lengths, grouped heads, window or return_lse (ValueError naming the argument), and no gradient:
an input that requires grad is refused by name (run them under torch.no_grad()).

Importing this module builds nothing; load() builds the extension on first use.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from utils.build import op_loader
from utils.checks import (check_attention_inputs, check_cuda_tensor, dim_in, plain_arguments,
                          records_grad)

NAME = "phase5_fused_tc"
SOURCES = ["tc_attention.cu", "tc_ops.cpp", "tc_v1_mma.cu", "tc_v2_ldmatrix.cu", "tc_v3_swizzle.cu",
           "tc_v4_cp_async.cu", "tc_v5_exp2.cu", "tc_v6_lazy.cu"]
# The versions of the lesson, in order (README "Versions"): tc_v1_mma.cu ... tc_v6_lazy.cu, then
# the fast kernel tc_attention.cu. The op attention_version takes the index + 1 of the first six.
VERSIONS = ("v1_mma", "v2_ldmatrix", "v3_swizzle", "v4_cp_async", "v5_exp2", "v6_lazy", "fast")
DEFAULT_VERSION = "fast"
# The head dims of the versions other than "fast" (tc_versions.h).
VERSION_D = (64, 128)
# The head dims the forward takes (tc_attention.h's supported_head_dim): a multiple of 8 (one 16-byte
# chunk of a row is wholly data or padding) up to 256; tc_attention.cu runs D on the tiles of the
# next multiple of 32.
SUPPORTED_D = tuple(range(8, 257, 8))
# The tile head dims Dp compiled (tc_attention.cu's Tile table): D runs on the smallest Dp >= D.
TILE_D = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = (torch.float16, torch.bfloat16)


def _register_fakes() -> None:
    """Meta implementations, so torch.compile can trace the ops without running them."""

    @torch.library.register_fake(f"{NAME}::attention")
    def _attention_fake(q, k, v, mask, is_causal, scale, key_lengths, window=0):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{NAME}::attention_out")
    def _attention_out_fake(q, k, v, mask, is_causal, scale, key_lengths, out, window=0):
        return None

    @torch.library.register_fake(f"{NAME}::attention_version")
    def _attention_version_fake(q, k, v, is_causal, scale, version):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{NAME}::attention_version_out")
    def _attention_version_out_fake(q, k, v, is_causal, scale, version, out):
        return None

    @torch.library.register_fake(f"{NAME}::attention_lse")
    def _attention_lse_fake(q, k, v, mask, is_causal, scale, key_lengths, window=0):
        B, H, Sq, _ = q.shape
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, H, Sq), dtype=torch.float32)

    # Autograd of attention_lse: the backward lesson's kernels (built on the first backward call).
    # That lesson imports nothing of this one, so this lazy import closes no circle.
    from phase5_fused.backward import autograd

    autograd.register_tc(f"{NAME}::attention_lse")


# tc_attention.cu compiles 128 kernel instances (2 dtypes x 8 tile head dims x padded or not x mask x
# window), the versions 16 more (4 versions x 2 dtypes x D = 64, 128; causal is a runtime flag):
# nvcc splits their optimization and assembly over every core.
load = op_loader(Path(__file__).parent, NAME, SOURCES, _register_fakes, cuda_flags=["--split-compile=0"])


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x itself if its data starts on a 16-byte boundary (the kernel's vector loads need it), else a copy."""
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _check_out(out, q, tracing: bool) -> None:
    """out= of the kernels: a contiguous, 16-byte aligned tensor of q's dtype and shape."""
    check_cuda_tensor(out, "out", (q.dtype,), dim=4)
    if out.shape != q.shape or not out.is_contiguous() or (not tracing and out.data_ptr() % 16 != 0):
        raise ValueError(f"out must be a contiguous, 16-byte aligned tensor of q's shape {tuple(q.shape)}")


def _attention_version(q, k, v, mask, is_causal, scale, key_lengths, out, return_lse, window, version):
    """attention() for a version other than "fast" (VERSIONS): the headline problem only, forward only."""
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    for name, given in (("mask", mask is not None), ("key_lengths", key_lengths is not None),
                        ("window", window is not None), ("return_lse", return_lse)):
        if given:
            raise ValueError(f"{name} is not supported by version={version!r}: only the fast kernel "
                             f"(version={DEFAULT_VERSION!r}) takes it")
    if torch.is_tensor(q) and q.dim() == 4 and not dim_in(q.shape[-1], VERSION_D):
        raise ValueError(f"head dim D={q.shape[-1]} (q.shape[-1]) is not supported by version={version!r}: use "
                         f"one of {VERSION_D} (the fast kernel takes every multiple of 8 from 8 to 256)")
    q, k, v, _, (B, H, Sq, Sk, D) = check_attention_inputs(q, k, v, dtypes=DTYPES, is_causal=is_causal, scale=scale)
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.requires_grad:
                raise ValueError(f"{name} requires grad, but version={version!r} is forward only: use "
                                 f"version={DEFAULT_VERSION!r}, or run under torch.no_grad()")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    tracing = torch.compiler.is_compiling()
    if not tracing:
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
    ops = load()
    number = VERSIONS.index(version) + 1
    if out is None:
        return ops.attention_version(q, k, v, is_causal, float(scale), number)
    _check_out(out, q, tracing)
    ops.attention_version_out(q, k, v, is_causal, float(scale), number, out)
    return out


def run_op_first(q, k, v, mask=None, is_causal=False, scale=None, window=None, key_lengths=None):
    """The common call, tried before any Python check: the fast kernel's op on the arguments as given
    (utils.checks: the op checks every tensor itself). Returns attention()'s output, or None where
    it did not run (a gradient to record, arguments the op must not see unchecked, tracing, or an
    error from the op): the checked path then names the argument or copies what it must.
    final.attention calls it too."""
    if not plain_arguments(is_causal, scale, window) or torch.compiler.is_compiling():
        return None
    try:
        if q.is_cuda and not records_grad(q, k, v):
            return load().attention(q, k, v, mask, is_causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None
                                    else scale, key_lengths, 0 if window is None else window)
    except Exception:  # noqa: BLE001 (any error: the checked path explains it or raises it again)
        pass
    return None


def attention(q, k, v, mask=None, is_causal: bool = False, scale: float | None = None,
              key_lengths=None, out: torch.Tensor | None = None, return_lse: bool = False,
              window: int | None = None, version: str = DEFAULT_VERSION):
    """softmax(scale * q k^T + mask) v on tensor cores.

    q [B, H, Sq, D], k and v [B, H_kv, Sk, D] with H % H_kv == 0 (grouped-query attention; H_kv = H
    is plain multi-head): CUDA float16 or bfloat16 (the same dtype), D in SUPPORTED_D (a multiple of
    8 from 8 to 256); non-contiguous or misaligned inputs are copied. mask: bool (True = attend) or
    float (added to the scores), broadcastable to [B, H, Sq, Sk]. is_causal: query i sees keys
    j <= i. scale: defaults to 1 / sqrt(D). key_lengths: [B] int32/int64, keys j >= key_lengths[b]
    are padding. out: optional contiguous output tensor shaped like q (written in place; not
    differentiable). return_lse: also return the row logsumexp [B, H, Sq] (float32). window: None, or
    an integer >= 1 with is_causal: query i sees keys i - window < j <= i. version: one of VERSIONS
    (module docstring); the default is the fast kernel.
    """
    if version != DEFAULT_VERSION:
        return _attention_version(q, k, v, mask, is_causal, scale, key_lengths, out, return_lse, window, version)
    if out is None and return_lse is False:
        result = run_op_first(q, k, v, mask, is_causal, scale, window, key_lengths)
        if result is not None:
            return result
    if torch.is_tensor(q) and q.dim() == 4 and not dim_in(q.shape[-1], SUPPORTED_D):
        raise ValueError(f"head dim D={q.shape[-1]} (q.shape[-1]) is not supported: use a multiple of 8 from "
                         f"{SUPPORTED_D[0]} to {SUPPORTED_D[-1]}")
    q, k, v, mask, (B, H, Sq, Sk, D) = check_attention_inputs(
        q, k, v, mask, dtypes=DTYPES, key_lengths=key_lengths, is_causal=is_causal, scale=scale, grouped=True,
        window=window)
    w = 0 if window is None else window  # the op's "no window"
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    tracing = torch.compiler.is_compiling()  # traced tensors have no data pointer
    if not tracing:
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
    ops = load()
    needs_grad = records_grad(q, k, v)
    if out is None and (return_lse or needs_grad):  # the backward needs the logsumexp
        result, lse = ops.attention_lse(q, k, v, mask, is_causal, float(scale), key_lengths, w)
        return (result, lse) if return_lse else result
    if out is None:
        return ops.attention(q, k, v, mask, is_causal, float(scale), key_lengths, w)
    if needs_grad or return_lse:
        raise ValueError("out= writes in place: it cannot record a gradient or return lse; pass out=None")
    _check_out(out, q, tracing)
    ops.attention_out(q, k, v, mask, is_causal, float(scale), key_lengths, out, w)
    return out
