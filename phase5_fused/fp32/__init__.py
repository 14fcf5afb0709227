"""Phase 5, FP32: fused FlashAttention-style attention (online softmax, no S x S buffer).

attention(q, k, v, mask=None, is_causal=False, scale=None, stride=None, key_lengths=None,
          return_lse=False, kernel="fast", variant=0, window=None)
    softmax(scale * q k^T + mask) v for q [B, H, Sq, D], k/v [B, H, Sk, D], float32 CUDA tensors.
    `kernel` picks one of the six versions of the lesson (KERNELS, in order, each one idea further;
    README "Versions"): "teaching" runs fused_teaching.cu (Algorithm 1 in its clearest form), "v2"
    fused_v2_register_tiles.cu, "v3" fused_v3_cp_async.cu, "v4" fused_v4_exp2.cu, "fast"
    fused_fast.cu (register-tiled, cp.async, exp2, gathered strided keys), and "tf32x3"
    fused_v6_tf32x3.cu (both matmuls on tensor cores in 3xTF32, sm_80+). Every version computes
    the same function. Head dims: the fast kernel takes D in SUPPORTED_D (every multiple of 8 from 8
    to 256; a D outside VERSION_D runs on the padded tiles of the next multiple of 32,
    PADDED_TILE_D), the other versions D in VERSION_D only (ValueError naming D and the kernel).
    Semantics are utils.reference's: bool mask True = attend or additive float mask broadcastable
    to [B, H, Sq, Sk], causal top-left aligned, stride (keys j % stride == 0), key_lengths [B]
    (int32/int64) for key padding; fully masked rows give zeros (lse -inf).
    The fast kernel also takes grouped-query attention, k and v [B, H_kv, Sk, D] with H % H_kv == 0
    (query head h reads KV head h // (H // H_kv); nothing is copied), and a sliding window with
    is_causal: window=w lets query i see keys i - w < j <= i; key tiles below a query block's window
    are never loaded. Both combine with masks, stride and key_lengths. The other versions take
    neither (ValueError).
    Returns out, or (out, lse) with lse [B, H, Sq] the natural-log row logsumexp.
    kernel="fastest" runs version 6 wherever it takes the inputs (D in VERSION_D, one K/V head per
    query head, no window, no stride) and the fast kernel for the rest, the choice made in the op
    (fused.h's fastest_is_version6): what final.attention's `fused` mode runs.
    Differentiable in q, k, v (not in the mask): the backward is phase5_fused.backward's FP32
    kernel (FlashAttention-2, Algorithm 2); when an input requires grad the forward also writes lse,
    the one statistic the backward needs. The backward takes grouped heads and windows too.

Nothing is built at import; the extension is compiled on the first call (or load()).
The FP16/BF16 tensor-core kernel is the next lesson: phase5_fused.tensor_cores.
"""

from __future__ import annotations

from pathlib import Path

import torch

from utils.build import op_loader
from utils.checks import check_attention_inputs, dim_in, grouped_or_window, plain_arguments, records_grad

# The head dims every version takes, each with instances of its own (fused.h's kVersionD).
VERSION_D = (32, 64, 80, 96, 128)
# The head dims the fast kernel (and the FP32 backward) takes (fused.h's fast_supports_head_dim): every
# multiple of 8 from 8 to 256, a 16-byte chunk of a row being wholly data or padding.
SUPPORTED_D = tuple(range(8, 257, 8))
# The tile widths of the fast kernel's padded instances (fused_fast.cu's launch_padded): a D outside
# VERSION_D runs on the smallest one >= D, its columns past D zero-filled on load and never stored.
PADDED_TILE_D = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = (torch.float32,)
# The versions of the fused kernel, in the order of the lesson (v1 ... v6).
KERNELS = ("teaching", "v2", "v3", "v4", "fast", "tf32x3")
# Tile configurations (Br x Bc) of the fast kernel's own instances per D in VERSION_D, in variant
# order (fused_fast.cu's launch_fast); variant 0 is the default. Every other D has one variant, the
# padded tile of its width (PADDED_TILES).
FAST_TILES = {32: ("64x64",), 64: ("128x64", "64x64"), 80: ("64x64",), 96: ("64x64",), 128: ("64x64", "64x32")}
PADDED_TILES = {32: "64x64", 64: "64x64", 96: "64x32", 128: "64x32", 160: "32x32", 192: "32x32", 224: "32x32",
                256: "32x16"}
FAST_VARIANTS = {D: len(FAST_TILES.get(D, ("padded",))) for D in SUPPORTED_D}
# What `kernel` may name: a version, or "fastest" (version 6 where it takes the inputs, else the fast
# kernel; the op decides: fused.h's fastest_is_version6).
KERNEL_CHOICES = (*KERNELS, "fastest")
# The kernels with a second op without an autograd formula (attention_<kernel>_inference), which are
# also the ones that take every D in SUPPORTED_D, grouped heads and a window.
INFERENCE_KERNELS = ("fast", "fastest")
SOURCES = ["ops.cpp", "fused_teaching.cu", "fused_v2_register_tiles.cu", "fused_v3_cp_async.cu",
           "fused_v4_exp2.cu", "fused_fast.cu", "fused_v6_tf32x3.cu"]


def _register_fakes() -> None:
    """Meta implementations so torch.compile can trace the ops (shapes only)."""

    def fake(q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse, *variant):
        B, H, Sq, _ = q.shape
        lse = q.new_empty((B, H, Sq) if return_lse else (0,))
        return torch.empty_like(q), lse

    for name in (*KERNEL_CHOICES, *(f"{kernel}_inference" for kernel in INFERENCE_KERNELS)):
        torch.library.register_fake(f"phase5_fused::attention_{name}")(fake)
    torch.library.register_fake("phase5_fused::attention_fastest_out")(lambda q, *args: torch.empty_like(q))
    # Autograd: the next lesson's backward kernels (built on the first backward call). That lesson
    # imports nothing of this one, so this lazy import closes no circle.
    from phase5_fused.backward import autograd

    autograd.register_fp32([f"phase5_fused::attention_{name}" for name in KERNEL_CHOICES])


