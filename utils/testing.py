"""Helpers for the course's correctness tests.

- fresh random inputs for every check (a new seed each call, printed on failure),
- outputs poisoned with NaN before a kernel writes them, so an unwritten element fails,
- relative-norm error against a float64 reference, with per-dtype tolerances,
- pytest markers that skip GPU tests (no GPU) and compile tests (no toolkit) with a reason.
"""

from __future__ import annotations

import math

import random

import pytest
import torch

# ||out - ref|| / ||ref|| allowed per output dtype (shared/DESIGN.md).
REL_TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
# Elementwise bound atol * max(1, max|ref|) + rtol * |ref|, a backstop that catches a few wild elements.
ELEMENT_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float16: (2e-2, 2e-2),
                     torch.bfloat16: (5e-2, 5e-2), torch.float64: (1e-10, 1e-10)}


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    return None


def _toolkit_reason() -> str | None:
    from utils.build import BuildSetupError, check_setup

    try:
        check_setup()
    except BuildSetupError as exc:
        return str(exc)
    return None


requires_gpu = pytest.mark.skipif(_gpu_reason() is not None, reason=_gpu_reason() or "")
requires_toolkit = pytest.mark.skipif(_toolkit_reason() is not None, reason=_toolkit_reason() or "")


def new_seed() -> int:
    """A fresh seed, so each check sees new inputs; the seed is printed in failure messages."""
    return random.SystemRandom().randrange(2**31)


def randn(*shape, dtype=torch.float32, device="cuda", scale: float = 1.0, seed: int | None = None):
    """Normal random tensor (never zeros) from its own generator."""
    seed = new_seed() if seed is None else seed
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
    return x.to(dtype=dtype, device=device)


def random_qkv(B, H, Sq, Sk, D, dtype=torch.float32, device="cuda", scale: float = 1.0, H_kv: int | None = None):
    """q [B, H, Sq, D], k and v [B, H_kv, Sk, D] (H_kv defaults to H; fewer: grouped-query attention)."""
    seed = new_seed()
    H_kv = H if H_kv is None else H_kv
    q = randn(B, H, Sq, D, dtype=dtype, device=device, scale=scale, seed=seed)
    k = randn(B, H_kv, Sk, D, dtype=dtype, device=device, scale=scale, seed=seed + 1)
    v = randn(B, H_kv, Sk, D, dtype=dtype, device=device, scale=scale, seed=seed + 2)
    return q, k, v


def random_bool_mask(shape, device="cuda", keep: float = 0.7, seed: int | None = None):
    """Boolean mask (True = attend) with about `keep` of the entries True."""
    seed = new_seed() if seed is None else seed
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(*shape, generator=gen) < keep).to(device)


def random_additive_mask(shape, device="cuda", seed: int | None = None):
    """Float32 additive mask: mostly small offsets, some -inf entries."""
    seed = new_seed() if seed is None else seed
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mask = torch.randn(*shape, generator=gen)
    mask = mask.masked_fill(torch.rand(*shape, generator=gen) < 0.2, float("-inf"))
    return mask.to(device)


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer filled with NaN: any element a kernel forgets to write fails the check."""
    return torch.full_like(x, float("nan"))


def poison_(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(float("nan"))


def poisoned_call(fn, *shapes):
    """fn() run right after NaN-filled float32 buffers of the given shapes were freed: the caching
    allocator hands an op that allocates its outputs those same blocks, so an element the kernel
    forgets to write stays NaN and fails the comparison."""
    buffers = [poison_(torch.empty(s, device="cuda")) for s in shapes]
    del buffers
    return fn()


def outputs_across_streams_and_graphs(call, after=None) -> dict[str, torch.Tensor]:
    """For a kernel that keeps state per CUDA stream (counters zeroed once and left at zero by every
    call): call() on a side stream and on the main stream in flight together, then captured in a
    CUDA graph and replayed twice (its output NaN-filled before each replay), then `after()` (default
    call) once the graph is done. Returns each output by name: "side stream", "main stream",
    "graph replay 0", "graph replay 1", "after the graph"; every one must equal a plain call's."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        on_side = call()
    on_main = call()
    main.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    results = {"side stream": on_side, "main stream": on_main}
    for replay in range(2):
        poison_(captured)
        graph.replay()
        results[f"graph replay {replay}"] = captured.clone()
    results["after the graph"] = (after or call)()
    return results


