"""Optimizer-state leaves placed by the parameter they mirror: which parameter a leaf
mirrors, and a parameter's spec sharded further over ZeRO-1's axes."""

import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshinit._plan import state

MESH = AbstractMesh((2, 4), ("data", "fsdp"))


def test_a_leaf_mirrors_the_parameter_whose_path_ends_its_own_and_shape_matches():
    paths, shapes = ["w", "layers.0.w", "b"], [(8, 8), (8, 8), (8,)]
    tree = {
        "mu": {"w": np.zeros((8, 8)), "layers": [{"w": np.zeros((8, 8))}], "b": np.zeros(8)},
        "count": np.zeros(()),
    }
    # flatten order: count, mu.b, mu.layers.0.w, mu.w; a scalar mirrors nothing
    assert state.mirrors_of(paths, shapes, tree) == [-1, 2, 1, 0]


def test_a_renamed_root_falls_back_to_the_longest_common_tail():
    # lookahead's fast_state.0.mu.w mirrors fast.w: the same last component and shape
    got = state.mirrors_of(["fast.w", "slow.v"], [(4,), (4,)], {"x": {"w": np.zeros(4)}})
    assert got == [0]
    # a leaf of another shape mirrors nothing, whatever its name
    assert state.mirrors_of(["fast.w"], [(4,)], {"w": np.zeros(5)}) == [-1]


def test_sharded_further_puts_the_axes_on_the_first_free_dimension_they_divide():
    sharding = NamedSharding(MESH, P(None, "fsdp"))
    assert state.sharded_further(sharding, (6, 8), ("data",)) == P("data", "fsdp")
    # 3 rows do not divide by 2: the axis joins the sharded dimension, after its own axes
    assert state.sharded_further(sharding, (3, 16), ("data",)) == P(None, ("fsdp", "data"))
    # nothing divides: the spec is unchanged; an axis already used adds nothing
    assert state.sharded_further(sharding, (3, 4), ("data",)) == P(None, "fsdp")
    assert state.sharded_further(sharding, (6, 8), ("fsdp",)) == P(None, "fsdp")


def test_shard_over_names_axes_and_scalars_need_a_mesh():
    assert state.shard_over_axes(None) == ()
    assert state.shard_over_axes("data") == ("data",)
    with pytest.raises(TypeError, match="scalars_on must be a jax.sharding.Mesh; got str"):
        state.scalars_mesh([], "data")
    assert state.scalars_mesh([], MESH) is MESH
