"""The tiles of a block that reaches float8 weights through a Concat, a Pad, a Fill or
a permute: which weight fills which box of the block, at which index of its view, the
grid of intervals the device program looks each element's tile up in, and the steps
every part's view must share; worked out without memory (the bits are tested end to
end in test_pairing.py)."""

import numpy as np

from meshinit._checkpoint.encodings.fp8 import tiles as dequant_tiles
from meshinit._checkpoint.layout import blocks
from meshinit._checkpoint.layout.parts import Tensor
from meshinit._checkpoint.store.source import Stored


def leaf(name, stored_shape, **kw):
    tensor = Tensor(name, **kw)
    held = Stored(None, name, "F8_E4M3", stored_shape, 0, int(np.prod(stored_shape)))
    index = tensor.sliced(stored_shape)
    shape, order = tensor.transformed(tuple(s.stop - s.start for s in index))
    return blocks.Leaf(tensor, held, index, shape, order, "")


def boxes(found):
    return [
        (
            None if t.leaf is None else t.leaf.stored.name,
            [(s.start, s.stop) for s in t.where],
            [(s.start, s.stop) for s in t.at],
        )
        for t in found
    ]


def test_a_block_across_a_concat_and_its_pad_gets_a_tile_per_part():
    q, k = leaf("q", (300, 64)), leaf("k", (200, 64))
    cat = blocks.Joined((q, k), 0, False, (500, 64), (0, 300))
    padded = blocks.Padded(cat, (512, 80), 0.0, "")
    found = dequant_tiles.tiles(padded, (slice(256, 512), slice(32, 80)))
    # the padding first (painted over), then q's last rows and k's, each at its own index
    assert boxes(found) == [
        (None, [(0, 256), (0, 48)], []),
        ("q", [(0, 44), (0, 32)], [(256, 300), (32, 64)]),
        ("k", [(44, 244), (0, 32)], [(0, 200), (32, 64)]),
    ]
    runs, cells = dequant_tiles.grid(found, (256, 48))
    assert [r[[0, 43, 44, 243, 244, 255]].tolist() for r in runs[:1]] == [[0, 0, 1, 1, 2, 2]]
    assert runs[1][[0, 31, 32, 47]].tolist() == [0, 0, 1, 1]
    assert cells.tolist() == [[1, 0], [2, 0], [0, 0]]  # the padding where no part is


def test_a_stack_permute_maps_each_part_to_its_axes():
    a, b = leaf("a", (64, 32)), leaf("b", (64, 32))
    stack = blocks.Joined((a, b), 0, True, (2, 64, 32), (0, 1), order=(2, 0, 1))  # [32, 2, 64]
    found = dequant_tiles.tiles(stack, (slice(0, 16), slice(1, 2), slice(0, 64)))
    assert boxes(found) == [("b", [(0, 16), (0, 1), (0, 64)], [(0, 64), (0, 16)])]
    assert found[0].axes == (2, 0)  # b's rows along the block's axis 2, its columns along 0
    assert dequant_tiles.steps(stack) == ((0, 1), (0, 0), (1, 0))


def test_parts_whose_views_step_differently_are_named_and_size_1_axes_agree_with_any():
    a, t = leaf("a", (64, 32)), leaf("t", (32, 64), permute=(1, 0))
    cat = blocks.Joined((a, t), 1, False, (64, 64), (0, 32))
    assert dequant_tiles.steps(cat) == (
        "along axis 0, tensor 'a''s view steps (1, 0) (stored rows, columns) and 't''s "
        "(0, 1): its parts' views step through their stored tensors differently"
    )
    one = leaf("one", (1, 32))  # a single row: its row axis steps any way
    cat = blocks.Joined((leaf("a", (64, 32)), one), 0, False, (65, 32), (0, 64))
    assert dequant_tiles.steps(cat) == ((1, 0), (0, 1))


def test_a_merge_of_the_whole_parameter_is_undone_before_the_tiles():
    a = leaf("a", (64, 32))
    flat = blocks.Leaf(a.tensor, a.stored, a.index, a.shape, a.order, "", groups=(2,))
    inner, merge = dequant_tiles.unmerged(flat)
    assert inner.groups is None and merge.inner((slice(256, 512),)) == (slice(8, 16), slice(0, 32))
