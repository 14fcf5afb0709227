"""Phase 5, backward: FlashAttention-2's backward pass (Dao, "FlashAttention-2", Algorithm 2).

    from phase5_fused import backward
    dq, dk, dv = backward.attention_backward(q, k, v, out, lse, dout, is_causal=True)

takes the forward's inputs, its output `out` and the row logsumexp `lse` it saved ([B, H, Sq]
float32, natural log: phase5_fused.fp32.attention(..., return_lse=True) or
phase5_fused.tensor_cores.attention(..., return_lse=True)) and the output's gradient `dout`, and
returns the gradients of q, k and v. float32 runs bwd_fp32.cu (the teaching kernel), float16 and
bfloat16 run bwd_tc.cu (mma.sync tensor cores); both first compute D_i = rowsum(dO_i * O_i)
(bwd_preprocess.cu). Semantics are the forwards' (utils.reference): bool or additive masks (no
gradient for the mask), causal top-left aligned, stride (float32 only), key_lengths, a sliding
window (window=w with is_causal: query i sees keys i - w < j <= i; the query blocks no window
reaches are skipped); rows with no visible key, and padding keys, get zero gradients. `dlse`,
optional, is the gradient of lse where a loss used it. k and v may have H_kv heads, H % H_kv == 0
(grouped-query attention, as the forwards): the kernels read query head h's K/V through
h // (H // H_kv), write dk and dv per query head, and the op sums each group's heads
(FlashAttention-2's expanded buffer: H / H_kv times the dk, dv memory for the duration of the
call); dk and dv have k's shape. Head dims: float32 takes the FP32 forward's
(phase5_fused.fp32.SUPPORTED_D, every multiple of 8 up to 256, checked by the op with that
forward's C++ rule); float16 and bfloat16 take TC_SUPPORTED_D, every multiple of 8 up to 256 (bwd.h),
as the tensor-core forward (variants 0 and 1 up to TC_ROW_TILE_MAX_D = 128).

The forwards' ops get their autograd formulas from phase5_fused.backward.autograd, which each
forward package registers when it loads its extension: phase5_fused.fp32.attention and
phase5_fused.tensor_cores.attention are differentiable. Importing this package builds nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from utils.build import op_loader
from utils.checks import check_attention_inputs, check_cuda_tensor

NAME = "phase5_fused_bwd"
SOURCES = ["bwd_ops.cpp", "bwd_prepare.cpp", "bwd_preprocess.cu", "bwd_fp32.cu", "bwd_tc.cu", "bwd_tc_2d.cu", "bwd_tf32x3.cu"]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Head dims of the tensor-core kernel (bwd.h's tc_supports_head_dim, which the op checks), the
# tensor-core forward's. D runs on the tiles of the smallest width in TC_TILE_D at least D (bwd.h's
# kTcTileD), zero-filled from column D on; variants 0 and 1 take D up to TC_ROW_TILE_MAX_D (bwd.h's
# kTcRowTileMaxD), variant 2 every D.
TC_SUPPORTED_D = tuple(range(8, 257, 8))
TC_TILE_D = (32, 64, 96, 128, 160, 192, 224, 256)
TC_ROW_TILE_MAX_D = 128
# Kernels (float32: 0 = bwd_fp32.cu on FFMA, 1 = bwd_tf32x3.cu in 3xTF32 on tensor cores, D in
# TF32X3_SUPPORTED_D) and tile configurations (bwd_tc.cu: 0 = 4 warps and Bc = 64, 1 = 8 warps and
# Bc = 128; bwd_tc_2d.cu: 2 = 8 warps, Bc = 128, FlashAttention-2's two-dimensional warp tiles) of
# each dtype.
VARIANTS = {torch.float32: 2, torch.float16: 3, torch.bfloat16: 3}
TF32X3_SUPPORTED_D = (32, 64, 96, 128)
# The variant autograd runs: the ops' variant -1, which picks per head dim and GPU (bwd_ops.cpp,
# default_variant): FP32's 3xTF32 kernel at D = 64 and 128 and variant 0 at the head dims not measured;
# FP16 and BF16's variant 2 at every head dim where a block may have its shared memory, else variant 1
# (the fastest the variants and head-dims variants tables measured that the GPU holds).
DEFAULT_VARIANT = -1
# The op of each dtype: the FP32 teaching kernel, or the tensor-core kernel.
OPS = {torch.float32: "attention_backward_fp32", torch.float16: "attention_backward_tc",
       torch.bfloat16: "attention_backward_tc"}


def _register_fakes() -> None:
    """Meta implementations, so torch.compile can trace a backward through the ops."""

    def fake(q, k, v, out, lse, dout, dlse, mask, is_causal, scale, stride, key_lengths, variant=-1, window=0):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    for name in set(OPS.values()):
        torch.library.register_fake(f"{NAME}::{name}")(fake)


load = op_loader(Path(__file__).parent, NAME, SOURCES, _register_fakes)


def is_aligned(x: torch.Tensor) -> bool:
    """Whether x's data starts at a 16-byte aligned address, as the tensor-core kernels' 16-byte
    loads (cp.async, TMA) need. A traced tensor has no data pointer: it counts as aligned."""
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or is_fake(x) or x.data_ptr() % 16 == 0


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """The tensor-core kernel reads rows with 16-byte cp.async: copy a misaligned tensor."""
    return x if is_aligned(x) else x.clone()


def tc_tile_d(D: int) -> int:
    """The tile width the tensor-core kernel runs head dim D on (D in TC_SUPPORTED_D)."""
    return min(width for width in TC_TILE_D if width >= D)


def variants_for(dtype: torch.dtype, D: int) -> tuple[int, ...]:
    """The variants of dtype's kernels that take head dim D (float32's variant 1: TF32X3_SUPPORTED_D;
    float16 and bfloat16's variants 0 and 1: D up to TC_ROW_TILE_MAX_D)."""
    if dtype == torch.float32:
        return tuple(n for n in range(VARIANTS[dtype]) if n == 0 or D in TF32X3_SUPPORTED_D)
    return tuple(n for n in range(VARIANTS[dtype]) if n == 2 or D <= TC_ROW_TILE_MAX_D)