load = op_loader(Path(__file__).parent, "phase5_fused", SOURCES, _register_fakes)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """The kernels read rows with 16-byte loads: copy a tensor whose data is not 16-byte aligned."""
    return x if x.data_ptr() % 16 == 0 else x.clone()


def run_op_first(q, k, v, mask=None, is_causal=False, scale=None, stride=None, window=None, key_lengths=None,
                 return_lse=False, kernel="fast"):
    """The common call, tried before any Python check: the op without an autograd formula of
    `kernel` (one of INFERENCE_KERNELS), on the arguments as given (utils.checks: the op checks every
    tensor itself). Returns attention()'s result, or None where it did not run (a gradient to record,
    arguments the op must not see unchecked, tracing, or an error from the op): the checked path
    then names the argument or copies what the op could not take as it was. final.attention calls
    it too."""
    if not plain_arguments(is_causal, scale, window, stride) or torch.compiler.is_compiling():
        return None
    try:
        if q.is_cuda and not records_grad(q, k, v):
            ops, stride, window = load(), 1 if stride is None else stride, 0 if window is None else window
            if kernel == "fastest" and not return_lse:  # the course API's call: no lse allocated, out alone
                return ops.attention_fastest_out(q, k, v, mask, is_causal, scale, stride, key_lengths, window)
            args = (q, k, v, mask, is_causal, scale, stride, key_lengths, bool(return_lse))
            if kernel == "fast":
                out, lse = ops.attention_fast_inference(*args, 0, window)
            else:
                out, lse = ops.attention_fastest_inference(*args, window)
            return (out, lse) if return_lse else out
    except Exception:  # noqa: BLE001 (any error: the checked path explains it or raises it again)
        pass
    return None


def _check_head_dim(q, kernel) -> None:
    """D = q.shape[-1] is one the kernel takes: SUPPORTED_D (fast, and fastest, which runs the fast
    kernel where version 6 does not take D) or VERSION_D (the others)."""
    if not (torch.is_tensor(q) and q.dim() == 4):
        return  # check_attention_inputs names the argument
    D = q.shape[-1]
    every_d = kernel in INFERENCE_KERNELS
    if every_d and not dim_in(D, SUPPORTED_D):
        raise ValueError(f"head dim D={D} (q.shape[-1]) is not supported by the fast kernel: use a multiple of 8 "
                         f"from {SUPPORTED_D[0]} to {SUPPORTED_D[-1]}")
    if not every_d and not dim_in(D, VERSION_D):
        raise ValueError(f"head dim D={D} (q.shape[-1]) is not supported by kernel={kernel!r}: use one of "
                         f"{VERSION_D}, or the fast kernel (every multiple of 8 from {SUPPORTED_D[0]} to "
                         f"{SUPPORTED_D[-1]})")


def attention(q, k, v, mask=None, is_causal=False, scale=None, stride=None, key_lengths=None,
              return_lse=False, kernel="fast", variant=0, window=None):
    """Fused attention (see the module docstring). `variant` picks the fast kernel's tile
    configuration for this D (0 = default; run.py compares them). k, v may have H_kv heads and
    `window` (with is_causal) limits each query to its last `window` keys: kernel "fast" or "fastest"
    only."""
    if kernel in INFERENCE_KERNELS and variant == 0:
        result = run_op_first(q, k, v, mask, is_causal, scale, stride, window, key_lengths, return_lse, kernel)
        if result is not None:
            return result
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    if kernel != "fast" and variant != 0:
        raise ValueError(f"variant applies to the fast kernel only (kernel={kernel!r}, variant={variant!r})")
    _check_head_dim(q, kernel)
    q, k, v, mask, (B, H, Sq, Sk, D) = check_attention_inputs(
        q, k, v, mask=mask, stride=stride, dtypes=DTYPES,
        key_lengths=key_lengths, is_causal=is_causal, scale=scale, grouped=True, window=window)
    extended = grouped_or_window(H, k.shape[1], window)
    if kernel not in INFERENCE_KERNELS and extended:
        raise ValueError(f"{extended}: the fast kernel only (kernel \"fast\" or \"fastest\"), not kernel={kernel!r}")
    # (FAST_VARIANTS[D] is looked up only for a variant > 0: D may be symbolic under torch.compile)
    if not isinstance(variant, int) or variant < 0 or (variant > 0 and variant >= FAST_VARIANTS[D]):
        raise ValueError(f"variant must be in [0, {FAST_VARIANTS[D]}) for D={D}, got {variant!r}")
    if not torch.compiler.is_compiling():  # traced tensors have no data pointer
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
    ops = load()
    # The backward needs the logsumexp: ask for it when autograd will want a gradient.
    needs_grad = records_grad(q, k, v)
    args = (q, k, v, mask, is_causal, None if scale is None else float(scale),
            1 if stride is None else stride, key_lengths, bool(return_lse) or needs_grad)
    # Without a gradient to record, the op without an autograd formula where the version has one: no
    # Python on the way to the launch.
    inference = kernel in INFERENCE_KERNELS and not needs_grad
    op = getattr(ops, f"attention_{kernel}_inference" if inference else f"attention_{kernel}")
    window = 0 if window is None else window
    out, lse = op(*args, *{"fast": (variant, window), "fastest": (window,)}.get(kernel, ()))
    return (out, lse) if return_lse else out
