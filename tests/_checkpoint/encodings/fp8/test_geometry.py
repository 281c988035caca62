"""Where each element of a float8 weight's view is stored: which stored row and column
each element of a view comes from (so which block scale it takes), worked out without
memory (the bits of the route are tested end to end in test_pairing.py)."""

import numpy as np

from meshinit._checkpoint.encodings.fp8 import geometry
from meshinit._checkpoint.layout import blocks
from meshinit._checkpoint.layout.parts import Tensor
from meshinit._checkpoint.store.source import Stored


def leaf(tensor, stored_shape=(300, 200)):
    held = Stored(None, tensor.name, "F8_E4M3", stored_shape, 0, int(np.prod(stored_shape)))
    index = tensor.sliced(stored_shape)
    shape, order = tensor.transformed(tuple(s.stop - s.start for s in index))
    return blocks.Leaf(tensor, held, index, shape, order, "")


def coordinates(found, sizes):
    """Each element's (row, column) from a geometry, as the device program builds them."""
    (r, c), steps = found
    grids = np.indices(sizes)
    rows = r + sum(g * dr for g, (dr, _) in zip(grids, steps, strict=True))
    cols = c + sum(g * dc for g, (_, dc) in zip(grids, steps, strict=True))
    return rows, cols


def test_a_view_maps_each_element_to_its_stored_row_and_column():
    rows, cols = np.indices((300, 200))
    for tensor, view in [
        (Tensor("w"), lambda a: a),
        (Tensor("w", permute=(1, 0)), lambda a: a.T),
        (Tensor("w", index=np.s_[30:290, 8:]), lambda a: a[30:290, 8:]),
        (
            Tensor("w", shape=(3, 100, 200), permute=(2, 0, 1)),
            lambda a: a.reshape(3, 100, 200).transpose(2, 0, 1),
        ),
        (Tensor("w", shape=(300, 4, 50)), lambda a: a.reshape(300, 4, 50)),
    ]:
        made = leaf(tensor)
        found = geometry.geometry(made)
        assert not isinstance(found, str), tensor
        got_rows, got_cols = coordinates(found, made.view)
        assert (got_rows == view(rows)).all() and (got_cols == view(cols)).all(), tensor


def test_a_view_that_merges_rows_into_columns_is_named():
    found = geometry.geometry(leaf(Tensor("w", shape=(150, 400))))
    assert found == "an axis of its view steps across stored rows and columns at once (a merge)"


def test_a_stack_adds_an_axis_that_steps_between_leaves_in_read_order():
    parts = tuple(leaf(Tensor(f"w{i}"), (256, 128)) for i in range(3))
    inner = blocks.Joined(parts, 0, True, (3, 256, 128), (0, 1, 2))  # layers first
    outer = blocks.Joined((inner, inner), 1, True, (3, 2, 256, 128), (0, 1))  # then experts
    first, steps = geometry.axes(outer, (3, 2, 64, 128))
    assert first is parts[0]
    # read order: the outer stack's parts, each its layers; a layer steps one leaf, an
    # expert the layers a block reaches
    assert steps == [(1, 0, 0), (3, 0, 0), (0, 1, 0), (0, 0, 1)]
    assert geometry.axes(outer, (2, 2, 64, 128))[1][:2] == [(1, 0, 0), (2, 0, 0)]
    reached = blocks.reached(outer, (slice(1, 3), slice(0, 2), slice(0, 64), slice(0, 128)))
    assert [r[0].stored.name for r in reached] == ["w1", "w2", "w1", "w2"]
