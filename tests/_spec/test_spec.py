import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import same_bits
from jax.sharding import AbstractMesh

import meshinit

zeros = jax.nn.initializers.zeros
MESH = AbstractMesh((2, 4), ("fsdp", "tensor"))
EMBED_MLP_RULES = (("embed", "fsdp"), ("mlp", "tensor"))


def test_param_fills_fields_and_defaults_dtype_to_float32():
    init = jax.nn.initializers.normal()
    spec = meshinit.param((4, 8), init, axes=("fsdp", "tensor"), mesh=MESH, note="hi")
    assert isinstance(spec, meshinit.ParamSpec)
    assert spec.shape == (4, 8) and spec.init is init and spec.mesh is MESH
    assert spec.axes == ("fsdp", "tensor")
    assert spec.rules is None  # None: the axes name mesh axes
    assert spec.dtype == np.float32
    assert spec.metadata["note"] == "hi"
    assert spec.nbytes == 4 * 8 * 4


def test_spec_is_frozen():
    spec = meshinit.param((4,), zeros, mesh=MESH)
    with pytest.raises(AttributeError, match="cannot assign"):
        spec.shape = (5,)


def test_building_specs_allocates_nothing(new_arrays):
    with new_arrays() as made:
        specs = [
            meshinit.param((1024, 1024), jax.nn.initializers.lecun_normal(), mesh=MESH)
            for _ in range(100)
        ]
    assert len(specs) == 100
    assert made == []


@pytest.mark.parametrize("shape", [[4, 8], (np.int64(4), 8)])
def test_shape_sequences_of_ints_are_normalized_to_tuples(shape):
    assert meshinit.param(shape, zeros, mesh=MESH).shape == (4, 8)


@pytest.mark.parametrize(
    "shape, err, match",
    [
        (4, TypeError, "tuple of non-negative ints"),
        ("44", TypeError, "tuple of non-negative ints"),
        ((4.0, 2), TypeError, "tuple of non-negative ints"),
        ((True, 2), TypeError, "tuple of non-negative ints"),
        ((4, -1), ValueError, "tuple of non-negative ints"),
        (None, TypeError, "tuple of non-negative ints"),
    ],
)
def test_bad_shape_raises_at_once(shape, err, match):
    with pytest.raises(err, match=match):
        meshinit.param(shape, zeros, mesh=MESH)


def test_string_axes_raise_at_once_with_the_fix():
    with pytest.raises(TypeError, match=r"for one dimension write \('embed',\)"):
        meshinit.param((4,), zeros, axes="embed", mesh=MESH)


def test_defaults_fill_only_what_param_was_not_given_and_nest():
    other = AbstractMesh((8,), ("x",))
    with meshinit.defaults(mesh=MESH, rules=EMBED_MLP_RULES, dtype=jnp.bfloat16):
        a = meshinit.param((4, 8), zeros, axes=("embed", "mlp"))
        b = meshinit.param((8,), zeros, mesh=other, dtype=jnp.float32, rules=(("m", "x"),))
        with meshinit.defaults(dtype=jnp.int8):
            c = meshinit.param((4,), zeros)
        with meshinit.defaults(rules=meshinit.MESH_AXES):
            d = meshinit.param((4,), zeros, axes=("fsdp",))
        e = meshinit.param((4,), zeros, axes=("fsdp",), rules=meshinit.MESH_AXES)
    after = meshinit.param((4,), zeros)
    assert (a.mesh, a.rules, a.dtype) == (MESH, EMBED_MLP_RULES, jnp.bfloat16)
    assert (b.mesh, b.rules, b.dtype) == (other, (("m", "x"),), jnp.float32)
    assert (c.mesh, c.rules, c.dtype) == (MESH, EMBED_MLP_RULES, jnp.int8)
    assert (d.mesh, d.rules, d.dtype) == (MESH, None, jnp.bfloat16)
    assert e.rules is None
    assert (after.mesh, after.rules, after.dtype) == (None, None, np.float32)


