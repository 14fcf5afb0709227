"""One attention API over every phase's kernels.

    from final.attention import cuda_attention_forward, CUDAAttention, supported_modes
    out = cuda_attention_forward(q, k, v, mode="auto", mask=None, is_causal=False, scale=None, stride=None,
                                 window=None)

q [B, H, Sq, D], k and v [B, H_kv, Sk, D]; semantics are utils.reference's for every mode: mask bool
(True = attend) or additive float broadcastable to [B, H, Sq, Sk], is_causal top-left aligned (query
i sees keys j <= i, also when Sq != Sk), stride keeps keys j % stride == 0, scale defaults to
1/sqrt(D), a row with no visible key gives zeros. The output has q's dtype. Grouped-query attention
(GQA; MQA when H_kv = 1): H_kv may divide H, query head h reads KV head h // (H // H_kv). window
(with is_causal): query i sees keys i - window < j <= i.

Modes and what each takes (MODE_INFO holds it as data, read from the packages that define it):

    mode          kernel                           device  dtypes               D                            stride  mask  gqa  window  backward
    reference     utils.reference, float64         any     any float            any                          yes     yes   yes  yes     yes
    naive         phase 2, three naive kernels     CUDA    float32              1..unfused_api.MAX_HEAD_DIM  no      yes   no   no      no
    tiled         phase 3, three tiled kernels     CUDA    float32              1..unfused_api.MAX_HEAD_DIM  no      yes   no   no      no
    coalesced     phase 4, three coalesced kernels CUDA    float32              1..unfused_api.MAX_HEAD_DIM  no      yes   no   no      no
    fused         phase 5, FlashAttention FP32     CUDA    fp32.DTYPES          fp32.SUPPORTED_D             yes     yes   yes  yes     yes
    fused_tc      phase 5, tensor cores FP16/BF16  CUDA    tensor_cores.DTYPES  tensor_cores.SUPPORTED_D     no      yes   yes  yes     yes
    fused_hopper  phase 5, Hopper TMA + wgmma      sm_90   hopper.DTYPES        hopper.SUPPORTED_D           no      no    yes  no      yes

"backward: no" means the mode refuses inputs that require grad while grad is enabled (it has no
backward pass; under torch.no_grad() it runs). A backward pass takes what its forward takes
(grouped heads, windows, every head dim).
fused_hopper runs on a Hopper GPU (compute capability 9.0) only. fused runs version 6 of phase 5's FP32
lesson (FP32 products on tensor cores in 3xTF32, as accurate as FFMA; sdpa_efficient does the same
for float32) wherever it takes the inputs (D in fp32.VERSION_D, one K/V head per query head, no
window, no stride), and the fast FFMA kernel for the rest (the op of fp32's kernel="fastest" decides).

mode="auto" picks the first mode of AUTO_ORDER = (fused_hopper, fused_tc, fused, coalesced, tiled,
naive) that takes the inputs: roughly the order of the phases' measured speed (phase5_fused/fp32/results/metrics.json
times them all in one run; fused_tc and fused never compete, they take different dtypes; fused_hopper
is picked on an H100 for unmasked FP16/BF16 at D=64 or 128, grouped-query heads included (in
training too), fused_tc for the rest, masks and windows included).
auto never picks "reference": a float64 reference running in place of a kernel would be a silent
fallback, so when no CUDA mode takes the inputs (CPU tensors, float64, float32 at D=260, stride with
float16, ...) auto raises and names the modes that would, reference among them.
An explicit mode that cannot take the inputs raises likewise; no mode ever falls back to another.

supported_modes(q, k, v, mask, stride, window) decides from metadata alone (device type, dtype, D,
stride, whether a mask is given, whether a gradient is needed, the GPU's compute capability, whether
k has fewer heads than q, whether a window is given), so it runs on
CPU and under torch.compile. Importing this module builds nothing; a phase's extension
is built on the first call of its mode. Every phase op is a TORCH_LIBRARY op with a fake
implementation, so CUDAAttention runs under torch.compile(fullgraph=True).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

# The phase packages build nothing at import (each builds its extension on its first call).
import phase2_naive
import phase3_tiled
import phase4_coalesced
from phase5_fused import fp32, hopper, tensor_cores
from utils import reference
from utils.checks import check_attention_shapes, check_tensor, check_window, dim_in
from utils.unfused_api import MAX_HEAD_DIM

MODES = ("reference", "naive", "tiled", "coalesced", "fused", "fused_tc", "fused_hopper")
AUTO_ORDER = ("fused_hopper", "fused_tc", "fused", "coalesced", "tiled", "naive")


@dataclass(frozen=True)
class ModeInfo:
    """What one mode takes. dtypes None: any floating dtype; head_dims None: any D >= 1; capability
    None: any CUDA GPU. gqa: k, v with fewer heads than q (grouped-query attention); window: a
    sliding window (a mode's backward pass takes both, and every head dim, wherever its forward does)."""
    kernel: str
    cuda: bool
    dtypes: tuple | None
    head_dims: tuple | range | None
    stride: bool
    mask: bool = True
    backward: bool = True
    capability: tuple | None = None
    gqa: bool = False
    window: bool = False

    def rejects(self, device_type: str, dtype: torch.dtype, D: int, stride, mask: bool = False,
                grad: bool = False, capability: tuple | None = None, gqa: bool = False,
                window: bool = False) -> str | None:
        """Why this mode cannot take such inputs, or None if it can (mask: a mask is given; grad:
        a gradient is needed; capability: the GPU's compute capability, for CUDA tensors; gqa: k
        has fewer heads than q; window: a sliding window is given)."""
        if self.cuda and device_type != "cuda":
            return f"needs CUDA tensors (got {device_type})"
        # tuple(): torch 2.11's compiler fails on != between the constant _capability returns and a tuple
        if self.capability is not None and (capability is None or tuple(capability) != self.capability):
            return f"needs a GPU of compute capability {self.capability} (got {capability})"
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"needs {'/'.join(_dt(d) for d in self.dtypes)} (got {_dt(dtype)})"
        if self.head_dims is not None and not dim_in(D, self.head_dims):
            return f"needs D in {_dims(self.head_dims)} (got {D})"
        if stride is not None and stride != 1 and not self.stride:
            return "has no stride support"
        if mask and not self.mask:
            return "takes no mask"
        if gqa and not self.gqa:
            return "takes no grouped-query k, v (k has fewer heads than q)"
        if window and not self.window:
            return "takes no window"
        if grad and not self.backward:
            return "has no backward pass (the inputs require grad)"
        return None


# Each mode's limits, read from the packages that define them (phases 2-4 share utils.unfused_api's).
UNFUSED_D = range(1, MAX_HEAD_DIM + 1)
MODE_INFO = {
    "reference": ModeInfo("utils.reference (float64)", False, None, None, True, gqa=True, window=True),
    "naive": ModeInfo("phase2_naive", True, (torch.float32,), UNFUSED_D, False, backward=False),
    "tiled": ModeInfo("phase3_tiled", True, (torch.float32,), UNFUSED_D, False, backward=False),
    "coalesced": ModeInfo("phase4_coalesced", True, (torch.float32,), UNFUSED_D, False, backward=False),
    "fused": ModeInfo("phase5_fused.fp32 (fastest: tf32x3 or fast)", True, fp32.DTYPES, fp32.SUPPORTED_D, True,
                      gqa=True, window=True),
    "fused_tc": ModeInfo("phase5_fused.tensor_cores", True, tensor_cores.DTYPES, tensor_cores.SUPPORTED_D, False,
                         gqa=True, window=True),
    "fused_hopper": ModeInfo("phase5_fused.hopper", True, hopper.DTYPES, hopper.SUPPORTED_D, False, mask=False,
                             capability=hopper.HOPPER, gqa=True),
}


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dims(dims) -> str:
    """Head dims for a message: a..b when consecutive, {a, b, ..., z} when evenly stepped, else each."""
    d = tuple(dims)
    if len(d) > 3 and d == tuple(range(d[0], d[-1] + 1, d[1] - d[0])):
        return f"{d[0]}..{d[-1]}" if d[1] - d[0] == 1 else f"{{{d[0]}, {d[1]}, ..., {d[-1]}}}"
    return "{" + ", ".join(map(str, d)) + "}"


class UnsupportedModeError(ValueError):
    """A mode that cannot take the inputs (or an unknown mode); the message lists the modes that can."""


# ------------------------------------------------------------------------------------------------
# Mode resolution (from metadata, so it runs on CPU and under torch.compile)


def supported_modes(q, k=None, v=None, mask=None, stride=None, window=None) -> list[str]:
    """The modes that take these inputs, fastest first (AUTO_ORDER, then "reference").

    Decided from metadata only (q's device type and dtype, D = q.shape[-1], stride, whether a mask
    is given, whether a gradient is needed, the GPU's compute capability, whether k has fewer heads
    than q, whether a window is given); k, v and mask are checked for consistency
    (utils.checks.check_attention_shapes, the check every phase API runs) when given, which raises on
    bad input whatever the mode. Works on CPU, meta and fake tensors and under torch.compile."""
    if k is not None and v is not None:
        check_attention_shapes(q, k, v, mask, stride, grouped=True)
    else:
        check_tensor(q, "q", dim=4)
    facts = _facts(q, k, v, mask, stride, window)
    return [m for m in (*AUTO_ORDER, "reference") if MODE_INFO[m].rejects(*facts) is None]


def _needs_grad(q, k, v) -> bool:
    """Autograd will record the call (utils.checks.records_grad, where k and v may be None)."""
    return torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)
                                        or (v is not None and v.requires_grad))


