"""Old method names of ``Plan`` and ``PlanEntry``: each warns and does what its new
name does."""

import warnings

import jax
from jax.sharding import AbstractMesh

import meshinit

zeros = jax.nn.initializers.zeros


def test_the_per_device_byte_counts_have_their_own_names_and_the_old_ones_warn():

    m = AbstractMesh((2, 4), ("data", "tensor"))
    p = meshinit.plan(
        meshinit.param((8, 8), jax.nn.initializers.zeros, axes=(None, "tensor"), mesh=m)
    )
    assert p.bytes_per_device()[(m, 0)] == 64 and p.replicated_bytes_per_device()[(m, 0)] == 64
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert p.device_bytes() == p.bytes_per_device()
        assert p.replicated_bytes() == p.replicated_bytes_per_device()
        assert p.entries[0].abstract == p.entries[0].struct == p.abstract()
    assert [issubclass(w.category, DeprecationWarning) for w in caught] == [True, True, True]
