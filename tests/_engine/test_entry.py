"""The engine's one entry point: trace, make_arrays, paused_gc, as an adapter uses them."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
from helpers import mesh8
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit._engine import entry
from meshinit._plan.planner import build_plan
from meshinit._spec.constructor import from_constructor


def test_paused_gc_turns_the_collector_off_and_restores_it():
    assert gc.isenabled()
    with entry.paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_traced_constructor_is_made_on_its_plan_with_eager_values():
    mesh = mesh8()

    def build(key_data):
        key = jax.random.wrap_key_data(key_data)
        return [jax.random.normal(key, (16, 8)), jnp.ones((8,))]

    key_data = np.asarray(jax.random.key_data(jax.random.key(3)))
    traced = entry.trace(build, key_data)
    specs = {
        "w": meshinit.param((16, 8), from_constructor, axes=("fsdp", "tensor"), mesh=mesh),
        "b": meshinit.param((8,), from_constructor, axes=("tensor",), mesh=mesh),
    }
    plan = build_plan(specs, check_inits=False)
    outputs = [0 if e.path == "w" else 1 for e in plan.entries]
    with entry.paused_gc():
        got = entry.make_arrays(plan, traced, outputs, what="test")
    want = build(key_data)
    assert got["w"].sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got["b"]), np.asarray(want[1]))