@torch.compiler.assume_constant_result
def _capability(index: int) -> tuple | None:
    """The compute capability of CUDA device `index` (hopper.device_capability, for the compiler a
    constant)."""
    return hopper.device_capability(index)


def _grouped(q, k) -> bool:
    """k has fewer heads than q (grouped-query attention); False when k is not given."""
    return k is not None and k.shape[1] != q.shape[1]


def _facts(q, k, v, mask, stride, window=None) -> tuple:
    """The arguments of ModeInfo.rejects for these inputs."""
    cuda = q.device.type == "cuda"
    capability = _capability(q.device.index if q.device.index is not None else 0) if cuda else None
    return (q.device.type, q.dtype, q.shape[-1], stride, mask is not None, _needs_grad(q, k, v), capability,
            _grouped(q, k), window is not None)


def resolve_mode(mode: str, q, k=None, v=None, mask=None, stride=None, window=None) -> str:
    """The concrete mode that runs: `mode` itself if it takes the inputs, auto's pick for "auto";
    otherwise UnsupportedModeError naming the modes that would take them.

    The answer depends on the signature alone (mode, q's device, dtype, rank and D, stride, whether
    a mask is given and a gradient needed, whether k has fewer heads than q, whether a window is
    given), so it is remembered per signature (_RESOLVED): a
    repeated call costs one dict lookup instead of every mode's rule (the per-call cost a
    20-microsecond decode kernel would otherwise pay). Only answers are remembered; a signature
    that raised is decided, and explained, again."""
    if k is not None and v is not None:
        check_attention_shapes(q, k, v, mask, stride, grouped=True)
    return _resolve_cached(mode, q, k, v, mask, stride, window)


