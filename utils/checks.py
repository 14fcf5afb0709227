"""Input validation for the phases' Python APIs: every error names the argument it rejects.

The C++ ops check again (TORCH_CHECK); checking here first gives the user a Python error
(TypeError / ValueError) instead of the dispatcher's message about backends.
"""

from __future__ import annotations

import torch


def check_cuda_tensor(x, name: str, dtypes: tuple[torch.dtype, ...], dim: int | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {str(x.dtype).replace('torch.', '')}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")


def dim_in(D, dims) -> bool:
    """D in dims (a tuple or a range), written as comparisons so that torch.compile can decide it
    for a symbolic D too (`D in (64, 128)` on a SymInt fails to trace on torch 2.11)."""
    if isinstance(dims, range):
        return dims.start <= D < dims.stop
    return any(D == d for d in dims)


def check_attention_inputs(q, k, v, mask=None, stride=None, dtypes=(torch.float32,),
                           supported_d=None, key_lengths=None):
    """Validate q [B,H,Sq,D], k/v [B,H,Sk,D], optional mask broadcastable to [B,H,Sq,Sk], stride,
    and key_lengths [B]. Returns contiguous q, k, v, the mask (bool or float32) and (B,H,Sq,Sk,D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_cuda_tensor(x, name, dtypes, dim=4)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("k and v must be on q's device")
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    if k.shape[:2] != (B, H) or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, H={H}, Sk, D={D}] to match q, got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if min(B, H, Sq, Sk, D) == 0:
        raise ValueError(f"q, k, v must not be empty, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if supported_d is not None and not supported_d(D):
        raise ValueError(f"head dim D={D} (q.shape[-1]) is not supported by this kernel")
    if mask is not None:
        mask = check_mask(mask, (B, H, Sq, Sk), q.device)
    if stride is not None and (not isinstance(stride, int) or stride < 1):
        raise ValueError(f"stride must be an integer >= 1, got {stride!r}")
    if key_lengths is not None:
        check_cuda_tensor(key_lengths, "key_lengths", (torch.int32, torch.int64), dim=1)
        if key_lengths.shape[0] != B:
            raise ValueError(f"key_lengths must have B={B} entries, got {key_lengths.shape[0]}")
    return q.contiguous(), k.contiguous(), v.contiguous(), mask, (B, H, Sq, Sk, D)


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
