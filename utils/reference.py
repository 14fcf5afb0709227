"""Float64 references every kernel of the course is checked against.

Attention semantics (the same for every kernel of every phase):
- q [B, H, Sq, D], k [B, H_kv, Sk, D], v [B, H_kv, Sk, D]; scale defaults to 1 / sqrt(D).
- Grouped-query attention (GQA, MQA when H_kv = 1): H must be a multiple of H_kv, and query head h
  reads KV head h // (H // H_kv). H_kv = H is ordinary multi-head attention.
- mask: boolean (True = attend) or additive float, broadcastable to [B, H, Sq, Sk].
- is_causal: query i attends keys j <= i (torch SDPA's top-left alignment, also when Sq != Sk).
- window (with is_causal only): a sliding window, query i attends keys j with i - window < j <= i.
- stride: strided sparse attention, query i attends keys j with j % stride == 0 (combinable with
  causal and masks).
- key_lengths: per-batch number of valid keys [B]; keys j >= key_lengths[b] are padding.
- A query row whose keys are all masked gives an output row of zeros (and logsumexp -inf).

decode_attention builds a decoding step (a KV cache, grouped-query heads, a paged layout, the
bottom-right causal mask of each sequence's length) out of attention().
"""

from __future__ import annotations

import math

import torch

from utils.checks import check_kv_heads, check_window


def attention_bias(
    B: int, H: int, Sq: int, Sk: int,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    stride: int | None = None,
    key_lengths: torch.Tensor | None = None,
    device=None,
    window: int | None = None,
) -> torch.Tensor:
    """The float64 additive bias [B, H, Sq, Sk] (0 / -inf / user values) that every rule adds up to."""
    check_window(window, is_causal)
    bias = torch.zeros(B, H, Sq, Sk, dtype=torch.float64, device=device)
    i = torch.arange(Sq, device=device).view(Sq, 1)
    j = torch.arange(Sk, device=device).view(1, Sk)
    hidden = torch.zeros(Sq, Sk, dtype=torch.bool, device=device)
    if is_causal:
        hidden |= j > i
    if stride is not None:
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        hidden |= (j % stride) != 0
    if window is not None:
        hidden |= j <= i - window
    bias = bias.masked_fill(hidden, -math.inf)
    if key_lengths is not None:
        padding = j.view(1, Sk) >= key_lengths.to(device).view(B, 1)  # [B, Sk]
        bias = bias.masked_fill(padding.view(B, 1, 1, Sk), -math.inf)
    if mask is not None:
        mask = mask.to(device)
        if mask.dtype == torch.bool:
            bias = bias.masked_fill(~mask.expand(B, H, Sq, Sk), -math.inf)
        else:
            bias = bias + mask.to(torch.float64).expand(B, H, Sq, Sk)
    return bias


