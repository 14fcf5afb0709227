"""Autograd formulas for the fused forward ops of phase 5, on this lesson's backward kernels.

    register_fp32(op_names)   phase5_fused::attention_{teaching, v2, v3, v4, fast, tf32x3, fastest}
                              (q, k, v, mask, is_causal, scale, stride, key_lengths, return_lse[, variant][, window])
    register_tc(op_name)      phase5_fused_tc::attention_lse
                              (q, k, v, mask, is_causal, scale, key_lengths, window)
(The Hopper forward's formula is registered in C++, ../hopper/hopper_autograd.cpp: the op a
training step on an H100 runs in every block, where Python per call costs the most.)

Each forward package calls its function right after loading its extension (utils.build.op_loader's
hook), so the registration happens once per process and only where the forward is used. This module
imports neither forward package: they import it (lazily), and an import of theirs from here would
close a circle. The forward saves q, k, v, out and the row logsumexp lse (the only statistic the
backward needs: P = exp(scale S + bias - lse) is the softmax itself); the backward computes
D_i = rowsum(dO_i * O_i) and runs Algorithm 2, with the forward's window where its op takes one.
The mask gets no gradient; neither do key_lengths.
The backward's own kernels are built on the first backward call, not here.
"""

from __future__ import annotations

import torch

from phase5_fused.backward import DEFAULT_VARIANT, _aligned, load

_REGISTERED: set[str] = set()


def _argument_index(op_name: str, argument: str) -> int | None:
    """Where `argument` sits among the inputs of op `namespace::name` (its schema), or None."""
    namespace, name = op_name.split("::")
    names = [a.name for a in getattr(getattr(torch.ops, namespace), name).default._schema.arguments]
    return names.index(argument) if argument in names else None


def _setup_context(ctx, inputs, output, stride_index, window_index):
    q, k, v, mask, is_causal, scale = inputs[:6]
    key_lengths = inputs[stride_index + 1] if stride_index is not None else inputs[6]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, key_lengths)
    ctx.is_causal, ctx.scale = is_causal, scale
    ctx.stride = inputs[stride_index] if stride_index is not None else 1
    ctx.window = inputs[window_index] if window_index is not None and window_index < len(inputs) else 0
    ctx.n_inputs = len(inputs)


def _backward(ctx, grad_out, grad_lse, op_name):
    q, k, v, out, lse, mask, key_lengths = ctx.saved_tensors
    if lse.dim() != 3:
        raise RuntimeError("the forward ran without its logsumexp (return_lse=False): call it through "
                           "phase5_fused.fp32.attention, which asks for it when an input requires grad")
    dout = torch.zeros_like(out) if grad_out is None else _aligned(grad_out.contiguous())
    dlse = None if grad_lse is None else grad_lse.contiguous()
    q, k, v = _aligned(q), _aligned(k), _aligned(v)  # the tensor-core kernels' 16-byte loads
    dq, dk, dv = getattr(load(), op_name)(q, k, v, out, lse, dout, dlse, mask, ctx.is_causal, ctx.scale,
                                          ctx.stride, key_lengths, DEFAULT_VARIANT, ctx.window)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


def register_fp32(op_names) -> None:
    """Autograd for the FP32 forward ops (each returns (out, lse); lse is [B, H, Sq] when asked)."""
    for name in op_names:
        if name in _REGISTERED:
            continue
        window_index = _argument_index(name, "window")
        torch.library.register_autograd(
            name, lambda ctx, g_out, g_lse: _backward(ctx, g_out, g_lse, "attention_backward_fp32"),
            setup_context=lambda ctx, inputs, output, w=window_index: _setup_context(ctx, inputs, output, 6, w))
        _REGISTERED.add(name)


def register_tc(name: str) -> None:
    """Autograd for the tensor-core forward op that returns (out, lse)."""
    if name in _REGISTERED:
        return
    window_index = _argument_index(name, "window")
    torch.library.register_autograd(
        name, lambda ctx, g_out, g_lse: _backward(ctx, g_out, g_lse, "attention_backward_tc"),
        setup_context=lambda ctx, inputs, output: _setup_context(ctx, inputs, output, None, window_index))
    _REGISTERED.add(name)
