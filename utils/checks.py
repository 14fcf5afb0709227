"""Input validation for the phases' Python APIs: every error names the argument it rejects.

The C++ ops check again (TORCH_CHECK); checking here first gives the user a Python error
(TypeError / ValueError) instead of the dispatcher's message about backends.

    check_attention_shapes   what every attention takes, on any device (final.attention's reference
                             mode uses it alone)
    check_attention_inputs   that, plus CUDA, the kernel's dtypes and head dims, and key_lengths
    check_kv_heads           grouped-query attention: H query heads over H_kv KV heads (H % H_kv == 0)
    check_window             a sliding window: an integer >= 1 (or None), only with is_causal
    grouped_or_window        which of the two a call uses, in words, for the errors of kernels without them
    plain_arguments          the scalar arguments are of the kinds an op takes as they are (the APIs'
                             unchecked first try, below)
    records_grad             autograd will record this call (grad enabled, an input requires grad)

The phase APIs of the fused kernels first call their op on the arguments as given, where no
gradient is recorded and plain_arguments holds: the op checks every tensor itself (TORCH_CHECK,
before any launch), so a valid call pays for no Python check. Where the op raises, the API runs
these checks, which raise the error that names the argument, or convert what the op could not
take as it was (a non-contiguous or misaligned tensor, a float16 mask), and calls the op again.
"""

from __future__ import annotations

import math