def attention_backward(q, k, v, out, lse, dout, mask=None, is_causal=False, scale=None, stride=None,
                       key_lengths=None, dlse=None, variant=None, window=None):
    """(dq, dk, dv) of softmax(scale q k^T + mask) v, from the forward's out and lse (see the module
    docstring). Non-contiguous inputs are copied. variant: the kernel's tile configuration
    (VARIANTS; run.py compares them); None: DEFAULT_VARIANT, the one autograd runs."""
    q, k, v, mask, (B, H, Sq, Sk, D) = check_attention_inputs(
        q, k, v, mask=mask, stride=stride, dtypes=DTYPES, key_lengths=key_lengths, is_causal=is_causal,
        scale=scale, grouped=True, window=window)
    for name, x in (("out", out), ("dout", dout)):
        check_cuda_tensor(x, name, (q.dtype,), dim=4)
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    for name, x in (("lse", lse), ("dlse", dlse)):
        if x is None and name == "dlse":
            continue
        check_cuda_tensor(x, name, (torch.float32,), dim=3)
        if x.shape != (B, H, Sq):
            raise ValueError(f"{name} must be [B, H, Sq] = {[B, H, Sq]}, got {tuple(x.shape)}")
    if q.dtype != torch.float32 and stride not in (None, 1):
        raise ValueError(f"stride is supported in float32 only (the tensor-core forward has none), got {stride!r}")
    if variant is None:
        variant = DEFAULT_VARIANT
    elif isinstance(variant, bool) or not isinstance(variant, int) or not 0 <= variant < VARIANTS[q.dtype]:
        raise ValueError(f"variant must be in [0, {VARIANTS[q.dtype]}) for {q.dtype}, got {variant!r}")
    elif variant not in variants_for(q.dtype, D):
        if q.dtype == torch.float32:
            raise ValueError(f"q: head dim D={D} is not supported by the 3xTF32 backward (variant 1 takes "
                             f"{TF32X3_SUPPORTED_D}): use variant 0")
        raise ValueError(f"q: head dim D={D} is above variant {variant}'s {TC_ROW_TILE_MAX_D} (a warp's dK, dV "
                         f"rows in registers): use variant 2 (or None, the default)")
    out, lse, dout = out.contiguous(), lse.contiguous(), dout.contiguous()
    dlse = None if dlse is None else dlse.contiguous()
    if q.dtype != torch.float32 or variant in (1, DEFAULT_VARIANT):  # 16-byte cp.async loads
        q, k, v, dout = _aligned(q), _aligned(k), _aligned(v), _aligned(dout)
    op = getattr(load(), OPS[q.dtype])
    return op(q, k, v, out, lse, dout, dlse, mask, is_causal, None if scale is None else float(scale),
              1 if stride is None else stride, key_lengths, variant, 0 if window is None else window)
