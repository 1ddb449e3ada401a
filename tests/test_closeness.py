"""labkit.grading.closeness: a wrong tensor named in words, with its uniform factor and cause (no process)."""
import pytest
import torch

from labkit.grading.closeness import check_close, factor_hint, uniform_factor

WANT = torch.arange(1.0, 7.0, dtype=torch.float64).reshape(2, 3)


def test_check_close_names_the_quantity_the_largest_difference_and_the_factor_cause():
    with pytest.raises(AssertionError) as info:
        check_close(2 * WANT, WANT, "the gradient of w on rank 1", factors={2: "a sum where a mean was due"}, hint="see")
    assert str(info.value) == (
        "the gradient of w on rank 1 differs from the reference: largest difference 6 at index (1, 2) (got 12, "
        "expected 6; largest expected magnitude 6; 6 of 6 elements differ); got = 2 x expected: a sum where a mean "
        "was due. see")


def test_check_close_one_element_off_has_no_factor_and_a_shape_mismatch_is_named():
    got = WANT.clone()
    got[1, 1] += 0.5
    with pytest.raises(AssertionError, match=r"at index \(1, 1\) \(got 5.5, expected 5; .*1 of 6 elements differ\)$"):
        check_close(got, WANT, "x")
    with pytest.raises(AssertionError, match=r"x differs from the reference: it has shape \(3,\), expected \(2, 3\)"):
        check_close(torch.zeros(3), WANT, "x")
    check_close(WANT + 1e-12, WANT, "x", rtol=1e-10, atol=0)  # close: no error


def test_factor_hint_reads_zero_minus_one_and_unlisted_factors_and_refuses_non_uniform_ones():
    assert factor_hint(0 * WANT, WANT) == "got = 0 x expected: nothing was added or nothing arrived"
    assert factor_hint(-WANT, WANT) == "got = -1 x expected: the opposite sign"
    assert factor_hint(WANT / 4, WANT, {0.25: "divided twice"}) == "got = 0.25 x expected: divided twice"
    assert factor_hint(3 * WANT, WANT, {2: "no"}) == "got = 3 x expected"
    assert factor_hint(WANT, WANT) == ""
    off = 2 * WANT
    off[0, 0] += 1e-3
    assert uniform_factor(off, WANT) is None and factor_hint(off, WANT) == ""


def test_check_close_refuses_one_tolerance_without_the_other():
    with pytest.raises(ValueError, match="give both rtol and atol"):
        check_close(WANT, WANT, "x", rtol=1e-3)