def _resolve_cached(mode: str, q, k, v, mask, stride, window=None) -> str:
    """resolve_mode without the shape check (the phase API that runs next checks the inputs)."""
    key = _signature(mode, q, k, v, mask, stride, window)
    if key is None:  # (traced code never reads the dict: no guard on its contents, no recompile)
        return _resolve(mode, q, k, v, mask, stride, window)
    try:
        resolved = _RESOLVED.get(key)
    except TypeError:  # an unhashable mode or stride: the full path names it
        return _resolve(mode, q, k, v, mask, stride, window)
    if resolved is None:
        resolved = _resolve(mode, q, k, v, mask, stride, window)
        if len(_RESOLVED) >= _MAX_SIGNATURES:  # unbounded strides or head dims: start afresh
            _RESOLVED.clear()
        _RESOLVED[key] = resolved
    return resolved


# signature -> resolved mode (resolve_mode); a few entries per program (one per dtype and head size).
_RESOLVED: dict[tuple, str] = {}
_MAX_SIGNATURES = 1024


def _signature(mode, q, k, v, mask, stride, window=None) -> tuple | None:
    """What decides the mode, as a dict key; None where there is none: under torch.compile (D may be
    symbolic, and the traced code runs the rules once per trace anyway) and for a q that is no
    tensor or has no dimension (the full path raises the error that names it)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return (mode, q.device, q.dtype, q.ndim, q.shape[-1], stride, mask is not None, _needs_grad(q, k, v),
                _grouped(q, k), window is not None)
    except (AttributeError, IndexError, TypeError):
        return None


def _resolve(mode: str, q, k, v, mask, stride, window=None) -> str:
    """resolve_mode's decision from the rules themselves (MODE_INFO), with its errors."""
    if mode != "auto" and mode not in MODES:
        raise UnsupportedModeError(f"unknown attention mode {mode!r}; modes are {('auto', *MODES)}")
    ok = supported_modes(q, k, v, mask, stride, window)
    if mode == "auto":
        cuda_ok = [m for m in ok if m != "reference"]
        if cuda_ok:
            return cuda_ok[0]
        facts = _facts(q, k, v, mask, stride, window)
        reasons = "; ".join(f"{m} {MODE_INFO[m].rejects(*facts)}" for m in AUTO_ORDER)
        raise UnsupportedModeError(
            f"mode='auto': no CUDA kernel takes {_describe(q, k, stride, window)} ({reasons}). Modes that would: "
            f"{ok}; pass mode='reference' explicitly for the float64 reference (auto never falls back to it)")
    if mode not in ok:
        reason = MODE_INFO[mode].rejects(*_facts(q, k, v, mask, stride, window))
        raise UnsupportedModeError(f"mode={mode!r} cannot take {_describe(q, k, stride, window)}: it {reason}. "
                                   f"Modes that would: {ok}")
    return mode


