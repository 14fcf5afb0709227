"""Phase 3 correctness: the suite every three-kernel phase passes (utils/unfused_suite.py), with
the matmuls and the composition checked at every tile size, and the tile argument's errors.

GPU tests skip without a GPU; the CPU-tensor errors are checked everywhere (no build needed).
"""

import pytest

import phase3_tiled as ph
from utils.testing import random_qkv, randn, requires_gpu
from utils.unfused_suite import UnfusedSuite


class TestTiled(UnfusedSuite):
    phase = ph
    variants = {f"t{t}": {"tile": t} for t in ph.TILES}
    op_args = {op: (ph.DEFAULT_TILE,) for op in ("matmul_qk", "matmul_av", "attention")}

    def long_sequence(self, variant: dict) -> int:
        return 65535 * variant["tile"] + 17        # Sq / tile past the 65535 grid-y limit


@requires_gpu
def test_bad_tiles_are_rejected_naming_the_argument():
    q, k, v = random_qkv(1, 2, 8, 8, 32)
    for bad_tile in (12, 64, 16.0, True):
        with pytest.raises(ValueError, match="tile"):
            ph.attention(q, k, v, tile=bad_tile)
        with pytest.raises(ValueError, match="tile"):
            ph.matmul_qk(q, k, tile=bad_tile)
        with pytest.raises(ValueError, match="tile"):
            ph.matmul_av(randn(1, 2, 8, 8), v, tile=bad_tile)
    # The C++ op checks again (direct callers of torch.ops get a message naming the argument).
    with pytest.raises(RuntimeError, match="tile must be 8, 16 or 32"):
        ph.load().attention(q, k, v, None, False, 1.0, 12)