import torch


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(x, name: str, dim: int | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")


def check_cuda_tensor(x, name: str, dtypes: tuple[torch.dtype, ...], dim: int | None = None) -> None:
    check_tensor(x, name)
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
    if x.dtype not in dtypes:
        allowed = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {_dtype_name(x.dtype)}")
    check_tensor(x, name, dim)


def dim_in(D, dims) -> bool:
    """D in dims (a tuple or a range), written as comparisons so that torch.compile can decide it
    for a symbolic D too (`D in (64, 128)` on a SymInt fails to trace on torch 2.11)."""
    if type(D) is int:  # the common case, checked on every call: a plain membership test
        return D in dims
    if isinstance(dims, range):
        return dims.start <= D < dims.stop and (dims.step == 1 or (D - dims.start) % dims.step == 0)
    return any(D == d for d in dims)


def plain_arguments(is_causal, scale, window=None, stride=None) -> bool:
    """is_causal a bool, scale None or a finite float, window and stride None or integers >= 1: the
    scalars an op may be given unchecked (its float argument would take inf or nan, its int a bool)."""
    return ((is_causal is True or is_causal is False)
            and (scale is None or (type(scale) is float and math.isfinite(scale)))
            and (window is None or (type(window) is int and window >= 1))
            and (stride is None or (type(stride) is int and stride >= 1)))


def records_grad(q, k, v) -> bool:
    """Autograd will record a call on q, k, v: grad mode is on and one of them requires grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def check_kv_heads(H, H_kv, name: str = "k") -> int:
    """Grouped-query attention (GQA; MQA when H_kv = 1): H query heads share H_kv KV heads, query
    head h reads KV head h // (H // H_kv). H must be a multiple of H_kv. Returns the group size
    H // H_kv; ValueError naming `name` (the tensor whose dimension 1 holds H_kv) otherwise."""
    if H_kv < 1 or H % H_kv != 0:
        raise ValueError(f"q's heads H={H} must be a multiple of {name}'s KV heads H_kv={H_kv} "
                         f"({name}.shape[1])")
    return H // H_kv


def check_window(window, is_causal) -> None:
    """A sliding window: query i sees keys j with i - window < j <= i, so it is used with causal
    masking (top-left aligned). None = unlimited; otherwise an integer >= 1."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1 or None, got {window!r}")
    if is_causal is not True:
        raise ValueError(f"window={window} needs is_causal=True (query i sees keys i - window < j <= i)")


def grouped_or_window(H, H_kv, window) -> str | None:
    """What of grouped-query attention and a sliding window these arguments use, in words (for the
    errors of kernels or backward passes that take neither), or None when they use neither."""
    used = ([f"grouped-query k, v (H_kv={H_kv} KV heads for H={H} query heads)"] if H_kv != H else []) + \
           ([f"window={window}"] if window is not None else [])
    return " and ".join(used) or None


def check_attention_shapes(q, k, v, mask=None, stride=None, is_causal=False, scale=None, grouped=False,
                           window=None):
    """q [B,H,Sq,D], k/v [B,H,Sk,D] of one floating dtype on one device, a mask broadcastable to
    [B,H,Sq,Sk], stride >= 1, is_causal a bool, scale finite or None. Any device (CPU and fake
    tensors too). grouped=True: k/v may have H_kv heads with H % H_kv == 0 (check_kv_heads);
    window: check_window. Returns the mask (bool, or float as float32) and (B, H, Sq, Sk, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(x, name, dim=4)
    # (each property read once: these checks run on every call of every kernel)
    dtype, device = q.dtype, q.device
    if not dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got {_dtype_name(dtype)}")
    if k.dtype != dtype or v.dtype != dtype:
        raise TypeError(f"q, k, v must share a dtype, got {_dtype_name(q.dtype)}, {_dtype_name(k.dtype)}, "
                        f"{_dtype_name(v.dtype)}")
    if k.device != device or v.device != device:
        raise ValueError(f"k and v must be on q's device {q.device}, got {k.device} and {v.device}")
    B, H, Sq, D = q.shape
    k_shape = k.shape
    Bk, Hk, Sk, Dk = k_shape
    if Bk != B or Dk != D or (Hk != H and not grouped):
        raise ValueError(f"k must be [B={B}, H={H}, Sk, D={D}] to match q, got {tuple(k.shape)}")
    if grouped:
        check_kv_heads(H, Hk)
    if v.shape != k_shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if min(B, H, Sq, Sk, D) == 0:
        raise ValueError(f"q, k, v must not be empty, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if mask is not None:
        mask = check_mask(mask, (B, H, Sq, Sk), q.device)
    if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int) or stride < 1):
        raise ValueError(f"stride must be an integer >= 1 or None, got {stride!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    check_window(window, is_causal)
    return mask, (B, H, Sq, Sk, D)


def check_attention_inputs(q, k, v, mask=None, stride=None, dtypes=(torch.float32,),
                           supported_d=None, key_lengths=None, is_causal=False, scale=None, grouped=False,
                           window=None, contiguous=True):
    """check_attention_shapes, then: q, k, v CUDA tensors of one of `dtypes`, supported_d(D), and
    key_lengths [B] int32/int64 on the GPU. Returns q, k, v (made contiguous unless `contiguous` is
    False: for a kernel that reads strides), the mask and (B,H,Sq,Sk,D)."""
    mask, (B, H, Sq, Sk, D) = check_attention_shapes(q, k, v, mask, stride, is_causal, scale, grouped, window)
    # k and v share q's device and dtype (checked above): q's check speaks for all three
    check_cuda_tensor(q, "q", dtypes)
    if supported_d is not None and not supported_d(D):
        raise ValueError(f"head dim D={D} (q.shape[-1]) is not supported by this kernel")
    if key_lengths is not None:
        check_cuda_tensor(key_lengths, "key_lengths", (torch.int32, torch.int64), dim=1)
        if key_lengths.shape[0] != B:
            raise ValueError(f"key_lengths must have B={B} entries, got {key_lengths.shape[0]}")
    if contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return q, k, v, mask, (B, H, Sq, Sk, D)


def check_mask(mask, shape, device) -> torch.Tensor:
    """A bool (True = attend) or float mask broadcastable to `shape` on `device`; floats become float32."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"mask must be on {device}, got {mask.device}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"mask must be bool or floating point, got {mask.dtype}")
    if mask.dim() > len(shape) or any(m not in (1, s) for m, s in zip(reversed(mask.shape), reversed(shape))):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to [B, H, Sq, Sk] = {list(shape)}")
    return mask if mask.dtype == torch.bool else mask.to(torch.float32)
