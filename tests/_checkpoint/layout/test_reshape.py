"""Index arithmetic of reshapes: which axes a reshape merges, the rectangle of the
unmerged shape a block covers, and whether a slice reshapes as a view."""

import numpy as np
import pytest

from meshinit._checkpoint.layout.reshape import merges, unmerge, viewable


@pytest.mark.parametrize(
    ("view", "out", "want"),
    [
        ((4, 8, 2), (32, 2), (2, 1)),
        ((4, 8, 2), (4, 16), (1, 2)),
        ((4, 1), (4,), (2,)),  # a trailing unit axis joins the last group
        ((4, 8), (8, 4), None),  # a split, not a merge
        ((0, 3), (0, 3), (1, 1)),
        ((0, 3), (3, 0), None),
    ],
)
def test_merges_counts_the_axes_each_output_axis_merges(view, out, want):
    assert merges(view, out) == want


def test_a_block_of_whole_rows_unmerges_to_a_rectangle_and_a_cut_row_to_none():
    # (4, 8) merged to (32,): rows 1..2 are elements 8..24
    assert unmerge((slice(8, 24),), (2,), (4, 8)) == (slice(1, 3), slice(0, 8))
    assert unmerge((slice(10, 12),), (2,), (4, 8)) == (slice(1, 2), slice(2, 4))
    assert unmerge((slice(4, 12),), (2,), (4, 8)) is None  # cuts two rows


@pytest.mark.parametrize(
    ("stored", "index", "shape"),
    [
        ((4, 8), (slice(1, 3), slice(0, 8)), (16,)),
        ((4, 8), (slice(0, 4), slice(0, 4)), (16,)),
        ((4, 8), (slice(0, 4), slice(0, 4)), (4, 2, 2)),
        ((6, 4), (slice(0, 6, 2), slice(0, 4)), (12,)),
    ],
)
def test_viewable_says_what_numpy_does_without_copying(stored, index, shape):
    x = np.arange(int(np.prod(stored))).reshape(stored)[index]
    try:
        np.reshape(x, shape, copy=False)
        numpy_says = True
    except ValueError:
        numpy_says = False
    assert viewable(stored, index, shape) is numpy_says


def test_runs_are_the_stored_axes_a_reshape_split():
    from meshinit._checkpoint.layout.reshape import runs

    assert runs((4, 8, -1), (4, 8, 16)) == (32, 16)
    assert runs((-1, 4, 8), (16, 4, 8)) == (16, 32)
    assert runs((4, 8), (4, 8)) == (32,)
    assert runs((4, -1), (4, 8)) == (4, 8)
