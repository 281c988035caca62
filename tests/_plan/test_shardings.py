"""``meshinit.shardings``: the sharding of every placed leaf, and a PlanError naming
each leaf that has none."""

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit


def test_the_tree_of_shardings_of_placed_leaves_and_abstract_ones():
    mesh = AbstractMesh((2, 4), ("fsdp", "tensor"))
    plan = meshinit.plan(
        {
            "w": meshinit.param(
                (8, 8), jax.nn.initializers.zeros, axes=("fsdp", "tensor"), mesh=mesh
            ),
            "b": meshinit.param((8,), jax.nn.initializers.zeros, mesh=mesh),
        }
    )
    got = meshinit.shardings(plan.abstract())
    assert got == {"w": NamedSharding(mesh, P("fsdp", "tensor")), "b": NamedSharding(mesh, P(None))}
    placed = jax.device_put(np.zeros(4), jax.devices()[0])
    assert meshinit.shardings([placed]) == [placed.sharding]


def test_leaves_without_a_sharding_are_named_each_by_path():
    tree = {"a": 1.0, "b": [np.zeros(2)], "c": jax.ShapeDtypeStruct((2,), np.float32)}
    with pytest.raises(meshinit.PlanError, match="these leaves carry no sharding") as err:
        meshinit.shardings(tree)
    assert [(p.path, p.message) for p in err.value.problems] == [
        ("a", "a float with no sharding"),
        ("b.0", "a ndarray with no sharding"),
        ("c", "a ShapeDtypeStruct with no sharding"),
    ]
