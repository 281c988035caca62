"""jit's sharding constraints on an Explicit mesh, lowered by meshinit's programs."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshinit._jax import explicit as _explicit
from meshinit._jax import jaxpr as _jaxpr


def _meshes():
    explicit = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    return explicit, Mesh(explicit.devices, explicit.axis_names)


def test_a_mesh_is_explicit_when_an_axis_is():
    explicit, auto = _meshes()
    assert _explicit.is_explicit(explicit)
    assert not _explicit.is_explicit(auto)
    assert not _explicit.is_explicit(None)
    with jax.set_mesh(explicit):
        assert _explicit.context_is_explicit()
    with jax.set_mesh(auto):
        assert not _explicit.context_is_explicit()
    assert not _explicit.context_is_explicit()


def _program(auto, constrained):
    """``normal(k) * 0.02`` on (64, 40), evaluated node by node, with or without jit's
    Explicit-mesh constraints, as a jit onto P('a', 'b') of the Auto mesh."""

    def f(k):
        return jax.random.normal(k, (64, 40)) * 0.02

    prog = _jaxpr.flatten(jax.make_jaxpr(f)(jax.random.key(0)))
    bind = _jaxpr.bind_node
    if constrained:
        bind = _explicit.explicit_bind(bind, auto, (64, 40), P("a", "b"))

    def run(k):
        env = {**prog.consts, prog.inputs[0]: k}
        _jaxpr.run_nodes(prog, range(len(prog.nodes)), env, bind)
        return env[prog.outputs[0]]

    with jax.set_mesh(auto):
        return jax.jit(run, out_shardings=NamedSharding(auto, P("a", "b")))


def test_the_scalar_of_an_elementwise_operation_is_broadcast_and_constrained():
    """As jax lowers ``x * 0.02`` under an Explicit mesh: the 0.02 broadcast to the
    array's shape and constrained, which keeps XLA from folding it into the normal's
    own √2 (jax 0.10.2: ``erf_inv(u) * 0.0282842703`` on Auto, 1 ulp off in about a
    quarter of the elements)."""
    explicit, auto = _meshes()
    key = jax.random.key(0)
    text = _program(auto, True).lower(key).as_text()
    plain = _program(auto, False).lower(key).as_text()
    assert "sharding_constraint" in text and "sharding_constraint" not in plain
    assert '[{"a"}, {"b"}]' in text  # values of the parameter's shape on its sharding
    assert "[{}, {}]" not in text  # nothing replicated: no array whole on a device
    with jax.set_mesh(explicit):
        want = jax.jit(lambda k: jax.random.normal(k, (64, 40)) * 0.02)(key)
    made = _program(auto, True)(key)
    assert made.sharding == NamedSharding(auto, P("a", "b"))
    bits = [np.asarray(a).view(np.uint32) for a in (made, want)]
    np.testing.assert_array_equal(*bits)


def test_select_n_keeps_its_scalar_predicate_and_values_are_unchanged():
    _, auto = _meshes()

    def f(x):
        return jax.lax.select_n(True, x, x * 2.0), jnp.where(x > 1.0, x, 0.5)

    prog = _jaxpr.flatten(jax.make_jaxpr(f)(np.zeros((8, 4), np.float32)))
    bind = _explicit.explicit_bind(_jaxpr.bind_node, auto, (8, 4), P("a", "b"))

    def run(x):
        env = {**prog.consts, prog.inputs[0]: x}
        _jaxpr.run_nodes(prog, range(len(prog.nodes)), env, bind)
        return [env[o] for o in prog.outputs]

    x = np.arange(32, dtype=np.float32).reshape(8, 4) / 8
    with jax.set_mesh(auto):
        got = jax.jit(run)(x)
    for g, w in zip(got, f(x), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
