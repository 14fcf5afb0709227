"""The FFMA micro-kernel that utils.roofline uses to measure the FP32 compute ceiling."""

from pathlib import Path

from utils.build import op_loader

CHAINS_PER_THREAD = 8  # kChains in csrc/ceilings.cu

load = op_loader(Path(__file__).parent / "csrc", "course_ceilings", ["ceilings.cu"])
