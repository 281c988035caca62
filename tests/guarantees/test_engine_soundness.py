"""The constructor engine's fingerprints cover everything that changes a value or a
placement: literal operands, the configuration that changes bits, memory kinds; typed
keys keep their type; keys made outside the factory are host values; remat is cut.

Each test here failed on the engine before it was made sound (jax 0.10.2 or 0.12)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import mesh8, same_bits
from jax.sharding import Mesh

import meshinit


@pytest.fixture
def fallbacks(recwarn):
    """The warnings about variables built by the whole-constructor fallback."""
    return lambda: [str(w.message) for w in recwarn if w.category is meshinit.FallbackWarning]


# ------------------------------------------------- literals of shared jitted helpers


@jax.jit
def _scaled(key, fan_in):
    return jax.random.normal(key, (16, 16)) * jnp.sqrt(2.0 / fan_in)


def test_a_shared_jitted_helper_gets_each_callers_own_scalars_nnx():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.mask_hi = nnx.Param(jax.random.bernoulli(rngs.params(), 0.9, (64, 64)))
            self.mask_lo = nnx.Param(jax.random.bernoulli(rngs.params(), 0.1, (64, 64)))
            self.a = nnx.Param(_scaled(rngs.params(), 2.0))
            self.b = nnx.Param(_scaled(rngs.params(), np.float32(200.0)))

    got = meshinit.nnx.init(lambda: M(nnx.Rngs(0)))
    want = M(nnx.Rngs(0))
    for name in ("mask_hi", "mask_lo", "a", "b"):
        same_bits(getattr(got, name)[...], getattr(want, name)[...], name)
    assert float(got.mask_lo[...].mean()) < 0.2  # the second call's p, not the first's


def test_a_shared_jitted_helper_gets_each_callers_own_scalars_linen_and_eqx():
    class L(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = self.param("a", lambda k: _scaled(k, 2.0))
            b = self.param("b", lambda k: _scaled(k, 200.0))
            return x + a + b

    x = jnp.zeros((16, 16))
    got = meshinit.linen.init(L(), jax.random.key(0), x, default="replicated")
    want = L().init(jax.random.key(0), x)
    for name in ("a", "b"):
        same_bits(got["params"][name], want["params"][name], f"linen {name}")

    def factory(key):
        k1, k2 = jax.random.split(key)
        return {"a": _scaled(k1, 2.0), "b": _scaled(k2, 200.0)}

    got = meshinit.eqx.init(factory, 0, [(r".*", None)], mesh=mesh8(("a", "b")))
    want = factory(jax.random.key(0))
    for name in ("a", "b"):
        same_bits(got[name], want[name], f"eqx {name}")


# ---------------------------------------------------------- configuration flags


def test_flipping_threefry_partitionable_between_inits_gives_the_new_settings_bits():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))
            self.keys = nnx.Param(jax.random.key_data(jax.random.split(rngs.params(), 4)))

    old = jax.config.jax_threefry_partitionable
    meshinit.nnx.init(lambda: M(nnx.Rngs(0)))  # fills every cache with `old`'s programs
    jax.config.update("jax_threefry_partitionable", not old)
    try:
        got = meshinit.nnx.init(lambda: M(nnx.Rngs(0)))
        want = M(nnx.Rngs(0))
        same_bits(got.w[...], want.w[...], "w")
        same_bits(got.keys[...], want.keys[...], "keys")
    finally:
        jax.config.update("jax_threefry_partitionable", old)


# ------------------------------------------------------------------ memory kinds


def _host_kind():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        pytest.skip("this backend has no pinned_host memory")
    return "pinned_host"


def test_identical_variables_in_different_memories_land_where_each_asks():
    kind = _host_kind()
    mesh = mesh8(("a", "b"))

    class M(nnx.Module):
        def __init__(self, rngs, offload):
            extra = {"memory_kind": kind} if offload else {}
            self.on_host = nnx.Param(
                jax.random.normal(rngs.params(), (8, 8)),
                out_sharding=("a", None),
                mesh=mesh,
                **{"memory_kind": kind},
            )
            self.w = nnx.Param(
                jax.random.normal(rngs.params(), (8, 8)),
                out_sharding=("a", None),
                mesh=mesh,
                **extra,
            )

    mixed = meshinit.nnx.init(lambda: M(nnx.Rngs(0), offload=False))
    assert mixed.on_host[...].sharding.memory_kind == kind
    assert mixed.w[...].sharding.memory_kind == "device"
    # and after an identical offloaded model, a device model stays in device memory
    offloaded = meshinit.nnx.init(lambda: M(nnx.Rngs(0), offload=True))
    assert offloaded.w[...].sharding.memory_kind == kind
    again = meshinit.nnx.init(lambda: M(nnx.Rngs(0), offload=False))
    assert again.w[...].sharding.memory_kind == "device"


def test_eqx_placements_in_different_memories_land_where_each_asks():
    kind = _host_kind()
    mesh = mesh8(("a", "b"))

    def factory(key):
        k1, k2 = jax.random.split(key)
        return {"a": jax.random.normal(k1, (8, 8)), "b": jax.random.normal(k2, (8, 8))}

    row = ("a", None)
    got = meshinit.eqx.init(factory, 0, [(r"a", row, mesh, kind), (r"b", row)], mesh=mesh)
    assert got["a"].sharding.memory_kind == kind
    assert got["b"].sharding.memory_kind == "device"
    got = meshinit.eqx.init(factory, 0, [(r"a", row), (r"b", row, mesh, kind)], mesh=mesh)
    assert got["a"].sharding.memory_kind == "device"
    assert got["b"].sharding.memory_kind == kind


# -------------------------------------------------------------------- typed keys


def test_nnx_rngs_keys_come_back_as_typed_keys_of_eager_shape():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.rngs = rngs
            self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))

    got = meshinit.nnx.init(lambda: M(nnx.Rngs(0, dropout=1)))
    want = M(nnx.Rngs(0, dropout=1))
    g_state = jax.tree.map(lambda x: (x.dtype, x.shape), nnx.state(got, nnx.RngKey))
    w_state = jax.tree.map(lambda x: (x.dtype, x.shape), nnx.state(want, nnx.RngKey))
    assert g_state == w_state
    key = got.rngs.params.key[...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
    same_bits(jax.random.key_data(key), jax.random.key_data(want.rngs.params.key[...]), "key")
    assert jax.random.split(key, 3).shape == (3,)  # a key, not its (2,) data
    # the model goes on drawing exactly as eager does
    draw = jax.random.key_data
    same_bits(draw(got.rngs.dropout()), draw(want.rngs.dropout()), "the next draw")


# -------------------------------------------------------- keys made outside the factory


@pytest.mark.parametrize("make", ["key", "fold_in"])
def test_a_typed_key_made_outside_the_factory_is_a_host_value(make, fallbacks):
    outer = jax.random.key(7) if make == "key" else jax.random.fold_in(jax.random.key(7), 3)

    class M(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))

    got = meshinit.nnx.init(lambda: M(nnx.Rngs(params=outer)))
    same_bits(got.w[...], M(nnx.Rngs(params=outer)).w[...], "w")

    def factory(key):
        return {"w": jax.random.normal(jax.random.fold_in(outer, 1), (8, 8))}

    got = meshinit.eqx.init(factory, 0, [(r"w", ("a", None))], mesh=mesh8(("a", "b")))
    same_bits(got["w"], factory(None)["w"], "eqx w")
    assert fallbacks() == []


# ------------------------------------------------------------------ remat is cut


@pytest.mark.parametrize(
    "how",  # jax.remat is documented as jax.checkpoint's alias: the fast tier runs one
    ["jax.checkpoint", pytest.param("jax.remat", marks=pytest.mark.slow), "nnx.remat"],
)
def test_remat_and_checkpoint_are_cut_not_fallen_back(how, fallbacks, count_compiles):
    def stack(n):
        class Layer(nnx.Module):
            def __init__(self, rngs):
                self.w = nnx.Param(
                    jax.random.normal(rngs.params(), (16, 16)),
                    out_sharding=("a", "b"),
                    mesh=mesh8(("a", "b")),
                )

        def make(rngs):
            if how == "nnx.remat":
                return nnx.remat(lambda r: Layer(r))(rngs)
            wrap = jax.checkpoint if how == "jax.checkpoint" else jax.remat
            return wrap(lambda k: Layer(nnx.Rngs(k)))(rngs.params())

        class Stack(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List([make(rngs) for _ in range(n)])

        return lambda: Stack(nnx.Rngs(0))

    if how == "nnx.remat":
        try:
            stack(1)()
        except Exception as e:  # noqa: BLE001 - flax refuses building Modules in remat
            pytest.skip(f"flax cannot construct a Module inside nnx.remat here: {e}")
    meshinit.clear_cache()
    with count_compiles() as two:
        meshinit.nnx.init(stack(2))
    with count_compiles() as eight:
        got = meshinit.nnx.init(stack(8))
    assert fallbacks() == []
    assert eight.count == 0, "a deeper remat stack compiled anew: its layers were not cut"
    want = nnx.jit(stack(8))()  # the framework's jitted init: its bits
    for i in range(8):
        same_bits(got.layers[i].w[...], want.layers[i].w[...], f"layers.{i}.w")
    assert two.count >= 1


def test_linen_remat_layers_compile_the_same_at_4_and_32_layers(fallbacks, count_compiles):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(
                32, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("a", "b"))
            )(x)
            return nn.LayerNorm()(x)

    class Decoder(nn.Module):
        layers: int

        @nn.compact
        def __call__(self, x):
            for i in range(self.layers):
                x = nn.remat(Block)(name=f"layers_{i}")(x)
            return x

    x = jax.ShapeDtypeStruct((2, 32), jnp.float32)

    def cold(n):
        meshinit.clear_cache()
        with count_compiles() as c:
            jax.block_until_ready(
                jax.tree.leaves(
                    meshinit.linen.init(
                        Decoder(n), 0, x, mesh=mesh8(("a", "b")), default="replicated"
                    )
                )
            )
        return c.count

    assert cold(4) == cold(32)
    assert fallbacks() == []


# ------------------------------------------------------------------------ errors


def test_a_factory_that_needs_a_concrete_value_gets_a_clear_error():
    class M(nnx.Module):
        def __init__(self, rngs):
            w = jax.random.normal(rngs.params(), (8, 8))
            self.w = nnx.Param(w / float(w.std()))

    with pytest.raises(TypeError, match=r"traces the constructor once, abstractly.*w / w\.std"):
        meshinit.nnx.init(lambda: M(nnx.Rngs(0)))


def test_an_integer_literal_variable_warns_nothing_and_keeps_its_dtype():
    class M(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(jnp.asarray(3))
            self.flag = nnx.Variable(jnp.asarray(True))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = meshinit.nnx.init(M)
    want = M()
    same_bits(got.count[...], want.count[...], "count")
    same_bits(got.flag[...], want.flag[...], "flag")


# ------------------------------------------------- loop bodies staged onto another mesh


def test_a_scanned_variable_staged_onto_a_smaller_disjoint_mesh_is_built_there(fallbacks):
    """A loop body records the mesh it was traced under (the context mesh) in every
    aval and in its sharding constraints; lowered for a stage mesh of another size it
    failed with "use_abstract_mesh cannot change the size of the mesh"."""
    devices = np.array(jax.devices())
    stage = Mesh(devices[4:].reshape(2, 2), ("a", "b"))

    def body(carry, key):
        w = jax.random.normal(key, (4, 8)) * jnp.float32(0.5) + 1.0
        w = jax.lax.with_sharding_constraint(w, jax.sharding.PartitionSpec("a"))
        return carry + 1, w

    class M(nnx.Module):
        def __init__(self, rngs):
            _, w = jax.lax.scan(body, 0, jax.random.split(rngs.params(), 3))
            self.staged = nnx.Param(w, out_sharding=(None, "a", "b"))
            _, u = jax.lax.scan(body, 0, jax.random.split(rngs.params(), 3))
            self.kept = nnx.Param(u, out_sharding=(None, "a", "b"))

    with jax.set_mesh(mesh8(("a", "b"))):
        got = meshinit.nnx.init(lambda: M(nnx.Rngs(0)), meshes=[("staged", stage)])
        with nnx.use_eager_sharding(False):
            want = M(nnx.Rngs(0))
    assert got.staged[...].sharding.mesh == stage
    assert got.kept[...].sharding.mesh == mesh8(("a", "b"))
    assert got.staged[...].sharding.spec == got.kept[...].sharding.spec
    for name in ("staged", "kept"):
        same_bits(getattr(got, name)[...], getattr(want, name)[...], name)
    assert fallbacks() == []


def test_a_constraint_made_with_no_context_mesh_fingerprints(fallbacks):
    """A linen box with its own mesh constrains its value as it is unboxed; with no
    context mesh, jax records an empty Mesh (one None for a device) beside it, which
    the fingerprint failed on ("'NoneType' object has no attribute 'id'")."""
    devices = np.array(jax.devices())
    stage = Mesh(devices[4:].reshape(2, 2), ("a", "b"))
    boxed = nn.with_partitioning(nn.initializers.normal(), (None, "b"), mesh=mesh8(("a", "b")))

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", boxed, (8, 8))
            self.param("tied", lambda key, shape: w * 1.37, (8, 8))
            return x

    x = jnp.ones((1,))
    got = meshinit.linen.init(
        M(), 0, x, mesh=mesh8(("a", "b")), default="replicated", meshes=[(r"params\.w", stage)]
    )
    assert got["params"]["w"].value.sharding.mesh == stage

    # the framework's jitted init with meshinit's placement, one mesh per jit (one jit
    # cannot output to two meshes; w's box would constrain it to its own mesh): its bits
    def value(box):
        return box.value if isinstance(box, nn.Partitioned) else box

    for name, made in (("w", got["params"]["w"].value), ("tied", got["params"]["tied"])):
        init = jax.jit(
            lambda k, x, name=name: value(M().init(k, x)["params"][name]),
            out_shardings=made.sharding,
        )
        same_bits(made, init(jax.random.key(0), x), name)
    assert fallbacks() == []
