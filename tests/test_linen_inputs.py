"""What a linen init takes besides the module (issue 42): example inputs that its
parameters are computed from, keys held by a wrapper (kauldron's ``PRNGKey``), and
``capture_intermediates=``.

Each test here failed before its fix, on both stacks."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
import meshinit.eqx
import meshinit.linen
import meshinit.nnx

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")


def auto_mesh():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))


def cancelling_input() -> np.ndarray:
    """A float input whose mean is a near-cancellation (about 1e-8 against terms of 1):
    its float32 sum depends on the order of the additions. Summed in the order of
    ``jax.jit`` with the input as an argument, ``jnp.mean`` gives -7.45e-9; summed as one
    flat run of 1024 elements (how meshinit's packed host buffer had it), -1.35e-8."""
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    return x - x.mean()


def same_bits(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    off = int((got != want).sum())
    assert got.tobytes() == want.tobytes(), f"{what}: {off} of {got.size} elements differ"


# ------------------------------------------- item 4: parameters computed from inputs


class ScaledByInput(nn.Module):
    """A parameter scaled by its example input's mean (data-dependent init)."""

    @nn.compact
    def __call__(self, x, tokens):
        def init(key, shape):
            return jax.random.normal(key, shape) * x.mean()

        w = self.param("w", nn.with_partitioning(init, ("fsdp", None)), (64, 32))
        # an integer input beside it still travels in the packed buffer
        e = self.param(
            "e",
            nn.with_partitioning(lambda k, s: jax.random.normal(k, s) + tokens.sum(), ("fsdp",)),
            (64,),
        )
        return x @ w, e


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_a_parameter_computed_from_the_example_input_has_jits_bits(axis_type):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
    x, tokens = cancelling_input(), np.arange(12, dtype=np.int32).reshape(3, 4)
    model = ScaledByInput()
    key = jax.random.PRNGKey(0)
    with jax.set_mesh(jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))):
        want = nn.unbox(jax.jit(model.init)(key, x, tokens))["params"]
    got = nn.unbox(meshinit.linen.init(model, key, x, tokens, mesh=mesh))["params"]
    plan = meshinit.linen.plan(model, key, x, tokens, mesh=mesh)
    entries = {e.path: e for e in plan.entries}
    for name in ("w", "e"):
        same_bits(got[name], want[name], name)
        assert got[name].sharding == entries[f"params.{name}"].sharding
    assert got["w"].sharding == NamedSharding(mesh, P("fsdp", None))
    assert got["e"].sharding == NamedSharding(mesh, P("fsdp"))


def test_a_parameter_computed_from_a_captured_array_has_jits_bits_nnx_and_eqx():
    """The same pattern in nnx and eqx: an array captured from outside the factory (a
    constant of the trace, small enough for the host part) took the same packed route."""
    x = cancelling_input()
    mesh = auto_mesh()

    class Model(nnx.Module):
        def __init__(self, rngs):
            w = jax.random.normal(rngs.params(), (64, 32)) * jnp.mean(x)
            self.w = nnx.Param(w, out_sharding=("fsdp", None))

    with jax.set_mesh(mesh):
        got = meshinit.nnx.init(lambda: Model(nnx.Rngs(0)))
        want = nnx.jit(lambda: Model(nnx.Rngs(0)))()
    same_bits(got.w[...], want.w[...], "nnx w")
    assert got.w[...].sharding == NamedSharding(mesh, P("fsdp", None))

    class Eqx(eqx.Module):
        w: jax.Array

        def __init__(self, key):
            self.w = jax.random.normal(key, (64, 32)) * jnp.mean(jnp.asarray(x))

    key = jax.random.key(0)
    got_e = meshinit.eqx.init(Eqx, key, [(r"w", ("fsdp", None))], mesh=mesh)
    want_e = eqx.filter_jit(Eqx)(key)
    same_bits(got_e.w, want_e.w, "eqx w")
    assert got_e.w.sharding == NamedSharding(mesh, P("fsdp", None))
