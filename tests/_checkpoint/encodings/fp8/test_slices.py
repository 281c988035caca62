"""How a large block of a dequantized parameter is cut into slices."""

from meshinit._checkpoint.encodings.fp8 import slices


def test_a_slice_is_cut_along_the_first_axis_that_divides_the_block_so():
    limit = slices.SLICE_BYTES
    # DeepSeek-V3's experts' [experts, layers, 2048, 7168] on one device: an expert's
    # layers a slice; its o_proj's [layers, 7168, 16384]: a layer is more, so rows
    assert slices.cut((8, 4, 2048, 7168), 1) == (0, 8)
    assert slices.cut((4, 7168, 16384), 1) == (1, 7)
    assert slices.cut((limit,), 1) is None  # it fits whole
    assert slices.cut((limit // 2,), 2) is None
    assert slices.cut((3, limit), 1) == (0, 3)
    assert slices.cut((1, 2 * limit + 2), 1) == (1, 5)  # the first count that divides so
    prime = 67108879  # > limit: twice it splits in 2 at most, the smallest slices it gives
    assert slices.cut((1, 2 * prime), 1) == (1, 2)
    # 67 > MOST_SLICES: no count of the first axis; the most the next gives
    assert slices.cut((67, limit), 1) == (1, slices.MOST_SLICES)
    assert slices.cut((67, 67), 2 * limit) is None  # no axis divides: whole
    assert slices.pieces((slice(8, 16), slice(0, 4)), (0, 4)) == [
        (slice(8 + 2 * k, 10 + 2 * k), slice(0, 4)) for k in range(4)
    ]
