"""The peers every phase is measured beside, in the same run and on the same inputs.

torch_naive: matmul, softmax, matmul in PyTorch (cuBLAS SGEMM with TF32 off, torch's softmax);
sdpa_math / sdpa_efficient / sdpa_flash / sdpa_cudnn: torch SDPA pinned to one backend.
Each returns a callable attention(q, k, v, mask=None, is_causal=False) or None when the backend
cannot take the inputs on this machine.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


def torch_naive(q, k, v, mask=None, is_causal=False, scale=None):
    """The three-kernel path in PyTorch: S = scale q k^T (+ mask), P = softmax(S), O = P v."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    with no_tf32():
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if is_causal:
            Sq, Sk = s.shape[-2:]
            s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        return torch.matmul(torch.softmax(s, dim=-1), v)


@contextlib.contextmanager
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


SDPA_BACKENDS = {
    "sdpa_math": "MATH",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
}


def sdpa(backend_name: str):
    """torch SDPA pinned to one backend (a key of SDPA_BACKENDS). k and v may have fewer heads than q
    (grouped-query attention), as in the course's kernels: SDPA's enable_gqa, only then."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[backend_name])

    def run(q, k, v, mask=None, is_causal=False, scale=None):
        grouped = {"enable_gqa": True} if k.shape[-3] != q.shape[-3] else {}
        with sdpa_kernel([backend]), no_tf32():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                  **grouped)

    return run


def available_sdpa(backend_name: str, q, k, v, is_causal=False):
    """The pinned SDPA callable if it runs on these inputs here, else None."""
    fn = sdpa(backend_name)
    try:
        fn(q[:, :, :8], k[:, :, :8], v[:, :, :8], is_causal=is_causal)
        torch.cuda.synchronize()
    except RuntimeError:
        return None
    return fn


def attention_peers(q, k, v, is_causal=False, names=("torch_naive", "sdpa_math", "sdpa_efficient")):
    """{impl name: callable} for the named peers that run on these inputs."""
    peers = {}
    for name in names:
        if name == "torch_naive":
            peers[name] = torch_naive
        else:
            fn = available_sdpa(name, q, k, v, is_causal)
            if fn is not None:
                peers[name] = fn
    return peers
