"""The Python tests' one comparison against a reference (cells.py) fails where a plain
``np.abs(got - want).max() < tol`` or a broadcast lets a wrong result through."""

import numpy as np
import pytest

from cells import assert_cells


def test_equal_cells_pass_and_return_the_worst_difference():
    assert assert_cells("t", [1.0, 2.05], [1.0, 2.0], atol=0.1) == pytest.approx(0.05)
    assert assert_cells("t", {"a": 1.0, "b": 2.0}, {"b": 2.0, "a": 1.0}, atol=0.0) == 0.0
    assert_cells("t", [1.0, 2.5, 40.0], [1.0, 2.0, 40.0], rel_max=0.02)


@pytest.mark.parametrize("got, want, match", [
    ([1.0, np.nan], [1.0, 2.0], r"cell \(1,\) is nan"),
    ([1.0, np.inf], [1.0, 2.0], "inf"),
    ([1.0, 2.0], [1.0, np.nan], "the reference's cell"),
    ([1.0, 2.0], [[1.0, 2.0]], "shape"),  # a broadcast would pass
    ([1.0], [1.0, 2.0], "shape"),
    ([1.0, 2.5], [1.0, 2.0], r"at cell \(1,\)"),
    ({"a": 1.0}, {"a": 1.0, "b": 2.0}, "missing, first 'b'"),
    ({"a": 1.0, "c": 2.0}, {"a": 1.0}, "'c' is not in the reference"),
    ({"a": None}, {"a": 1.0}, "nan"),
    ([], [], "no cells"),
])
def test_what_a_plain_maximum_lets_through_fails(got, want, match):
    with pytest.raises(AssertionError, match=match):
        assert_cells("t", got, want, atol=0.1)


def test_a_relative_bound_is_of_the_largest_reference_value():
    with pytest.raises(AssertionError):
        assert_cells("t", [1.0, 2.5, 40.0], [1.0, 2.0, 40.0], rel_max=0.01)
