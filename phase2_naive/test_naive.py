"""Phase 2 correctness: the suite every three-kernel phase passes (utils/unfused_suite.py: each
kernel and their composition against float64, masks, fully masked rows, large magnitudes, grid
limits, a score buffer past 2^31 elements, bad inputs) on the naive kernels.

GPU tests skip without a GPU; the CPU-tensor errors are checked everywhere (no build needed).
"""

import phase2_naive as ph
from utils.unfused_suite import UnfusedSuite


class TestNaive(UnfusedSuite):
    phase = ph