def _describe(q, k, stride, window) -> str:
    """The inputs' properties that decide the mode, for error messages (built only when raising)."""
    return (f"q {tuple(q.shape)} {_dt(q.dtype)} on {q.device.type}"
            + (f", k with {k.shape[1]} KV heads" if _grouped(q, k) else "")
            + (f", stride={stride}" if stride not in (None, 1) else "")
            + (f", window={window}" if window is not None else ""))


# ------------------------------------------------------------------------------------------------
# The forward


def _reference(q, k, v, mask, is_causal, scale, stride, window):
    check_attention_shapes(q, k, v, mask, stride, is_causal, scale, grouped=True, window=window)
    return reference.attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale,
                               stride=stride, window=window).to(q.dtype)


def _fused(q, k, v, mask, is_causal, scale, stride, window):
    """Phase 5's FP32 version 6 (3xTF32 tensor cores) where it takes the inputs, else its fast FFMA
    kernel: the op of kernel="fastest" decides."""
    return fp32.attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, stride=stride, window=window,
                          kernel="fastest")


def _unfused(phase):
    """Phases 2-4 take no stride, grouped heads or window (resolve_mode has refused them: stride and
    window are None here)."""
    def run(q, k, v, mask, is_causal, scale, stride, window):
        return phase.attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale)
    return run