def test_rules_lists_are_normalized_to_tuples():
    spec = meshinit.param(
        (4,), zeros, axes=("e",), mesh=MESH, rules=[["e", ["fsdp", "tensor"]], ["f", None]]
    )
    assert spec.rules == (("e", ("fsdp", "tensor")), ("f", None))


def test_same_spec_at_two_paths_gives_independent_parameters():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    spec = meshinit.param((8, 8), jax.nn.initializers.normal(), axes=("fsdp", "tensor"), mesh=mesh)
    out = meshinit.init({"a": spec, "b": spec}, 0)
    assert not np.array_equal(out["a"], out["b"])


def test_stacked_prepends_the_axis_and_keeps_the_rest():
    layer = meshinit.param(
        (64, 32),
        jax.nn.initializers.lecun_normal(),
        axes=("embed", "mlp"),
        mesh=MESH,
        rules=EMBED_MLP_RULES + (("layers", None),),
        dtype=jnp.bfloat16,
        note="x",
    )
    s = meshinit.stacked(4, layer)
    assert s.shape == (4, 64, 32) and s.axes == ("layers", "embed", "mlp")
    assert (s.mesh, s.rules, s.dtype, dict(s.metadata)) == (
        MESH,
        layer.rules,
        jnp.bfloat16,
        {"note": "x"},
    )
    assert meshinit.stacked(2, meshinit.param((3,), zeros, mesh=MESH)).axes == ("layers", None)
    assert meshinit.stacked(2, meshinit.param((3,), zeros, mesh=MESH), axis=None).axes is None
    with pytest.raises(TypeError, match="takes a ParamSpec"):
        meshinit.stacked(2, (3,))


def test_stacked_slices_follow_the_value_formula_with_per_layer_fan_in():
    mesh = jax.make_mesh((2, 4), ("layers", "tensor"))
    d = 256
    layer = meshinit.param(
        (d, d), jax.nn.initializers.lecun_normal(), axes=(None, "tensor"), mesh=mesh
    )
    w = meshinit.init({"w": meshinit.stacked(8, layer)}, 0)["w"]
    assert w.shape == (8, d, d)
    assert w.sharding.spec == jax.sharding.PartitionSpec("layers", None, "tensor")
    key = meshinit.param_key(0, "w")
    host = np.asarray(w)
    # each layer is jax.jit's value of the layer's initializer on the layer's block of
    # the planned sharding, bit for bit
    block = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor"))
    for i in (0, 5):
        make = jax.jit(lambda k: layer.init(k, (d, d), jnp.float32), out_shardings=block)
        same_bits(host[i], make(jax.random.fold_in(key, i)), f"w[{i}]")
    # lecun_normal's std is 1/sqrt(fan_in) = 1/16 per layer; on the raw (8, d, d) shape it
    # would count the 8 layers into the fan and give 1/sqrt(8 * 256) = 0.022.
    assert abs(float(np.std(host)) - 1 / 16) < 0.002
    flat = meshinit.init(
        {"w": meshinit.param((8, d, d), jax.nn.initializers.lecun_normal(), mesh=mesh)}, 0
    )["w"]
    assert abs(float(np.std(np.asarray(flat))) - 1 / np.sqrt(8 * d)) < 0.002


def test_a_param_can_mark_its_own_replication_and_stacking_keeps_it():
    mesh = AbstractMesh((2, 4), ("data", "fsdp"))
    spec = meshinit.param(
        (16, 8), jax.nn.initializers.zeros, axes=("fsdp", None), mesh=mesh, replicated=["data"]
    )
    assert spec.replicated == ("data",)
    stacked = meshinit.stacked(4, spec, axis=None)
    assert stacked.replicated == ("data",)
    assert meshinit.plan({"s": stacked}).entries[0].shardable_axes == ()
