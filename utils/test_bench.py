"""The timing helper's arguments (CPU) and both L2 flushes (GPU)."""

import pytest
import torch

from utils.bench import FLUSHES, time_cuda
from utils.testing import requires_gpu


def test_unknown_flush_is_named():
    with pytest.raises(ValueError, match="flush must be one of"):
        time_cuda(lambda: None, flush="invalidate")


@requires_gpu
@pytest.mark.parametrize("flush", FLUSHES)
def test_both_flushes_time_a_kernel(flush):
    x = torch.randn(1 << 20, device="cuda")
    assert time_cuda(lambda: x * 2, reps=5, flush=flush) > 0
