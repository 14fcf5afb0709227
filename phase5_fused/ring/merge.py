"""Exact merge of two attention results over disjoint sets of keys, by their logsumexp.

For one query row, a block of keys gives o_b = sum_j p_j v_j / l_b and lse_b = m_b + log l_b (the
row's logsumexp over that block). Over the union of two blocks the softmax denominator is
exp(lse_1) + exp(lse_2), so

    lse = log(exp(lse_1) + exp(lse_2)),    o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2,

the online softmax of phase 5 one level up. A block where the row sees no key has lse = -inf and
weight 0; a row that sees no key in either keeps lse = -inf and o = 0.
"""

from __future__ import annotations

import torch


def merge(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """(o, lse) over both key sets; o [..., S, D], lse [..., S], in o's and lse's dtypes."""
    lse_new = torch.logaddexp(lse, lse_b)
    seen = torch.isfinite(lse_new)
    lse_safe = torch.where(seen, lse_new, torch.zeros_like(lse_new))
    w = torch.where(seen, torch.exp(lse - lse_safe), torch.zeros_like(lse_new)).unsqueeze(-1)
    w_b = torch.where(seen, torch.exp(lse_b - lse_safe), torch.zeros_like(lse_new)).unsqueeze(-1)
    return w.to(o.dtype) * o + w_b.to(o.dtype) * o_b.to(o.dtype), lse_new
