"""How the device program of a dequantized Concat, Pad or permute gathers each
element's scale: as whole slices of the scale rectangles where the tiles allow it,
element by element elsewhere (both give weight_dequant's bits: test_pairing.py runs
its Concat cases each way)."""

from meshinit._checkpoint.encodings.fp8 import joins as dequant_concat


def test_scales_are_gathered_as_slices_where_the_second_coordinate_is_alike():
    rows_cols = ((1, 0), (0, 1))
    # q, k, v along the rows: tiles vary along axis 0, every tile the same columns
    assert dequant_concat.fast(rows_cols, (3, 1), (False, True)) == ("rows", 0, 1)
    # along the columns: every tile the same rows
    assert dequant_concat.fast(rows_cols, (1, 3), (True, False)) == ("columns", 1, 0)
    # a stack of layers (axis 0) of q | k | v (axis 1): rows first, columns alike
    assert dequant_concat.fast(((0, 0), *rows_cols), (4, 3, 1), (False, True)) == ("rows", 1, 2)
    # tiles that vary along both (a pad's corner) or rows over two axes: element by element
    assert dequant_concat.fast(rows_cols, (2, 2), (True, True)) is None
    assert dequant_concat.fast(((64, 0), (1, 0), (0, 1)), (1, 1, 1), (True, True)) is None
