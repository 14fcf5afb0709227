"""The Roofline: ceilings measured on the GPU, and FLOP and byte models (utils/plots.py draws it).

Ceilings are measured once per GPU and cached in utils/results/ceilings.json (keyed by GPU name):
- dram_TBps: device-to-device copy, bytes read + bytes written, over time;
- fp32_TFLOPs: the FFMA micro-kernel (utils/csrc/ceilings.cu), 8 independent chains per thread;
- l2_TBps: a buffer of a third of L2 read 64 times with 16-byte L2-only loads (ceilings.cu);
- l1_TBps: conflict-free 16-byte shared-memory loads on every SM (ceilings.cu), the L1/shared roof;
- sgemm_TFLOPs: cuBLAS SGEMM 8192^3 with TF32 off; tf32/fp16/bf16_tc_TFLOPs: the same with TF32 on,
  and in float16 / bfloat16 (tensor cores).

Models (minimum work: each input read once, each output written once):
- attention FLOPs = 4 * B * H * Sq * Sk * D (two matmuls of 2*Sq*Sk*D each), halved for causal,
  and for a sliding window only the visible (i, j) pairs count; bytes = (q + k + v + out) elements
  * element size, k and v with H_kv heads under grouped-query attention.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CEILINGS_PATH = Path(__file__).resolve().parent / "results" / "ceilings.json"

# ------------------------------------------------------------------------------------------------
# FLOP and byte models


def attention_flops(B, H, Sq, Sk, D, causal=False, stride=1, window=None) -> float:
    """QK^T and PV: 2 * (2 * Sq * Sk * D) per head; causal keeps about half, stride 1/stride, a
    sliding window (with causal) the pairs i - window < j <= i."""
    flops = 4.0 * B * H * Sq * Sk * D
    if window is not None:
        flops *= _window_fraction(Sq, Sk, window)
    elif causal:
        flops *= _causal_fraction(Sq, Sk)
    return flops / stride


def _window_fraction(Sq, Sk, window) -> float:
    """Fraction of the Sq x Sk score matrix with i - window < j <= i (top-left aligned)."""
    visible = sum(max(0, min(i + 1, Sk) - max(0, i - window + 1)) for i in range(Sq))
    return visible / (Sq * Sk)


def _causal_fraction(Sq, Sk) -> float:
    """Fraction of the Sq x Sk score matrix with j <= i (top-left aligned causal)."""
    # sum over rows i of min(i + 1, Sk)
    if Sq <= Sk:
        visible = Sq * (Sq + 1) / 2
    else:
        visible = Sk * (Sk + 1) / 2 + (Sq - Sk) * Sk
    return visible / (Sq * Sk)


def attention_bytes(B, H, Sq, Sk, D, elem_bytes=4, H_kv=None) -> float:
    """Fused minimum: read q, k, v once, write out once (k and v with H_kv heads, default H)."""
    H_kv = H if H_kv is None else H_kv
    return float(elem_bytes) * B * (2 * H * Sq * D + 2 * H_kv * Sk * D)


def unfused_attention_bytes(B, H, Sq, Sk, D, elem_bytes=4) -> float:
    """Three-kernel minimum: also write S, read S, write P, read P (the Sq x Sk round trips)."""
    return attention_bytes(B, H, Sq, Sk, D, elem_bytes) + 4.0 * elem_bytes * B * H * Sq * Sk


def matmul_flops(M, N, K, batch=1) -> float:
    return 2.0 * batch * M * N * K


def matmul_bytes(M, N, K, batch=1, elem_bytes=4) -> float:
    return float(elem_bytes) * batch * (M * K + K * N + M * N)


def softmax_flops(rows, cols) -> float:
    """max, subtract, exp, sum, divide: about 5 operations per element."""
    return 5.0 * rows * cols


def softmax_bytes(rows, cols, elem_bytes=4) -> float:
    return 2.0 * elem_bytes * rows * cols


def layer_norm_flops(rows, hidden) -> float:
    """mean, variance, normalize, scale, shift: about 8 operations per element."""
    return 8.0 * rows * hidden


def layer_norm_bytes(rows, hidden, elem_bytes=4, residual=False) -> float:
    """Read x (and residual), write y (and the sum), read gamma and beta once."""
    tensors = 4 if residual else 2
    return float(elem_bytes) * (tensors * rows * hidden + 2 * hidden)


def mlp_flops(tokens, hidden, inner) -> float:
    """Two GEMMs (2 * tokens * hidden * inner each); bias, GELU and residual are negligible."""
    return 4.0 * tokens * hidden * inner


def mlp_bytes(tokens, hidden, inner, elem_bytes=4) -> float:
    """Read x, both weights and biases, the residual; write out (the hidden activation kept on chip
    is the fused ideal, so it is not counted)."""
    return float(elem_bytes) * (3 * tokens * hidden + 2 * hidden * inner + inner + hidden)


def row_model(row: dict) -> tuple[float, float] | None:
    """(FLOPs, minimum bytes) of the problem a results row measured, from the models above; None for
    an op without a model."""
    elem = 2 if row.get("dtype") in ("float16", "bfloat16") else 4
    op = row.get("op")
    if op in ("attention", "attention_strided", "attention_variant"):
        B, H, Sq, Sk, D = row["B"], row["H"], row["Sq"], row["Sk"], row["D"]
        return (attention_flops(B, H, Sq, Sk, D, row.get("causal", False), row.get("stride", 1)),
                attention_bytes(B, H, Sq, Sk, D, elem))
    if op == "matmul_qk":
        batch = row["B"] * row["H"]
        return matmul_flops(row["Sq"], row["Sk"], row["D"], batch), matmul_bytes(row["Sq"], row["Sk"], row["D"], batch, elem)
    if op == "matmul_av":
        batch = row["B"] * row["H"]
        return matmul_flops(row["Sq"], row["D"], row["Sk"], batch), matmul_bytes(row["Sq"], row["D"], row["Sk"], batch, elem)
    if op == "softmax":
        rows = row["B"] * row["H"] * row["Sq"]
        return softmax_flops(rows, row["Sk"]), softmax_bytes(rows, row["Sk"], elem)
    if op in ("layer_norm", "add_layer_norm"):
        return (layer_norm_flops(row["rows"], row["hidden"]),
                layer_norm_bytes(row["rows"], row["hidden"], elem, residual=op == "add_layer_norm"))
    if op == "mlp":
        return mlp_flops(row["tokens"], row["hidden"], row["inner"]), mlp_bytes(row["tokens"], row["hidden"], row["inner"], elem)
    if op in ("linear1", "linear2"):
        return matmul_flops(row["M"], row["N"], row["K"]), matmul_bytes(row["M"], row["N"], row["K"], 1, elem)
    return None


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------------------------
# Ceilings


def _time(fn, reps=20) -> float:
    from utils.bench import time_cuda

    return time_cuda(fn, warmup=3, reps=reps, flush_l2=False)


def measure_ceilings() -> dict:
    """Measure every ceiling on the current GPU (about 20 s)."""
    from utils import ceilings as ceilings_ext

    props = torch.cuda.get_device_properties(0)
    out: dict = {"gpu": props.name, "sms": props.multi_processor_count}

    src = torch.empty(2 * 2**30 // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src))
    out["dram_TBps"] = 2 * src.numel() * 4 / (ms * 1e-3) / 1e12
    del src, dst

    ops = ceilings_ext.load()
    threads, iterations = 256, 4096
    blocks = props.multi_processor_count * 16
    scratch = torch.empty(blocks * threads, device="cuda")
    ms = _time(lambda: ops.ffma_peak(scratch, blocks, threads, iterations))
    ffma = blocks * threads * iterations * ceilings_ext.CHAINS_PER_THREAD
    out["fp32_TFLOPs"] = 2 * ffma / (ms * 1e-3) / 1e12

    # L2: a buffer of a third of L2, read 64 times (the first pass brings it in from DRAM).
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    buffer = torch.rand(l2_bytes // 3 // 16 * 4, device="cuda")
    passes = 64
    ms = _time(lambda: ops.l2_read(buffer, scratch, props.multi_processor_count * 8, 256, passes))
    out["l2_TBps"] = buffer.numel() * 4 * passes / (ms * 1e-3) / 1e12
    del buffer

    # L1 / shared memory: 16-byte conflict-free shared loads, 8 blocks of 256 threads per SM.
    blocks, iterations = props.multi_processor_count * 8, 8192
    ms = _time(lambda: ops.smem_read(scratch, blocks, iterations))
    out["l1_TBps"] = blocks * 256 * iterations * 16 / (ms * 1e-3) / 1e12

    n = 8192
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    for key, dtype, tf32 in (("sgemm_TFLOPs", torch.float32, False), ("tf32_tc_TFLOPs", torch.float32, True),
                             ("fp16_tc_TFLOPs", torch.float16, False), ("bf16_tc_TFLOPs", torch.bfloat16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        ms = _time(lambda: a @ b, reps=10)
        out[key] = matmul_flops(n, n, n) / (ms * 1e-3) / 1e12
        del a, b
    torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    torch.cuda.empty_cache()
    return out


def load_cached_ceilings(gpu: str | None = None) -> dict | None:
    """Cached ceilings for this GPU (or the named one, or the first cached one on a CPU machine)."""
    if not CEILINGS_PATH.exists():
        return None
    cache = json.loads(CEILINGS_PATH.read_text())
    if gpu is None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0).name
    if gpu is not None:
        return cache.get("by_gpu", {}).get(gpu)
    return next(iter(cache.get("by_gpu", {}).values()), None)


def get_ceilings(remeasure: bool = False) -> dict:
    """This GPU's ceilings, measured once and cached (with the environment stamp)."""
    from utils.results import env_stamp

    cached = None if remeasure else load_cached_ceilings()
    if cached is not None:
        return cached
    ceilings = measure_ceilings()
    ceilings["env"] = env_stamp()
    cache = json.loads(CEILINGS_PATH.read_text()) if CEILINGS_PATH.exists() else {"by_gpu": {}}
    cache["by_gpu"][ceilings["gpu"]] = ceilings
    CEILINGS_PATH.parent.mkdir(parents=True, exist_ok=True)
    CEILINGS_PATH.write_text(json.dumps(cache, indent=1) + "\n")
    return ceilings


def ridge_point(ceilings: dict, key: str = "fp32_TFLOPs") -> float:
    """Intensity (FLOP/byte) where the compute ceiling meets the bandwidth line."""
    return ceilings[key] / ceilings["dram_TBps"]
