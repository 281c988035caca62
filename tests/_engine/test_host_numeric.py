"""numpy twins of XLA's integer arithmetic: XLA's bits, or NotHost where they differ."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshinit._engine import host_numeric


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint16])
def test_integer_division_and_remainder_round_toward_zero_as_xla_does(dtype):
    info = np.iinfo(dtype)
    a = np.array([7, 7, info.max, info.max, 0] + ([-7, -7, info.min] if info.min else []), dtype)
    b = np.array([2, 3, 3, 7, 5] + ([2, -2, 7] if info.min else []), dtype)
    np.testing.assert_array_equal(host_numeric.int_div(a, b), np.asarray(jax.lax.div(a, b)))
    np.testing.assert_array_equal(host_numeric.int_rem(a, b), np.asarray(jax.lax.rem(a, b)))


def test_division_by_zero_and_float_division_are_left_to_the_program():
    with pytest.raises(host_numeric.NotHost, match="by zero"):
        host_numeric.int_div(np.array([1], np.int32), np.array([0], np.int32))
    with pytest.raises(host_numeric.NotHost, match="float32 division"):
        host_numeric.int_div(np.array([1.0], np.float32), np.array([2.0], np.float32))


def test_conversions_wrap_as_jax_does():
    x = np.array([300, -1, 70000], np.int32)
    for dtype in (np.uint8, np.int8, np.uint16):
        got = host_numeric.convert(x, dtype)
        np.testing.assert_array_equal(got, np.asarray(jnp.asarray(x).astype(dtype)))
