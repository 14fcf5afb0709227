"""Every instantiation of the backward kernels, once, on small awkward sizes, checked against the
float64 reference gradients; run under compute-sanitizer by `python -m utils.sanitize
phase5_fused.backward` (memcheck + racecheck).

Sizes: Sq = 17, Sk = 150 (neither a multiple of any tile, Sq != Sk; two or three key blocks), one
batch with a key length inside a block and one with none; causal with a sliding window of 5 keys,
and the mask path with a fully masked row and the two query heads on one K/V head (grouped-query
attention); every variant of each dtype's kernel that takes the head dim (FP32: the FFMA kernel and,
at its head dims, the 3xTF32 one; FP16 / BF16: each tile configuration). FP32 head dims: the
versions' (each its own instance), then each padded tile width at a D 8 below it; FP16 / BF16: each
tile width, and 8 below it (its padded instance).
"""

from __future__ import annotations

import sys

import torch

from phase5_fused import backward, fp32
from phase5_fused import tensor_cores as tc
from utils import reference
from utils.testing import assert_close, random_bool_mask, random_qkv, randn

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# One D per FP32 instance: its own head dims, and one on each padded tile width (zero-filled columns).
FP32_HEAD_DIMS = fp32.VERSION_D + tuple(width - 8 for width in fp32.PADDED_TILE_D)
TC_HEAD_DIMS = backward.TC_TILE_D + tuple(width - 8 for width in backward.TC_TILE_D)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to sanitize")
        return 0
    B, H, Sq, Sk = 3, 2, 17, 150
    lengths = torch.tensor([Sk, 33, 0], device="cuda", dtype=torch.int32)
    cases = 0
    for dtype, module, head_dims in ((torch.float32, fp32, FP32_HEAD_DIMS),
                                     (torch.float16, tc, TC_HEAD_DIMS),
                                     (torch.bfloat16, tc, TC_HEAD_DIMS)):
        for D in head_dims:
            q, k, v = random_qkv(B, H, Sq, Sk, D, dtype=dtype)
            dout = randn(B, H, Sq, D, dtype=dtype)
            mask = random_bool_mask((B, 1, Sq, Sk))
            mask[:, :, 3] = False
            for m, causal in ((None, True), (mask, False)):
                kw = {"mask": m, "is_causal": causal, "key_lengths": lengths, "window": 5 if causal else None}
                k, v = (k, v) if causal else (k[:, :1].contiguous(), v[:, :1].contiguous())  # H_kv = 1
                out, lse = module.attention(q, k, v, return_lse=True, **kw)
                # The float64 reference on the CPU: under the sanitizer only our kernels need the GPU.
                cpu_kw = {n: x.cpu() if torch.is_tensor(x) else x for n, x in kw.items()}
                refs = reference.attention_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), **cpu_kw)
                for variant in backward.variants_for(dtype, D):
                    grads = backward.attention_backward(q, k, v, out, lse, dout, variant=variant, **kw)
                    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
                        assert_close(got, want, dtype=dtype, rel_tol=TOL[dtype],
                                     what=f"{name} {dtype} D={D} causal={causal} mask={m is not None} v{variant}")
                    cases += 1
    torch.cuda.synchronize()
    print(f"attention backward: {cases} kernel instantiations correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
