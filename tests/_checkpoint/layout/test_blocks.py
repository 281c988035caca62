"""A path's resolved parts: constants checked against the planned dtype, and a
device's block read only from the parts it reaches."""

import ml_dtypes
import numpy as np
import pytest

from meshinit._checkpoint.layout import blocks


@pytest.mark.parametrize(
    ("value", "dtype", "why"),
    [
        (3, np.int8, None),
        (1.0, ml_dtypes.bfloat16, None),
        (300, np.int8, "is outside int8's range"),
        (0.5, np.int32, "is not an integer, planned int32"),
        (1e300, np.float32, "overflows float32"),
        (True, np.bool_, None),
    ],
)
def test_a_constant_is_held_exactly_or_says_why_not(value, dtype, why):
    got, said = blocks.constant(value, dtype)
    assert said == why
    assert got.shape == () and got.dtype == np.dtype(dtype)
    if why is None:
        assert got == value


def test_a_refusal_carries_the_missing_tensors_it_names():
    refused = blocks.Refused("tensor 'x' is not in the files", [("", "x")])
    assert refused.message == str(refused) and refused.missing == [("", "x")]
