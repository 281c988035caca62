"""A Recipe: one stored tensor of an export; its bytes; recipes whose builds are equal
share a program."""

import numpy as np

from meshinit._checkpoint.layout.recipe import Recipe


def test_a_recipe_counts_its_stored_bytes_and_compares_by_value():
    def build(arrays, at):
        return arrays[0]

    a = Recipe("w", (3, 4), np.dtype(np.float32), ("p",), (0,), build)
    b = Recipe("w", (3, 4), np.dtype(np.float32), ("p",), (0,), build)
    assert a.nbytes == 48 and a == b and hash(a) == hash(b)
