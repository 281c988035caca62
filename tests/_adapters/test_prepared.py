"""The one shape of the adapters: a :class:`Prepared` from any framework's trace-and-plan,
and :func:`init`, which runs it inside one collective call with the cycle collector
paused, makes its arrays, reads ``existing=`` and rewraps."""

import dataclasses
import gc

import jax
import numpy as np
from helpers import eqx_mlp, mesh8
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshinit._adapters import eqx as eqx_adapter
from meshinit._adapters import prepared
from meshinit._run import agree

PLACEMENTS = [(r".*weight", ("fsdp", None)), (r".*", None)]


def eqx_prepared():
    return eqx_adapter.prepare(eqx_mlp, 0, PLACEMENTS, mesh8(), None, "test")


def test_init_rewraps_the_arrays_it_made_on_the_planned_shardings():
    seen = {}

    def rewrap(arrays):
        seen["arrays"] = arrays
        return "rewrapped"

    prep = dataclasses.replace(eqx_prepared(), rewrap=rewrap)
    assert prepared.init("test", lambda: prep, None) == "rewrapped"
    # the factory's Module: its array leaves made, its activations as traced
    leaves = [x for x in jax.tree_util.tree_leaves(seen["arrays"]) if isinstance(x, jax.Array)]
    assert len(leaves) == len(prep.made.entries) == 6
    for entry, array in zip(prep.made.entries, leaves, strict=True):
        assert array.sharding == entry.sharding, entry.path
    weight = {e.path: a for e, a in zip(prep.made.entries, leaves, strict=True)}["layers.0.weight"]
    assert weight.sharding == NamedSharding(mesh8(), P("fsdp", None))


def test_init_reads_existing_as_the_framework_spells_it_and_places_it_as_given():
    given = np.full((32, 16), 3.0, np.float32)
    calls = []

    def existing(value):
        calls.append(value)
        return {"layers.0.weight": value["w"]}

    prep = dataclasses.replace(eqx_prepared(), existing=existing)
    module = prepared.init("test", lambda: prep, {"w": given})
    assert calls == [{"w": given}]
    assert np.array_equal(np.asarray(module.layers[0].weight), given)
    assert module.layers[0].weight.sharding == NamedSharding(mesh8(), P("fsdp", None))


def test_prepare_runs_inside_one_collective_call_with_the_cycle_collector_paused():
    state = {}

    def prepare():
        state["collective"] = agree._call.get() is not None
        state["gc"] = gc.isenabled()
        return eqx_prepared()

    was = gc.isenabled()
    prepared.init("test", prepare, None)
    assert state == {"collective": True, "gc": False}
    assert gc.isenabled() == was and agree._call.get() is None  # both restored
