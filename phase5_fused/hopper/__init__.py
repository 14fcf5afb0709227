"""Phase 5, Hopper: FlashAttention-3-style forward on TMA and wgmma (sm_90a only).

    from phase5_fused import hopper
    out = hopper.attention(q, k, v, is_causal=True)               # q, k, v: CUDA float16 / bfloat16
    out, lse = hopper.attention(q, k, v, return_lse=True)
    dq, dk, dv = hopper.attention_backward(q, k, v, out, lse, dout, is_causal=True)

Supports D in SUPPORTED_D, any Sq and Sk (Sq != Sk too), grouped-query K/V (H_kv heads), causal (top-left aligned, as torch SDPA),
key padding by key_lengths [B], a scale (default 1/sqrt(D)), and the row logsumexp (natural log,
FP32 [B, H, Sq]). Rows with no visible key give zeros and lse = -inf. Boolean / additive masks are
not taken (the mma.sync kernel, phase5_fused.tensor_cores, takes them). Each version of the lesson
(VERSIONS, README "Versions") is selectable; DEFAULT_VERSION is the one the API uses.

The backward pass (hopper_bwd.cu, ../backward/README.md "On Hopper") is FlashAttention-2's
Algorithm 2 on TMA and wgmma: attention_backward calls it directly, and attention is differentiable
through it (a formula in C++ registered on the op, hopper_autograd.cpp), grouped-query K/V heads
included.

Importing this module builds nothing; load() builds the extension on first use.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from phase5_fused.backward import is_aligned
from utils.build import op_loader
from utils.checks import check_attention_inputs, dim_in, plain_arguments, records_grad

NAME = "phase5_fused_hopper"
SOURCES = ["hopper_v1_wgmma_tma.cu", "hopper_v2_warp_specialized.cu", "hopper_v3_intra_overlap.cu",
           "hopper_v4_pingpong.cu", "hopper_v5_tiles.cu",
           "hopper_v6_persistent.cu", "hopper_v7_split_tail.cu", "hopper_v8_stream_k.cu", "hopper_bwd.cu",
           "hopper_ops.cpp",
           "hopper_autograd.cpp",
           # the backward lesson's checks and D_i, compiled into this extension too
           "../backward/bwd_prepare.cpp", "../backward/bwd_preprocess.cu"]
# wgmma, setmaxnreg and TMA's tensor copies exist only on the architecture-specific target sm_90a; a
# -gencode here replaces TORCH_CUDA_ARCH_LIST's targets for this extension (utils.build.load_phase).
CUDA_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
SUPPORTED_D = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
# The versions of the lesson, in order (hopper_v<N>_*.cu): the op's `version` argument is N.
VERSIONS = ("v1_wgmma_tma", "v2_warp_specialized", "v3_intra_overlap", "v4_pingpong", "v5_tiles",
            "v6_persistent", "v7_split_tail", "v8_stream_k")
DEFAULT_VERSION = "v7_split_tail"
# The op's `version` argument for each version name.
VERSION_NUMBERS = {name: n for n, name in enumerate(VERSIONS, start=1)}
# The backward's variants (hopper_bwd.cu: how its two warpgroups share dQ; 0 by keys, 1 by columns)
# and the one autograd runs (hopper_attention.h kBwdDefaultVariant, what hopper_autograd.cpp
# passes): the faster in the variants table, at both head dims.
BWD_VARIANTS = (0, 1)
BWD_DEFAULT_VARIANT = 1
# The GPU these kernels run on (compute capability).
HOPPER = (9, 0)


def _register_fakes() -> None:
    """Meta implementation, so torch.compile can trace the op without running it."""

    def _attention_fake(q, k, v, is_causal, scale, key_lengths, return_lse, version):
        B, H, Sq, D = q.shape
        lse = q.new_empty((B, H, Sq) if return_lse else (0,), dtype=torch.float32)
        # o in q's layout family, as the op allocates it (hopper_ops.cpp)
        if q.stride(1) < q.stride(2):
            return q.new_empty((B, Sq, H, D)).transpose(1, 2), lse
        return q.new_empty((B, H, Sq, D)), lse

    for name in ("attention", "attention_inference"):
        torch.library.register_fake(f"{NAME}::{name}")(_attention_fake)

    @torch.library.register_fake(f"{NAME}::attention_backward")
    def _attention_backward_fake(q, k, v, out, lse, dout, dlse, is_causal, scale, key_lengths, variant):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the op's


load = op_loader(Path(__file__).parent, NAME, SOURCES, _register_fakes, cuda_flags=CUDA_FLAGS)


def _tma_readable(x: torch.Tensor) -> torch.Tensor:
    """x itself if TMA can read it in place (the op's check_tma_layout: D contiguous, the other
    strides positive multiples of 16 bytes, the data 16-byte aligned), else a contiguous copy.
    A traced tensor (torch.compile's fakes) has no data pointer: its strides alone decide."""
    rows_ok = x.is_contiguous() or (x.stride(-1) == 1 and all(
        n == 1 or (s > 0 and s * x.element_size() % 16 == 0) for n, s in zip(x.shape[:-1], x.stride()[:-1])))
    if rows_ok and is_aligned(x):
        return x
    return x.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def device_capability(index: int) -> tuple | None:
    """A device's compute capability, asked once per device (the driver query costs microseconds);
    None where no GPU is visible (fake CUDA tensors)."""
    return tuple(torch.cuda.get_device_capability(index)) if torch.cuda.is_available() else None


def check_hopper(device: torch.device) -> None:
    """Raise unless `device` is a Hopper GPU (sm_90): the kernels are compiled for sm_90a only."""
    capability = device_capability(device.index if device.index is not None else torch.cuda.current_device())
    if capability != HOPPER:
        raise RuntimeError(f"phase5_fused.hopper needs a Hopper GPU (sm_90): {torch.cuda.get_device_name(device)} "
                           f"is sm_{capability[0]}{capability[1]}; use phase5_fused.tensor_cores there")


def attention(q, k, v, is_causal: bool = False, scale: float | None = None, key_lengths=None,
              return_lse: bool = False, version: str = DEFAULT_VERSION, mask=None):
    """softmax(scale * q k^T) v on Hopper's TMA and wgmma.

    q [B, H, Sq, D], k and v [B, H_kv, Sk, D] with H a multiple of H_kv (grouped-query attention:
    query head h reads K/V head h // (H // H_kv), nothing copied): CUDA float16 or bfloat16 (the
    same dtype), D in SUPPORTED_D, any strides with D contiguous (views of [B, S, H, D] or of a packed
    qkv are read in place; a layout TMA cannot read is copied). is_causal: query i sees keys
    j <= i. scale: defaults to 1 / sqrt(D). key_lengths: [B] int32/int64, keys j >= key_lengths[b]
    are padding. return_lse: also return the FP32 row logsumexp [B, H, Sq] (natural log; -inf for
    rows with no visible key). version: one of VERSIONS. mask: not supported (raises).
    Returns out, or (out, lse); out is [B, H, Sq, D] in q's layout family: a view of [B, Sq, H, D]
    memory when q's heads are interleaved within a position (q.stride(1) < q.stride(2)), else
    contiguous.
    """
    # The common call first: the op on the arguments as given (utils.checks: the op checks every tensor
    # and the GPU itself; where it raises, the checked path below names the argument or copies a
    # layout TMA cannot read). A training call too: the differentiable op records the graph in C++
    # (hopper_autograd.cpp) and asks for L.
    if mask is None and (return_lse is True or return_lse is False) and plain_arguments(is_causal, scale) \
            and not torch.compiler.is_compiling():
        try:
            number = VERSION_NUMBERS.get(version)
            # (the GPU is asked before load(): the extension is built for Hopper only)
            if number is not None and q.is_cuda and device_capability(q.get_device()) == HOPPER:
                needs_grad = records_grad(q, k, v)
                ops = load()
                op = ops.attention if needs_grad else ops.attention_inference
                out, lse = op(q, k, v, is_causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
                              key_lengths, return_lse or needs_grad, number)
                return (out, lse) if return_lse else out
        except Exception:  # noqa: BLE001 (any error: the checked path explains it or raises it again)
            pass
    if mask is not None:
        raise ValueError("mask is not supported by the Hopper kernel (causal and key_lengths only): "
                         "use phase5_fused.tensor_cores.attention for boolean or additive masks")
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    q, k, v, _, (B, H, Sq, Sk, D) = check_attention_inputs(
        q, k, v, dtypes=DTYPES, supported_d=lambda d: dim_in(d, SUPPORTED_D), key_lengths=key_lengths,
        is_causal=is_causal, scale=scale, grouped=True, contiguous=False)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    tracing = torch.compiler.is_compiling()  # traced tensors have no data pointer nor a device to ask
    if not tracing:
        check_hopper(q.device)
    q, k, v = (_tma_readable(x) for x in (q, k, v))
    needs_grad = records_grad(q, k, v)
    # The backward needs the logsumexp: asked for whenever autograd records the call (through the op
    # that carries the autograd formula; attention_inference otherwise).
    ops = load()
    op = ops.attention if needs_grad else ops.attention_inference
    out, lse = op(q, k, v, is_causal, float(scale), key_lengths, return_lse or needs_grad, VERSION_NUMBERS[version])
    return (out, lse) if return_lse else out


def attention_backward(q, k, v, out, lse, dout, is_causal: bool = False, scale: float | None = None,
                       key_lengths=None, dlse=None, variant: int | None = None):
    """(dq, dk, dv) of softmax(scale q k^T) v on Hopper (hopper_bwd.cu), from the forward's out and
    lse ([B, H, Sq] float32, natural log: attention(..., return_lse=True)) and the output's gradient
    dout. q, k, v as attention takes them (k, v may have H_kv heads; dk and dv have k's shape, each
    summed over the query heads that share it); q, k, v, out and dout are read in place where TMA
    can (views with contiguous rows, as attention's), else copied. dlse, optional: the gradient of
    lse where a loss used it. The checks are the backward lesson's
    (phase5_fused.backward.attention_backward), with D in SUPPORTED_D. variant: one of BWD_VARIANTS;
    None: BWD_DEFAULT_VARIANT, the one autograd runs."""
    q, k, v, _, (B, H, Sq, Sk, D) = check_attention_inputs(
        q, k, v, dtypes=DTYPES, supported_d=lambda d: dim_in(d, SUPPORTED_D), key_lengths=key_lengths,
        is_causal=is_causal, scale=scale, grouped=True, contiguous=False)
    if variant is None:
        variant = BWD_DEFAULT_VARIANT
    if isinstance(variant, bool) or variant not in BWD_VARIANTS:
        raise ValueError(f"variant must be one of {BWD_VARIANTS}, got {variant!r}")
    tracing = torch.compiler.is_compiling()
    if not tracing:
        check_hopper(q.device)
    q, k, v, out, dout = (_tma_readable(x) for x in (q, k, v, out, dout))
    return load().attention_backward(q, k, v, out, lse.contiguous(), dout,
                                     None if dlse is None else dlse.contiguous(), is_causal,
                                     None if scale is None else float(scale), key_lengths, variant)
