"""The correctness helpers must fail on the failures they exist to catch (CPU only)."""

import pytest
import torch

from utils import testing


def test_assert_close_passes_close_values():
    ref = torch.randn(100, dtype=torch.float64)
    err = testing.assert_close(ref.float(), ref)
    assert err < 1e-7


def test_nan_never_passes():
    ref = torch.randn(10, dtype=torch.float64)
    out = ref.float().clone()
    out[3] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        testing.assert_close(out, ref)


def test_unwritten_poisoned_output_fails():
    ref = torch.randn(8, dtype=torch.float64)
    out = testing.poisoned_like(ref.float())
    out[:7] = ref[:7].float()
    with pytest.raises(AssertionError):
        testing.assert_close(out, ref)


def test_large_error_fails_and_lists_mismatches():
    ref = torch.ones(50, dtype=torch.float64)
    out = ref.float().clone()
    out[7] = 1.01
    with pytest.raises(AssertionError, match=r"\(7,\)"):
        testing.assert_close(out, ref)


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError, match="shape"):
        testing.assert_close(torch.zeros(2), torch.zeros(3, dtype=torch.float64))


def test_infinities_must_match():
    ref = torch.tensor([float("-inf"), 1.0], dtype=torch.float64)
    testing.assert_close(torch.tensor([float("-inf"), 1.0]), ref)
    with pytest.raises(AssertionError, match="infinite"):
        testing.assert_close(torch.tensor([0.0, 1.0]), ref)


def test_random_inputs_are_fresh_and_not_zero():
    a = testing.randn(64, device="cpu")
    b = testing.randn(64, device="cpu")
    assert not torch.equal(a, b) and a.abs().sum() > 0


def test_rel_error():
    assert testing.rel_error(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])) == pytest.approx(2**-0.5)


def test_ref_scale_measures_error_against_the_product_magnitude():
    # a dot product that cancels to almost zero: tiny absolute error, huge relative error
    ref = torch.tensor([1e-9], dtype=torch.float64)
    out = torch.tensor([1.1e-9])
    with pytest.raises(AssertionError):
        testing.assert_close(out, ref)
    testing.assert_close(out, ref, ref_scale=torch.tensor([1.0], dtype=torch.float64))


def test_assert_close_fp16_subnormal_output_is_judged_against_the_smallest_normal():
    # -1e-7 is subnormal in FP16: correctly rounded it is 19% off, and that passes; a 2% error on a
    # normal FP16 value fails.
    ref = torch.tensor([-1.0e-7], dtype=torch.float64)
    assert abs(ref.half().double().item() / ref.item() - 1) > 0.1
    testing.assert_close(ref.half(), ref)
    with pytest.raises(AssertionError, match="rel error"):
        testing.assert_close((ref * 1e4 * 1.02).half(), ref * 1e4)
