"""The suite's own checks cannot pass for the wrong reason."""

import numpy as np
import pytest


def test_the_suite_s_array_comparisons_never_take_nan_for_a_match():
    """A comparison of two NaN results must fail (tests/conftest.py): numpy takes NaN in the same
    place on both sides as equal."""
    from numpy.testing import assert_allclose  # imported by name, as many tests do

    nan = np.array([1.0, np.nan])
    for compare in (assert_allclose, np.testing.assert_allclose, np.testing.assert_array_equal,
                    np.testing.assert_array_almost_equal):
        with pytest.raises(AssertionError):
            compare(nan, nan.copy())
    np.testing.assert_allclose(nan, nan.copy(), equal_nan=True)  # where NaN is the expected value
    np.testing.assert_array_equal(nan, nan.copy(), nan_ok=True)
