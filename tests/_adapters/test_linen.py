"""What a linen init takes besides the module: example inputs that its
parameters are computed from, keys held by a wrapper (kauldron's ``PRNGKey``), and
``capture_intermediates=``.

Each test here failed before its fix, on both stacks."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import same_bits
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


# ------------------------------------------- parameters computed from inputs


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


# ------------------------------------------------- keys held by a wrapper


@jax.tree_util.register_pytree_node_class
class PRNGKey:
    """A stand-in for kauldron's ``kd.random.PRNGKey``: a registered pytree whose one
    leaf is the jax key it wraps, named as jax's ``jax.random.PRNGKey`` is."""

    def __init__(self, rng):
        self.rng = rng

    def tree_flatten(self):
        return [self.rng], None

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(leaves[0])


class Opaque:
    """A wrapper that holds a key by no protocol jax knows: refused."""

    def __init__(self, rng):
        self.rng = rng


Opaque.__name__ = Opaque.__qualname__ = "PRNGKey"
Opaque.__module__ = "somewhere.random"


class Array:
    """A wrapper that gives its key through ``__jax_array__``."""

    def __init__(self, rng):
        self.rng = rng

    def __jax_array__(self):
        return self.rng


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "fsdp"))
        x = nn.Dense(64, kernel_init=init, use_bias=False)(x)
        return nn.Dropout(0.5, deterministic=False)(x)


@pytest.mark.parametrize("wrap", [PRNGKey, Array], ids=["pytree", "jax_array"])
@pytest.mark.parametrize("raw", [jax.random.PRNGKey(3), jax.random.key(3)], ids=["legacy", "typed"])
def test_a_key_held_by_a_wrapper_stands_for_its_key(wrap, raw):
    mesh = auto_mesh()
    x = np.ones((2, 16), np.float32)
    model = Dense()
    want = nn.unbox(jax.jit(model.init)({"params": raw, "dropout": raw}, x))["params"]
    rngs = {"params": wrap(raw), "dropout": wrap(raw)}  # as RngStreams.init_rngs() gives
    got = nn.unbox(meshinit.linen.init(model, rngs, x, mesh=mesh))["params"]
    same_bits(got["Dense_0"]["kernel"], want["Dense_0"]["kernel"], "kernel")
    assert got["Dense_0"]["kernel"].sharding == NamedSharding(mesh, P(None, "fsdp"))
    single = nn.unbox(meshinit.linen.init(model, wrap(raw), x, mesh=mesh))["params"]
    same_bits(single["Dense_0"]["kernel"], want["Dense_0"]["kernel"], "kernel (one key)")
    # the other doors that take a key: eqx.init and the spec path
    lin = meshinit.eqx.init(
        lambda k: eqx.nn.Linear(4, 8, key=k), wrap(raw), [(r".*", None)], mesh=mesh
    )
    same_bits(lin.weight, eqx.nn.Linear(4, 8, key=raw).weight, "eqx weight")
    init = jax.nn.initializers.normal()
    specs = {"w": meshinit.param((8, 4), init, axes=("fsdp", None), mesh=mesh)}
    same_bits(meshinit.init(specs, wrap(raw))["w"], meshinit.init(specs, raw)["w"], "spec w")


def test_a_key_of_an_unknown_wrapper_is_refused_naming_its_full_type():
    model, x = Dense(), np.ones((2, 16), np.float32)
    with pytest.raises(TypeError, match=r"got somewhere\.random\.PRNGKey\. Pass the jax key"):
        meshinit.linen.init(model, Opaque(jax.random.key(0)), x, mesh=auto_mesh())
    with pytest.raises(TypeError, match=r"key\['dropout'\]: .*got somewhere\.random\.PRNGKey"):
        meshinit.linen.init(
            model,
            {"params": jax.random.key(0), "dropout": Opaque(jax.random.key(1))},
            x,
            mesh=auto_mesh(),
        )
    # a pytree of two keys, or of something else than a key, holds no one key
    with pytest.raises(TypeError, match=r"got .*_adapters\.test_linen\.PRNGKey"):
        meshinit.linen.init(model, PRNGKey(np.zeros((3,), np.float32)), x, mesh=auto_mesh())


# ------------------------------------------------- capture_intermediates


class Mlp(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "fsdp"))
        for _ in range(self.layers):
            x = nn.relu(nn.Dense(64, kernel_init=init, use_bias=False)(x))
        self.sow("intermediates", "last", x)
        return x


def _outputs(plan):
    return [e.path for e in plan.entries]


def test_capture_intermediates_leaves_the_activations_out_and_says_so(count_compiles):
    mesh = auto_mesh()
    model, x = Mlp(), np.ones((2, 64), np.float32)
    key = jax.random.PRNGKey(0)
    flax_vars = model.init(key, x, capture_intermediates=True)
    assert set(flax_vars) == {"params", "intermediates"}  # what flax gives
    activations = len(jax.tree_util.tree_leaves(flax_vars["intermediates"]))
    assert activations == 6  # 4 Dense, the module's own __call__, the sown value

    meshinit.clear_cache()
    with count_compiles() as plain:
        base = meshinit.linen.init(model, key, x, mesh=mesh, default="replicated")
    meshinit.clear_cache()
    with pytest.warns(UserWarning, match=r"collected 6 arrays .* 'intermediates' collection"):
        with count_compiles() as captured:
            got = meshinit.linen.init(
                model, key, x, mesh=mesh, default="replicated", capture_intermediates=True
            )
    assert set(got) == {"params"}
    assert captured.count == plain.count, "the activations were compiled"
    with pytest.warns(UserWarning, match=r"collected 6 arrays"):
        plan = meshinit.linen.plan(
            model, key, x, mesh=mesh, default="replicated", capture_intermediates=True
        )
    assert _outputs(plan) == [f"params.Dense_{i}.kernel" for i in range(4)]
    want = nn.unbox(jax.jit(model.init)(key, x))["params"]  # capture changes no parameter
    for i in range(4):
        kernel = got["params"][f"Dense_{i}"]["kernel"].value
        same_bits(kernel, want[f"Dense_{i}"]["kernel"], f"Dense_{i}")
        assert kernel.sharding == NamedSharding(mesh, P(None, "fsdp"))
        same_bits(kernel, base["params"][f"Dense_{i}"]["kernel"].value, f"Dense_{i} (base)")


@pytest.mark.parametrize("mutable", [True, ["params", "intermediates"]], ids=["all", "named"])
def test_a_mutable_that_names_intermediates_keeps_them_with_their_count(mutable):
    mesh = auto_mesh()
    model, x = Mlp(layers=2), np.ones((2, 64), np.float32)
    key = jax.random.PRNGKey(0)
    want = jax.jit(lambda k, x: model.init(k, x, capture_intermediates=True, mutable=mutable))(
        key, x
    )
    with pytest.warns(UserWarning, match=r"holds 4 arrays .* mutable= keeps it"):
        got = meshinit.linen.init(
            model,
            key,
            x,
            mesh=mesh,
            default="replicated",
            capture_intermediates=True,
            mutable=mutable,
        )
    assert set(got) == {"params", "intermediates"}
    got_leaves = jax.tree_util.tree_leaves_with_path(got["intermediates"])
    want_leaves = jax.tree_util.tree_leaves_with_path(want["intermediates"])
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        same_bits(a, b, str(path))


def test_without_capture_intermediates_nothing_is_warned():
    model, x = Mlp(layers=1), np.ones((2, 64), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = meshinit.linen.init(model, 0, x, mesh=auto_mesh(), default="replicated")
    assert set(got) == {"params"}
