"""A stored tensor's view in the normal form a ``Tensor`` reads, kept through reshapes
and indexing, and read back in its simplest form."""

import numpy as np
import pytest

from meshinit._checkpoint.layout import views
from meshinit.safetensors import Tensor


def whole(shape):
    n = len(shape)
    return views.View(
        "w",
        shape,
        [slice(0, d, 1) for d in shape],
        list(shape),
        list(range(n)),
        [[a] for a in range(n)],
    )


def test_a_whole_view_reads_as_the_plain_tensor():
    v = whole((4, 6))
    assert v.shape == (4, 6) and v.target() == Tensor("w")


def test_a_reshape_and_a_slice_are_kept_as_the_tensor_that_reads_them():
    merged = views.reshaped(whole((4, 6)), (24,))
    assert merged.shape == (24,) and merged.target() == Tensor("w", shape=(24,))
    rows = views.sliced(whole((4, 6)), (slice(1, 3),))
    assert rows.shape == (2, 6)
    assert rows.target() == Tensor("w", index=(slice(1, 3), slice(0, 6)))
    x = np.arange(24).reshape(4, 6)
    np.testing.assert_array_equal(x[rows.target().index], x[1:3])


@pytest.mark.parametrize(("shape", "want"), [((2, -1), (2, 6)), ((-1,), (12,)), ((3, 4), (3, 4))])
def test_a_minus_one_resolves_as_numpy_resolves_it(shape, want):
    assert views.resolved(shape, 12) == want == np.zeros(12).reshape(shape).shape