def _fused_tc(q, k, v, mask, is_causal, scale, stride, window):
    return tensor_cores.attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, window=window)


def _fused_hopper(q, k, v, mask, is_causal, scale, stride, window):
    """resolve_mode has refused a mask, a stride and a window: none is used here."""
    return hopper.attention(q, k, v, is_causal=is_causal, scale=scale)


# mode -> the call that runs it: the phase's API, which checks the inputs (once) and launches.
_RUN = {"reference": _reference, "naive": _unfused(phase2_naive), "tiled": _unfused(phase3_tiled),
        "coalesced": _unfused(phase4_coalesced), "fused": _fused, "fused_tc": _fused_tc,
        "fused_hopper": _fused_hopper}


def _fused_op_first(q, k, v, mask, is_causal, scale, stride, window):
    """fp32.run_op_first of the kernel choice _fused runs."""
    return fp32.run_op_first(q, k, v, mask, is_causal, scale, stride, window, kernel="fastest")


def _fused_tc_op_first(q, k, v, mask, is_causal, scale, stride, window):
    """tensor_cores.run_op_first where the mode takes the arguments: fused_tc has no stride."""
    return None if stride is not None else tensor_cores.run_op_first(q, k, v, mask, is_causal, scale, window)


# Modes whose phase op, tried first on a call that records no gradient, takes exactly the inputs the
# mode's rules (MODE_INFO) take: the op checks device, dtype, D, shapes, mask and window itself.
# cuda_attention_forward calls it before resolving the mode, and resolves only where it did not run.
_OP_FIRST = {"fused": _fused_op_first, "fused_tc": _fused_tc_op_first}


def _auto_by_dtype() -> dict:
    """dtype -> (mode, head dims): auto's pick where the dtype and D alone decide it, i.e. where the
    first mode of AUTO_ORDER that takes the dtype has an op to try first (float32: fused; for
    float16 the first is fused_hopper, whose pick also depends on the GPU and the mask)."""
    picks = {}
    for dtype in {d for info in MODE_INFO.values() if info.cuda and info.dtypes for d in info.dtypes}:
        first = next(m for m in AUTO_ORDER if MODE_INFO[m].dtypes is None or dtype in MODE_INFO[m].dtypes)
        if first in _OP_FIRST:
            picks[dtype] = (first, frozenset(MODE_INFO[first].head_dims))
    return picks


_AUTO_BY_DTYPE = _auto_by_dtype()


def _run_op_first(mode, q, k, v, mask, is_causal, scale, stride, window):
    """The phase op of `mode` (for "auto", of its pick where q's dtype and D decide it), tried
    first; None where it did not run (then the mode is resolved and the phase API checks)."""
    try:
        if mode == "auto":
            mode, head_dims = _AUTO_BY_DTYPE[q.dtype]
            if q.shape[-1] not in head_dims:
                return None
        run = _OP_FIRST[mode]
    except (AttributeError, IndexError, KeyError, TypeError):  # not a tensor, no such mode: resolve
        return None
    return run(q, k, v, mask, is_causal, scale, stride, window)