# (B, H, Sq, Sk, D) for the three-kernel phases: S in {1, 17, 127, 128, 1000, 1024}, Sq != Sk both
# ways, D in {32, 64, 80, 128}; no S and no D is a multiple of every tile.
UNFUSED_SHAPES = [
    (1, 1, 1, 1, 32),
    (2, 3, 17, 17, 64),
    (1, 2, 127, 128, 80),
    (2, 1, 128, 127, 128),
    (1, 2, 17, 1000, 32),
    (1, 1, 1000, 17, 64),
    (1, 2, 1000, 1000, 80),
    (2, 2, 1024, 1024, 64),
    (1, 1, 1024, 1024, 128),
]


def shape_ids(shapes) -> list[str]:
    """pytest ids for (B, H, Sq, Sk, D) shapes."""
    return ["B{}H{}Sq{}Sk{}D{}".format(*s) for s in shapes]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has a NaN where ref is finite)."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    denom = torch.linalg.vector_norm(ref64).item()
    diff = torch.linalg.vector_norm(out64 - ref64).item()
    return diff / denom if denom > 0 else diff


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype=None, rel_tol: float | None = None,
                 what: str = "output", seed_info: str = "", ref_scale: torch.Tensor | None = None) -> float:
    """Fail loudly unless out matches the float64 reference: same shape, no NaN/inf where ref is
    finite, relative-norm error under the dtype's tolerance, every element within atol + rtol|ref|.
    Prints the first mismatches. Returns the relative error.

    ref_scale: the magnitude errors are measured against, where ref itself can cancel to nearly
    zero; for a product a @ b pass |a| @ |b| (rounding error is bounded by D * eps * |a| @ |b|)."""
    dtype = dtype or out.dtype
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    finite_ref = torch.isfinite(ref64)
    bad = ~torch.isfinite(out64) & finite_ref
    assert not bad.any(), (f"{what}: {int(bad.sum())} non-finite elements where the reference is "
                           f"finite, first at {_first(bad)} {seed_info}")
    assert not torch.isnan(ref64).any(), f"{what}: the reference itself has NaN {seed_info}"
    assert torch.equal(out64[~finite_ref], ref64[~finite_ref]), (
        f"{what}: where the reference is infinite the output differs {seed_info}")
    o, r = out64[finite_ref], ref64[finite_ref]
    magnitude = r if ref_scale is None else ref_scale.detach().to(torch.float64).cpu()[finite_ref]
    # Relative to the reference's norm, but never to less than the dtype's smallest normal number
    # per element: an FP16 output below 6e-5 is subnormal and cannot keep its relative accuracy.
    # (An all-zero reference leaves the absolute error, as rel_error does.)
    diff, norm = torch.linalg.vector_norm(o - r).item(), torch.linalg.vector_norm(magnitude).item()
    err = diff / max(norm, torch.finfo(dtype).tiny * math.sqrt(o.numel())) if norm > 0 else diff
    tol = REL_TOLERANCE[dtype] if rel_tol is None else rel_tol
    # Elementwise backstop: atol scales with the reference's magnitude (an error of 1e-4 means
    # little next to outputs of 1e3), and loosens with the test's relative tolerance.
    looser = max(1.0, tol / REL_TOLERANCE[dtype])
    atol, rtol = (t * looser for t in ELEMENT_TOLERANCE[dtype])
    atol *= max(1.0, magnitude.abs().max().item() if magnitude.numel() else 1.0)
    far = (o - r).abs() > atol + rtol * magnitude.abs()
    if err > tol or far.any():
        idx = torch.nonzero((out64 - ref64).abs().nan_to_num(0) > atol + rtol * ref64.abs().nan_to_num(0))[:5]
        listing = ", ".join(f"{tuple(i.tolist())}: {out64[tuple(i)].item():.6g} vs {ref64[tuple(i)].item():.6g}"
                            for i in idx)
        raise AssertionError(f"{what}: rel error {err:.3e} (tol {tol:.1e}), {int(far.sum())} elements beyond "
                             f"atol {atol:.2g} + rtol {rtol:.2g}|ref|; first: {listing} {seed_info}")
    return err


def _first(mask: torch.Tensor):
    return tuple(torch.nonzero(mask)[0].tolist())
