"""One stored tensor from the regions its parameters write: its extent from their
slices, every element written once, the regions placed on the devices."""

import jax
import jax.numpy as jnp
import numpy as np

from meshinit._checkpoint.write.reverse import recipes
from meshinit.safetensors import Tensor


def _planned(**shapes):
    return {p: (s, np.dtype("f4")) for p, s in shapes.items()}


def test_every_other_column_from_two_parameters_makes_one_tensor():
    table = {"even": Tensor("w", index=np.s_[..., ::2]), "odd": Tensor("w", index=np.s_[..., 1::2])}
    (r,), problems = recipes(table, _planned(even=(3, 4), odd=(3, 4)))
    assert problems == [] and r.shape == (3, 8) and r.paths == ("even", "odd")
    even, odd = jnp.arange(12.0).reshape(3, 4), -jnp.arange(12.0).reshape(3, 4)
    made = np.asarray(jax.jit(r.build)((even, odd), ()))
    np.testing.assert_array_equal(made[:, ::2], even)
    np.testing.assert_array_equal(made[:, 1::2], odd)


def test_regions_written_twice_or_not_at_all_are_named():
    twice = {"a": Tensor("t", index=np.s_[:4]), "b": Tensor("t", index=np.s_[2:6])}
    _, problems = recipes(twice, _planned(a=(4, 2), b=(4, 2)))
    assert [p.path for p in problems] == ["t"] and "is written twice, by a and b" in problems[
        0
    ].message
    gap = {"a": Tensor("t", index=np.s_[:2]), "b": Tensor("t", index=np.s_[4:6])}
    _, problems = recipes(gap, _planned(a=(2, 2), b=(2, 2)))
    assert (
        "covered only in part" in problems[0].message
        and "4 are written by none" in problems[0].message
    )


def test_a_bound_counted_from_the_end_of_an_unknown_size_is_refused():
    _, problems = recipes({"a": Tensor("t", index=np.s_[-4:])}, _planned(a=(4, 2)))
    assert "counts from the end of a size the export does not know" in problems[0].message


def test_parts_of_two_dtypes_are_refused():
    table = {"a": Tensor("t", index=np.s_[:2]), "b": Tensor("t", index=np.s_[2:])}
    planned = {"a": ((2,), np.dtype("f4")), "b": ((2,), np.dtype("bfloat16"))}
    _, problems = recipes(table, planned)
    assert "dtypes" in problems[0].message and "cast them to one" in problems[0].message