def cuda_attention_forward(q, k, v, mode: str = "auto", mask=None, is_causal: bool = False,
                           scale: float | None = None, stride: int | None = None,
                           window: int | None = None) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v through the kernel `mode` names (see the module docstring).
    k and v may have H_kv heads (H % H_kv == 0); window (with is_causal): query i sees keys
    i - window < j <= i.

    Raises UnsupportedModeError (a ValueError) for an unknown mode or one that cannot take the
    inputs, listing the modes that would; TypeError / ValueError naming the argument for bad input.
    A call that records no gradient, in a mode whose op enforces the mode's rules itself (fused,
    fused_tc, and auto for float32), goes to that op first (the phases' run_op_first); otherwise,
    or where the op raised, the mode is chosen from q's metadata (remembered per signature,
    resolve_mode) and the inputs are checked once, by the code that runs them (the phase's API, or
    check_attention_shapes before the reference)."""
    stride = None if stride == 1 else stride
    out = _run_op_first(mode, q, k, v, mask, is_causal, scale, stride, window)
    if out is not None:
        return out
    check_window(window, is_causal)  # before the mode: a bad window is the caller's error, not a mode's
    return _RUN[_resolve_cached(mode, q, k, v, mask, stride, window)](q, k, v, mask, is_causal, scale, stride,
                                                                     window)


# ------------------------------------------------------------------------------------------------
# GPT-2 layout helpers and the module


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, S, hidden] -> [B, H, S, hidden / H] (a view; the kernels copy it contiguous if they need)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, S, hidden], got shape {tuple(x.shape)}")
    B, S, C = x.shape
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or C % num_heads:
        raise ValueError(f"num_heads must be a positive divisor of hidden={C}, got {num_heads!r}")
    return x.view(B, S, num_heads, C // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B, S, H * D] (contiguous), the inverse of split_heads."""
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, S, D], got shape {tuple(x.shape)}")
    B, H, S, D = x.shape
    return x.transpose(1, 2).reshape(B, S, H * D)


def attention_gpt2(q, k, v, num_heads: int, mode: str = "auto", mask=None, is_causal: bool = False,
                   scale=None, stride=None, window=None, num_kv_heads: int | None = None) -> torch.Tensor:
    """Attention on the GPT-2 layout: q [B, Sq, hidden], k/v [B, Sk, hidden_kv] -> [B, Sq, hidden].
    num_kv_heads (default num_heads): the heads k and v split into (grouped-query attention,
    hidden_kv = num_kv_heads * hidden / num_heads)."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    heads = [split_heads(q, num_heads)] + [split_heads(t, num_kv_heads) for t in (k, v)]
    return merge_heads(cuda_attention_forward(*heads, mode=mode, mask=mask, is_causal=is_causal,
                                              scale=scale, stride=stride, window=window))


class CUDAAttention(nn.Module):
    """Attention as a module, with a fixed mode (and optionally causal / stride / scale / window).

    forward(q, k, v, mask=None) takes [B, H, S, D] tensors (k, v may have fewer heads: grouped-query
    attention), or, when num_heads is set, the GPT-2 layout [B, S, hidden] (split into num_heads
    heads, k and v into num_kv_heads, and merged back). No parameters."""

    def __init__(self, mode: str = "auto", is_causal: bool = False, scale: float | None = None,
                 stride: int | None = None, num_heads: int | None = None, window: int | None = None,
                 num_kv_heads: int | None = None):
        super().__init__()
        if mode != "auto" and mode not in MODES:
            raise UnsupportedModeError(f"unknown attention mode {mode!r}; modes are {('auto', *MODES)}")
        check_window(window, is_causal)
        if num_kv_heads is not None and num_heads is None:
            raise ValueError("num_kv_heads needs num_heads (the GPT-2 layout)")
        self.mode, self.is_causal, self.scale, self.stride, self.num_heads = mode, is_causal, scale, stride, num_heads
        self.window, self.num_kv_heads = window, num_kv_heads

    def forward(self, q, k, v, mask=None):
        if self.num_heads is not None:
            return attention_gpt2(q, k, v, self.num_heads, self.mode, mask, self.is_causal, self.scale, self.stride,
                                  self.window, self.num_kv_heads)
        return cuda_attention_forward(q, k, v, self.mode, mask, self.is_causal, self.scale, self.stride, self.window)

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, is_causal={self.is_causal}, scale={self.scale}, stride={self.stride}"
                + (f", window={self.window}" if self.window is not None else "")
                + (f", num_heads={self.num_heads}" if self.num_heads is not None else "")
                + (f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads is not None else ""))