def _f64(t: torch.Tensor) -> torch.Tensor:
    """t in float64, detached, except a float64 tensor that requires grad: it stays in the autograd
    graph, so that float64 autograd through attention, layer_norm, gelu and mlp gives reference
    gradients."""
    return t if t.dtype == torch.float64 and t.requires_grad else t.detach().to(torch.float64)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    stride: int | None = None,
    key_lengths: torch.Tensor | None = None,
    return_lse: bool = False,
    window: int | None = None,
):
    """softmax(scale * q k^T + bias) v in float64; fully masked rows give zeros.

    k and v may have H_kv heads (H % H_kv == 0, grouped-query attention): they are expanded to H
    heads here, in the reference only (repeat_interleave; the kernels index KV head h // (H // H_kv)).
    Returns the output in float64 (and the row logsumexp [B, H, Sq] if return_lse). Float64 inputs
    that require grad stay in the autograd graph (attention_grads: the gradient of a shared KV head
    sums over its query heads).
    """
    q64, k64, v64 = (_f64(t) for t in (q, k, v))
    B, H, Sq, D = q64.shape
    H_kv, Sk = k64.shape[1], k64.shape[2]
    if k64.shape != (B, H_kv, Sk, D) or v64.shape != (B, H_kv, Sk, D):
        raise ValueError(f"k and v must be [B, H_kv, Sk, D] matching q {tuple(q.shape)}, "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    group = check_kv_heads(H, H_kv)
    if group > 1:
        k64 = k64.repeat_interleave(group, dim=1)
        v64 = v64.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = scale * (q64 @ k64.transpose(-1, -2))
    scores = scores + attention_bias(B, H, Sq, Sk, mask, is_causal, stride, key_lengths, q64.device, window)
    row_max = scores.amax(dim=-1, keepdim=True)
    fully_masked = torch.isneginf(row_max)
    row_max = torch.where(fully_masked, torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    p = torch.where(fully_masked, torch.zeros_like(p), p / torch.where(fully_masked, 1.0, row_sum))
    out = p @ v64
    if not return_lse:
        return out
    lse = torch.where(fully_masked, -math.inf, row_max + torch.log(row_sum)).squeeze(-1)
    return out, lse


def attention_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    stride: int | None = None,
    key_lengths: torch.Tensor | None = None,
    window: int | None = None,
):
    """(dq, dk, dv) in float64: autograd through attention() (fully masked rows, whose output is
    zero, get zero gradients) with output gradient dout. The mask gets no gradient. With grouped
    k, v ([B, H_kv, Sk, D]) dk and dv have k's shape: each sums over the query heads sharing it."""
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = attention(q64, k64, v64, mask, is_causal, scale, stride, key_lengths, window=window)
        return torch.autograd.grad(out, (q64, k64, v64), dout.detach().to(torch.float64))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_lengths: torch.Tensor,
    page_table: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Attention of Sq new tokens against a KV cache, in float64, through attention().

    q [B, H, Sq, D]; k_cache, v_cache [B, H_kv, S_max, D], or paged [num_pages, H_kv, page_size, D]
    with page_table [B, max_pages] (logical page p of sequence b is physical page page_table[b, p]);
    cache_lengths [B]. Query head h reads KV head h // (H // H_kv). Bottom-right causal: the Sq
    queries are the last Sq of a sequence's L = cache_lengths[b] tokens, so query i sees the keys
    j <= L - Sq + i. Page entries past a sequence's last used page are never read (they may hold
    anything), nor are cache entries past L. Returns the output [B, H, Sq, D] (and the lse [B, H, Sq]) in float64.
    """
    B, H, Sq, D = q.shape
    lengths = cache_lengths.to(device=q.device, dtype=torch.int64)
    if page_table is None:
        k, v = k_cache, v_cache
    else:
        page_size = k_cache.shape[2]
        table = page_table.to(device=q.device, dtype=torch.int64)
        used = torch.arange(table.shape[1], device=q.device).view(1, -1) * page_size < lengths.view(-1, 1)
        table = torch.where(used, table, 0)

        def gather(cache):  # [B, max_pages, H_kv, page_size, D] -> [B, H_kv, max_pages * page_size, D]
            pages = cache[table]
            return pages.permute(0, 2, 1, 3, 4).reshape(B, cache.shape[1], -1, D)

        k, v = gather(k_cache), gather(v_cache)
    # Keys past a sequence's length are never used: zeros there, so that whatever the cache holds
    # (NaN in a free page, say) cannot reach the masked scores.
    cached = torch.arange(k.shape[2], device=q.device).view(1, 1, -1, 1) < lengths.view(B, 1, 1, 1)
    k, v = k.masked_fill(~cached, 0.0), v.masked_fill(~cached, 0.0)
    Sk = k.shape[2]
    i = torch.arange(Sq, device=q.device).view(1, Sq, 1)
    j = torch.arange(Sk, device=q.device).view(1, 1, Sk)
    visible = j <= lengths.view(B, 1, 1) - Sq + i  # [B, Sq, Sk]
    return attention(q, k, v, mask=visible.view(B, 1, Sq, Sk), scale=scale, return_lse=return_lse)


def softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Row softmax in float64 whose fully -inf rows give zeros (not NaN)."""
    s = scores.detach().to(torch.float64)
    row_max = s.amax(dim=dim, keepdim=True)
    fully_masked = torch.isneginf(row_max)
    p = torch.exp(s - torch.where(fully_masked, 0.0, row_max))
    total = p.sum(dim=dim, keepdim=True)
    return torch.where(fully_masked, torch.zeros_like(p), p / torch.where(fully_masked, 1.0, total))


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, residual=None):
    """LayerNorm over the last dimension in float64 (two-pass); with residual, of x + residual."""
    x64 = _f64(x)
    if residual is not None:
        x64 = x64 + _f64(residual)
    mean = x64.mean(dim=-1, keepdim=True)
    var = ((x64 - mean) ** 2).mean(dim=-1, keepdim=True)
    y = (x64 - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y


def gelu(x, approximate: str = "none"):
    """GELU in float64: 'none' is the exact erf form, 'tanh' the tanh approximation."""
    x64 = _f64(x)
    # Written without 1 + tanh(u) or 1 + erf(z), which cancel for large negative x (at x = -7 the
    # float64 1 + tanh(u) form is 0.7% off): 0.5 (1 + tanh(u)) = sigmoid(2u), 1 + erf(z) = erfc(-z).
    if approximate == "tanh":
        return x64 * torch.sigmoid(2.0 * math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3))
    if approximate == "none":
        return 0.5 * x64 * torch.special.erfc(-x64 / math.sqrt(2.0))
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def mlp(x, w1, b1, w2, b2, residual=None, approximate: str = "tanh"):
    """Transformer MLP in float64: gelu(x w1^T + b1) w2^T + b2 (+ residual). Weights as nn.Linear."""
    h = _f64(x) @ _f64(w1).t()
    if b1 is not None:
        h = h + _f64(b1)
    y = gelu(h, approximate) @ _f64(w2).t()
    if b2 is not None:
        y = y + _f64(b2)
    if residual is not None:
        y = y + _f64(residual)
    return y
