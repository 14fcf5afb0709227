"""The course's attention through its public API at the phases' headline shape, beside SDPA's kernels.

`python -m final.api_speed` on a GPU times final.attention.cuda_attention_forward at B=4, H=8,
S=4096, D in {64, 128}, causal and not, on the same inputs as torch SDPA pinned to each peer backend:
    FP16  mode="fused_tc" (the mma.sync kernel), "fused_hopper" (where the GPU is sm_90) and "auto",
          beside sdpa_flash (FlashAttention-2) and sdpa_cudnn
    FP32  mode="fused" (the FFMA kernel) and "auto", beside sdpa_efficient
Every call of one dtype and shape is timed in turns (utils.bench.time_in_turns: an L2 flush before
each call, the host's head start, one sample of every path per round, the median): the events time
the GPU work each call launches, whatever the API resolved, copied or chose for these inputs. At
this shape a caller that queues calls back to back waits for that work, not for the host's tens of
microseconds per call, which final.api_overhead measures where they do matter.
TFLOP/s from utils.roofline.attention_flops; rel_err of each output against utils.reference in
float64, so that a broken call cannot look fast.
Writes final/results/api_speed.json and redraws final/README.md's tables `api_speed` and
`api_speed_targets` (final/manifest.json); `python -m final.benchmark` runs it too. Without a GPU it
measures nothing and says so.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "results" / "api_speed.json"
DEVICE = "cuda"

B, H, S = 4, 8, 4096
HEAD_DIMS = (64, 128)
# The course's modes per dtype, each called through cuda_attention_forward, and the SDPA backends
# beside them.
MODES = {"float16": ("fused_tc", "fused_hopper", "auto"), "float32": ("fused", "auto")}
PEERS = {"float16": ("sdpa_flash", "sdpa_cudnn"), "float32": ("sdpa_efficient",)}
REPS = 30


def paths(dtype_name: str, causal: bool, q, k, v) -> dict:
    """label -> (impl, mode, call) for every path of this dtype; a mode the GPU cannot run raises
    when called (final.attention's error), and is noted instead of timed."""
    from final.attention import cuda_attention_forward
    from utils.peers import sdpa

    out = {}
    for mode in MODES[dtype_name]:
        out[f"cuda_attention_forward mode={mode}"] = (
            "cuda_attention_forward", mode, lambda m=mode: cuda_attention_forward(q, k, v, mode=m, is_causal=causal))
    for peer in PEERS[dtype_name]:
        run = sdpa(peer)
        out[peer] = (peer, None, lambda r=run: r(q, k, v, is_causal=causal))
    return out


def measure(notes: list[str]) -> list[dict]:
    from utils import reference
    from utils.bench import time_in_turns
    from utils.roofline import attention_flops
    from utils.testing import random_qkv, rel_error

    rows = []
    for dtype_name in MODES:
        for D in HEAD_DIMS:
            for causal in (False, True):
                q, k, v = random_qkv(B, H, S, S, D, dtype=getattr(torch, dtype_name), device=DEVICE)
                ref = reference.attention(q, k, v, is_causal=causal)
                ready, errors = {}, {}
                for label, (impl, mode, fn) in paths(dtype_name, causal, q, k, v).items():
                    try:
                        errors[label] = rel_error(fn(), ref)
                    except Exception as exc:  # noqa: BLE001 - a mode this GPU cannot run is noted by name
                        notes.append(f"{label} {dtype_name} D={D} causal={causal}: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
                        continue
                    ready[label] = (impl, mode, fn)
                times = time_in_turns({label: fn for label, (_, _, fn) in ready.items()}, reps=REPS)
                flops = attention_flops(B, H, S, S, D, causal=causal)
                for label, (impl, mode, _) in ready.items():
                    row = {"impl": impl, "mode": mode, "op": "attention", "B": B, "H": H, "Sq": S, "Sk": S, "D": D,
                           "dtype": dtype_name, "causal": causal, "ms": times[label],
                           "tflops": flops / times[label] / 1e9, "rel_err": errors[label]}
                    rows.append(row)
                    print(f"  {dtype_name} D={D} causal={int(causal)} {label:40s} {row['ms']:8.3f} ms "
                          f"{row['tflops']:6.1f} TFLOP/s  rel err {row['rel_err']:.1e}", flush=True)
                del q, k, v, ref
    return rows


def run(out: Path = RESULTS_PATH) -> Path:
    """Measure every path (module docstring) and write the results file; needs a GPU."""
    from utils.build import shown
    from utils.results import write_results

    notes: list[str] = []
    start = time.perf_counter()
    print(f"the attention API at B={B}, H={H}, S={S}, D in {HEAD_DIMS}, in turns with SDPA", flush=True)
    rows = measure(notes)
    path = write_results(out, rows, notes=notes, reps=REPS, wall_s=time.perf_counter() - start)
    print(f"wrote {shown(path)} ({len(rows)} rows, {time.perf_counter() - start:.0f} s)", flush=True)
    return path


def main(argv=None) -> int:
    from final.api_overhead import results_main

    return results_main(argv, "final.api_speed", __doc__, run, RESULTS_PATH)


if __name__ == "__main__":
    sys.exit(main())
