"""Every instantiation of every version of the Hopper kernel, once, on small awkward sizes, checked
against the float64 reference; run under compute-sanitizer by `python -m utils.sanitize
phase5_fused.hopper` (memcheck + racecheck; README "What the sanitizer can and cannot see").

Sizes: Sq = 17 and Sk = 300 (neither a multiple of the 128-row tiles, Sq != Sk, three key blocks so
that a stage of the 2-stage ring is refilled), batches with a key length inside the second and
the third block (their V rows are zeroed in shared memory: by the consumers in v1-v3, by the
producer in v4-v7) and one with none, causal and not, with the lse; K/V of H_kv = 1 head for the
H = 2 query heads (grouped-query attention: both heads read the same K/V tiles); v8 with H = 25,
so that on a 132-SM H100 its non-causal D = 128 calls cut their 100 tiles into Stream-K shares.

The backward (hopper_bwd.cu) likewise: Sq = 150 and Sk = 300 (three query blocks, so that both
stages of its ring are refilled; three key blocks, the last one cut short, and one batch's key
length inside the second), causal and not, every variant. The non-causal cases give K/V one head
for the two query heads (a block's loop runs over both heads' query blocks, summing dK and dV); the
causal cases take q, k, v and dO as views of a transformer's layouts ([B, S, H, D] and a packed
[B, S, 2, H, D]), which the backward reads in place through its TMA maps and strides.
"""

from __future__ import annotations

import sys

import torch

from phase5_fused import hopper
from utils import reference
from utils.testing import assert_close, random_qkv, randn

TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
GRAD_TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2}  # the backward lesson's sanitizer cases'


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to sanitize")
        return 0
    if tuple(torch.cuda.get_device_capability()) != hopper.HOPPER:
        print("not a Hopper GPU (sm_90): the sm_90a kernels cannot run here, nothing to sanitize")
        return 0
    B, H_kv, Sq, Sk = 4, 1, 17, 300
    # every key, a tail in the second block, none, a tail in the third (its stage's second fill)
    lengths = torch.tensor([Sk, 133, 0, 290], device="cuda", dtype=torch.int32)
    cases = 0
    for version in hopper.VERSIONS:
        H = 25 if version == "v8_stream_k" else 2
        for dtype in hopper.DTYPES:
            for D in hopper.SUPPORTED_D:
                q, k, v = random_qkv(B, H, Sq, Sk, D, dtype=dtype, H_kv=H_kv)
                for causal in (False, True):
                    out, lse = hopper.attention(q, k, v, is_causal=causal, key_lengths=lengths, return_lse=True,
                                                version=version)
                    ref, ref_lse = reference.attention(q, k, v, is_causal=causal, key_lengths=lengths,
                                                       return_lse=True)
                    what = f"{version} {dtype} D={D} causal={causal}"
                    assert_close(out, ref, dtype=dtype, rel_tol=TOL[dtype], what=what)
                    assert_close(lse, ref_lse, dtype=torch.float32, rel_tol=1e-4, what=f"lse {what}")
                    cases += 1
    torch.cuda.synchronize()
    print(f"hopper attention: {cases} kernel instantiations correct")
    return backward_cases()


def backward_cases() -> int:
    B, H, Sq, Sk = 3, 2, 150, 300
    lengths = torch.tensor([Sk, 133, 0], device="cuda", dtype=torch.int32)
    cases = 0
    for dtype in hopper.DTYPES:
        for D in hopper.SUPPORTED_D:
            for causal in (False, True):
                if causal:  # views, read in place: q, dO (and so O) of [B, S, H, D], k and v of [B, S, 2, H, D]
                    q, dout = (randn(B, Sq, H, D, dtype=dtype).transpose(1, 2) for _ in range(2))
                    k, v = randn(B, Sk, 2, H, D, dtype=dtype).permute(2, 0, 3, 1, 4)
                else:  # grouped-query K/V: one head for the H query heads
                    q, k, v = random_qkv(B, H, Sq, Sk, D, dtype=dtype, H_kv=1)
                    dout = randn(B, H, Sq, D, dtype=dtype)
                out, lse = hopper.attention(q, k, v, is_causal=causal, key_lengths=lengths, return_lse=True)
                # The float64 reference on the CPU: under the sanitizer only our kernels need the GPU.
                refs = reference.attention_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), is_causal=causal,
                                                 key_lengths=lengths.cpu())
                for variant in hopper.BWD_VARIANTS:
                    grads = hopper.attention_backward(q, k, v, out, lse, dout, is_causal=causal, key_lengths=lengths,
                                                      variant=variant)
                    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
                        assert_close(got, want, dtype=dtype, rel_tol=GRAD_TOL[dtype],
                                     what=f"backward {name} {dtype} D={D} causal={causal} variant {variant}")
                    cases += 1
    torch.cuda.synchronize()
    print(f"hopper attention backward: {cases} kernel instantiations correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
