"""utils.checks.dim_in (CPU): the same answers as `in`, on its plain path and its traced one."""

from __future__ import annotations

from utils.checks import dim_in


class TracedInt(int):
    """An int whose type is not int: dim_in takes the comparisons it writes for a symbolic D."""


def test_dim_in_answers_as_in_does():
    for dims in ((64, 128), range(1, 129), range(8, 257, 8)):
        for D in (0, 1, 8, 12, 64, 100, 128, 256, 264):
            assert dim_in(D, dims) == (D in dims), (D, dims)
            assert dim_in(TracedInt(D), dims) == (D in dims), (D, dims, "traced path")
