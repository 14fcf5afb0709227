"""The FFMA micro-kernel that utils.roofline uses to measure the FP32 compute ceiling."""

from pathlib import Path

from utils.build import load_phase

CHAINS_PER_THREAD = 8  # kChains in csrc/ceilings.cu


def load():
    """Build and load the ceilings extension; returns torch.ops.course_ceilings."""
    import torch

    load_phase(Path(__file__).parent / "csrc", "course_ceilings", ["ceilings.cu"])
    return torch.ops.course_ceilings
