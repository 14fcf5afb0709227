"""The shared three-kernel API of phases 2-4, checked without a GPU: fake CUDA tensors go through the
Python validation and the ops' fake implementations (the extensions are built, not run)."""

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from utils.testing import requires_toolkit
from utils.unfused_api import MAX_HEAD_DIM

PHASES = ("phase2_naive", "phase3_tiled", "phase4_coalesced")


@requires_toolkit
@pytest.mark.compile
@pytest.mark.parametrize("name", PHASES)
def test_api_shapes_and_errors_on_fake_tensors(name):
    ph = importlib.import_module(name)
    ph.load()
    with FakeTensorMode():
        q = torch.empty(2, 3, 5, 16, device="cuda")
        k = torch.empty(2, 3, 7, 16, device="cuda")
        assert ph.matmul_qk(q, k).shape == (2, 3, 5, 7)
        assert ph.softmax(torch.empty(2, 3, 5, 7, device="cuda"), is_causal=True).shape == (2, 3, 5, 7)
        assert ph.matmul_av(torch.empty(2, 3, 5, 7, device="cuda"), k).shape == (2, 3, 5, 16)
        assert ph.attention(q, k, k, is_causal=True).shape == (2, 3, 5, 16)
        with pytest.raises(ValueError, match="k must be"):
            ph.matmul_qk(q, k[:, :1])
        with pytest.raises(ValueError, match="v must be"):
            ph.matmul_av(torch.empty(2, 3, 5, 7, device="cuda"), q)
        with pytest.raises(ValueError, match=f"D={MAX_HEAD_DIM + 1}"):
            big = torch.empty(1, 1, 4, MAX_HEAD_DIM + 1, device="cuda")
            ph.attention(big, big, big)
        with pytest.raises(TypeError, match="s must have dtype"):
            ph.softmax(q.double())
        with pytest.raises(ValueError, match="mask"):
            ph.softmax(torch.empty(2, 3, 5, 7, device="cuda"), mask=torch.ones(3, 5, dtype=torch.bool, device="cuda"))
