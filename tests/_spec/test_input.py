"""What planning refuses before resolving anything: trees jax cannot flatten, paths
that are not text, shapes no array can have."""

import jax.numpy as jnp
import pytest

import meshinit
from meshinit._spec import input as _input


def test_paths_that_utf8_cannot_encode_are_told_apart():
    assert _input.encodable("layers.0.w")
    assert _input.encodable("ünïcode")
    assert not _input.encodable("bad\udc80")


def test_flatten_is_jax_s_for_a_good_tree():
    leaves, treedef = _input.flatten({"b": 2, "a": [1]})
    assert [leaf for _, leaf in leaves] == [1, 2]
    assert treedef.num_leaves == 2


def test_a_dict_whose_keys_cannot_be_sorted_is_a_plan_error_naming_its_path():
    with pytest.raises(meshinit.PlanError, match="cannot plan this tree") as err:
        _input.flatten({"outer": {1: 0, "a": 0}})
    (problem,) = err.value.problems
    assert problem.path == "outer"


def test_a_shape_whose_byte_count_overflows_int64_is_refused():
    fine = meshinit.param((1024, 1024), lambda k, s, d: jnp.zeros(s, d))
    assert _input.overflow(fine) is None
    huge = meshinit.param((2**32, 2**32), lambda k, s, d: jnp.zeros(s, d))
    message = _input.overflow(huge)
    assert message is not None
    assert message.startswith("shape (4294967296, 4294967296) has 1.845e+19 elements (float32)")
    assert message.endswith("check the shape")
