"""The course's attention as a Hugging Face Transformers attention backend.

    from final.hf_backend import register
    name = register()               # "course" (mode="auto"); register("reference") -> "course_reference"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

Transformers is an optional extra (`pip install -e .[hf]`); this module imports it only in register().
The attention function receives what Transformers gives every backend (its sdpa backend is the
model): query [B, H, Sq, D], key/value [B, Hkv, Sk, D], a 4-D mask (bool, True = attend, built by
Transformers' sdpa mask function, which register() pairs with the name) or None, and returns
(output [B, Sq, H, D], None).
"""

from __future__ import annotations

from final.attention import MODES, UnsupportedModeError, cuda_attention_forward, resolve_mode


def backend_name(mode: str) -> str:
    """The attn_implementation name a mode is registered under: "course" for auto, else "course_<mode>"."""
    return "course" if mode == "auto" else f"course_{mode}"


def takes_grouped_heads(mode: str, query, key, value, mask) -> bool:
    """Whether `mode` runs these inputs with key/value's fewer heads as they are (no copy)."""
    try:
        resolve_mode(mode, query, key, value, mask=mask)
    except UnsupportedModeError:
        return False
    return True


def make_attention_forward(mode: str):
    """A Transformers attention function running `mode` of cuda_attention_forward."""

    def course_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                 is_causal=None, **kwargs):
        # Refuse what the course kernels do not compute, before any work
        if dropout:
            raise ValueError(f"the course attention has no dropout (got dropout={dropout}); "
                             f"call model.eval() or set the config's attention dropout to 0")
        for unsupported in ("softcap", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"the course attention does not support {unsupported!r}")
        # The course API's own error for an unsupported dtype / head size / device, named as such
        resolve_mode(mode, query)
        # GQA: K/V heads passed as they are where the mode takes grouped heads for these inputs;
        # otherwise (a mode without them: the unfused phases) one copy of K/V per query head
        groups = query.shape[1] // key.shape[1]
        if groups > 1 and not takes_grouped_heads(mode, query, key, value, attention_mask):
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        # Causal as Transformers' sdpa backend decides it: the flag only without a mask and for Sq > 1.
        # Without a mask the course's top-left causal is the right one (Sq == Sk, or a prefill into an
        # empty static cache); every bottom-right case (Sq != Sk after cached tokens) comes as a mask.
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal) and attention_mask is None and query.shape[2] > 1
        out = cuda_attention_forward(query, key, value, mode=mode, mask=attention_mask,
                                     is_causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return course_attention_forward


def register(mode: str = "auto") -> str:
    """Register `mode` with Transformers (attention function and its mask builder); returns the name."""
    if mode != "auto" and mode not in MODES:
        raise UnsupportedModeError(f"unknown attention mode {mode!r}; modes are {('auto', *MODES)}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = backend_name(mode)
    AttentionInterface.register(name, make_attention_forward(mode))
    # Without a registered mask builder Transformers passes no mask at all (no padding, no cache offset)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
