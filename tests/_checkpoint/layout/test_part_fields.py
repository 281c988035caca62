"""The fields of ``names=``'s parts, checked as each part is made: what each gives back,
and what each refuses, naming the part's kind and the field."""

import numpy as np
import pytest

from meshinit._checkpoint.layout import part_fields


def test_ints_and_sizes_take_sequences_of_ints_and_refuse_bools_and_negatives():
    assert part_fields.ints([np.int64(2), -1], "shape") == (2, -1)
    assert part_fields.ints(None, "shape") is None
    with pytest.raises(TypeError, match=r"Stack permute must be a sequence of ints, got \[True"):
        part_fields.ints([True, 0], "permute", "Stack")
    with pytest.raises(TypeError, match="Tensor shape must be a sequence of ints, got 3"):
        part_fields.ints(3, "shape")
    assert part_fields.sizes((4, 0), "shape", "Fill") == (4, 0)
    with pytest.raises(ValueError, match=r"Pad shape \(4, -1\): sizes are non-negative"):
        part_fields.sizes([4, -1], "shape", "Pad")


def test_slices_keep_the_form_np_s_gives_and_refuse_what_no_view_reads():
    assert part_fields.slices(np.s_[:4]) == (slice(None, 4, None),)
    assert part_fields.slices(np.s_[..., 1::1]) == (Ellipsis, slice(1, None, None))
    assert part_fields.slices(np.s_[np.int32(2) :: 3]) == (slice(2, None, 3),)
    for index, error in [
        (3, "basic slices with a positive step"),
        (np.s_[::-1], "a step must be positive"),
        (np.s_[..., :2, ...], "at most one Ellipsis"),
        (slice(True, 4), "basic slices"),
    ]:
        with pytest.raises(TypeError, match=error):
            part_fields.slices(index)


def test_a_value_is_a_python_number_or_a_numpy_scalars_item():
    assert type(part_fields.number(np.float32(1.5), "Fill")) is float
    assert part_fields.number(True, "Pad") is True
    for value in ("0", np.zeros(2), None):
        with pytest.raises(TypeError, match="Fill value must be a Python float, int or bool"):
            part_fields.number(value, "Fill")
