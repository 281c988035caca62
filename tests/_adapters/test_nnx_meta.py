"""Edges of the nnx and equinox adapters: numpy values in Variables, typed
PRNG keys in plans, and ``existing=`` given as a Module or as keys of another shape or
implementation.

Where flax has an answer, meshinit's is compared with it: values bit for bit, and
shardings with ``==``, against eager flax and ``nnx.jit``.
"""

import contextlib
import re
import warnings

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import mesh8
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
import meshinit.eqx
import meshinit.nnx

FSDP_TP = ("fsdp", "tp")


def default_device_mesh():
    """A mesh with no axes over the default device: where nnx.init puts a Variable
    without sharding when no mesh is given."""
    return jax.sharding.Mesh(np.array(jax.devices()[0]), ())


def flat(module) -> dict:
    """``path -> value`` of every Variable of ``module``."""
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}


def bits(x) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


# ---------------------------------------------------------- numpy values

NUMPY = {
    "float32": lambda: np.arange(64, dtype=np.float32).reshape(8, 8) / 7,
    "float64": lambda: np.arange(64, dtype=np.float64).reshape(8, 8) / 7,  # jax's f32
    "int64": lambda: np.arange(64, dtype=np.int64).reshape(8, 8) - 30,  # jax's int32
    "bfloat16": lambda: (np.arange(64, dtype=np.float32).reshape(8, 8) / 7).astype(
        ml_dtypes.bfloat16
    ),
    "bool": lambda: np.arange(64).reshape(8, 8) % 3 == 0,
}


class NumpyParam(nnx.Module):
    def __init__(self, value, rngs, **sharding):
        self.w = nnx.Param(value, **sharding)  # a numpy value, as a pretrained weight
        self.v = nnx.Param(jax.random.normal(rngs.params(), (8, 8)), out_sharding=(None, "tp"))


# Every dtype on an Explicit mesh and float32 on its Auto twin in the fast tier: the
# dtype is converted (float64 to jax's float32, int64 to int32) before the placement,
# which alone differs between the kinds of axes; MESHINIT_TESTS=all runs the product.
@pytest.mark.parametrize(
    "dtype, explicit",
    [
        pytest.param(
            dtype,
            explicit,
            id=f"{dtype}-{'explicit' if explicit else 'auto'}",
            marks=() if explicit or dtype == "float32" else (pytest.mark.slow,),
        )
        for explicit in (True, False)
        for dtype in NUMPY
    ],
)
def test_a_numpy_param_is_placed_as_eager_flax_and_nnx_jit_place_it(dtype, explicit):
    mesh = mesh8(FSDP_TP, explicit)

    def factory():
        return NumpyParam(NUMPY[dtype](), nnx.Rngs(0), out_sharding=("fsdp", None))

    with jax.set_mesh(mesh):
        eager = factory().w.get_value()
        jitted = nnx.jit(factory)().w.get_value()
        plan = meshinit.nnx.plan(factory)
        abstract = meshinit.nnx.abstract(factory).w.get_value()
        got = meshinit.nnx.init(factory).w.get_value()
    assert isinstance(got, jax.Array), f"left as {type(got).__name__}, flax places it"
    for want, who in [(eager, "eager flax"), (jitted, "nnx.jit")]:
        assert (got.dtype, got.shape) == (want.dtype, want.shape), who
        assert bits(got) == bits(want), f"values differ from {who}'s"
    assert got.sharding == eager.sharding == NamedSharding(mesh, P("fsdp", None))
    if explicit:
        assert got.sharding == jitted.sharding
    else:  # nnx.jit spells an Auto mesh's output P('fsdp',): the same placement
        assert got.sharding.is_equivalent_to(jitted.sharding, 2)
    entry = {e.path: e for e in plan.entries}["w"]
    assert entry.sharding == got.sharding and entry.spec.dtype == got.dtype
    assert abstract.sharding == got.sharding and abstract.dtype == got.dtype


def test_a_placement_places_a_numpy_param_and_is_not_called_idle():
    mesh = mesh8(FSDP_TP, explicit=True)
    value = NUMPY["float64"]()

    def annotated():
        return NumpyParam(value, nnx.Rngs(0), out_sharding=("fsdp", None))

    def bare():  # no sharding: flax leaves the numpy value as it is
        return NumpyParam(value, nnx.Rngs(0))

    table = [(r"w", P(None, "tp")), (r"v", None)]
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error", meshinit.UnusedPatternWarning)
        placed = {f.__name__: meshinit.nnx.init(f, placements=table) for f in (annotated, bare)}
        plans = {f.__name__: meshinit.nnx.plan(f, placements=table) for f in (annotated, bare)}
        eager = nnx.Param(value, out_sharding=(None, "tp")).get_value()
    for name, model in placed.items():
        got = model.w.get_value()
        assert got.sharding == eager.sharding == NamedSharding(mesh, P(None, "tp")), name
        assert bits(got) == bits(eager), name
        assert {e.path: e.sharding for e in plans[name].entries}["w"] == got.sharding, name


def test_numpy_that_flax_leaves_as_it_is_stays_numpy_and_out_of_the_plan():
    value = NUMPY["float64"]()

    class Held(nnx.Module):
        def __init__(self):
            self.bare = nnx.Param(value)  # eager: numpy float64; nnx.jit: a jax f32 array
            self.empty = nnx.Param(value, out_sharding=())  # flax skips an empty sharding
            self.scalar = nnx.Variable(np.float32(2.5), out_sharding=())
            self.w = nnx.Param(value, out_sharding=("fsdp", None))

    with jax.set_mesh(mesh8(FSDP_TP, explicit=True)):
        eager = Held()
        model = meshinit.nnx.init(Held)
        plan = meshinit.nnx.plan(Held)
    for name in ("bare", "empty", "scalar"):
        want, got = getattr(eager, name).get_value(), getattr(model, name).get_value()
        assert type(got) is type(want) and got.dtype == want.dtype, name
        assert bits(got) == bits(want), name
    assert [e.path for e in plan.entries] == ["w"]
    assert isinstance(model.w.get_value(), jax.Array)


def test_a_numpy_scalar_a_placement_names_is_placed_replicated():
    class Scalars(nnx.Module):
        def __init__(self):
            self.s = nnx.Variable(np.float32(2.5))
            self.z = nnx.Variable(np.array(3, np.int64))

    mesh = mesh8(FSDP_TP, explicit=True)
    with jax.set_mesh(mesh):
        model = meshinit.nnx.init(Scalars, placements=[(r".*", None)])
        jitted = nnx.jit(Scalars)()
    for name in ("s", "z"):
        got, want = getattr(model, name).get_value(), getattr(jitted, name).get_value()
        assert (got.dtype, got.shape, bits(got)) == (want.dtype, want.shape, bits(want)), name
        assert got.sharding == want.sharding == NamedSharding(mesh, P()), name


def test_numpy_jax_cannot_hold_is_a_plan_error_where_it_would_be_placed():
    big_endian = np.arange(64, dtype=">f4").reshape(8, 8)

    class BigEndian(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(big_endian, out_sharding=("fsdp", None))
            self.kept = nnx.Param(big_endian)  # flax leaves it; so does meshinit

    with jax.set_mesh(mesh8(FSDP_TP, explicit=True)):
        with pytest.raises(TypeError, match="not a valid JAX array type"):
            BigEndian()  # flax refuses it too
        with pytest.raises(meshinit.PlanError) as e:
            meshinit.nnx.init(BigEndian)
        assert [p.path for p in e.value.problems] == ["w"]
        assert ">f4" in str(e.value) and "newbyteorder" in str(e.value)
        with pytest.raises(meshinit.PlanError, match=r'kept: .*placements\[0\] r"kept"'):
            meshinit.nnx.plan(BigEndian, placements=[(r"kept", None), (r"w", None)])


def test_a_numpy_param_takes_an_existing_value():
    mesh = mesh8(FSDP_TP, explicit=True)
    given = jax.device_put(np.full((8, 8), 3.0, np.float32), NamedSharding(mesh, P()))

    def factory():
        return NumpyParam(NUMPY["float32"](), nnx.Rngs(0), out_sharding=("fsdp", None))

    with jax.set_mesh(mesh):
        got = meshinit.nnx.init(factory, existing={"w": given}).w.get_value()
    assert bits(got) == bits(given) and got.sharding == NamedSharding(mesh, P("fsdp", None))


# ------------------------------------------------------- typed keys in plans


class Scanned(nnx.Module):
    """Layers made under ``nnx.vmap``, each holding its own RNG streams: their keys are
    key arrays of shape (4,), as in MaxText's scanned decoder (``rngs.aqt.key``)."""

    def __init__(self, rngs):
        keys = jax.random.split(rngs.aqt(), 4)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(key):
            return Layer(nnx.Rngs(aqt=key, params=0))

        self.layers = make(keys)
        self.rngs = rngs  # and a scalar key


class Layer(nnx.Module):
    def __init__(self, rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tp"))
        self.lin = nnx.Linear(8, 16, kernel_init=kernel, rngs=rngs)
        self.rngs = rngs


def scanned():
    return Scanned(nnx.Rngs(0, aqt=1))


KEYS = ["layers.rngs.aqt.key", "layers.rngs.params.key", "rngs.aqt.key", "rngs.default.key"]


def assert_plan_is_what_init_makes(plan, abstract, model):
    got, structs = flat(model), flat(abstract)
    assert sorted(e.path for e in plan.entries) == sorted(got)
    for e in plan.entries:
        array, struct = got[e.path], structs[e.path]
        assert (e.spec.shape, e.spec.dtype) == (array.shape, array.dtype), e.path
        assert (struct.shape, struct.dtype) == (array.shape, array.dtype), e.path
        assert e.sharding == array.sharding, f"{e.path}: planned {e.sharding}, made {array}"
        assert struct.sharding == array.sharding, e.path


@pytest.mark.parametrize(
    "where",
    ["explicit", "auto", "no mesh", "one device"],
)
def test_plans_show_typed_keys_as_init_makes_them(where):
    meshes = {
        "explicit": mesh8(FSDP_TP, explicit=True),
        "auto": mesh8(FSDP_TP, explicit=False),
        "no mesh": None,
        "one device": jax.make_mesh((1, 1), ("fsdp", "tp")),
    }
    mesh = meshes[where]
    # without a mesh: the kernels replicated on the default device, named as the mesh
    # (a placement that replicates without any mesh is refused)
    table = [(r".*kernel", None, default_device_mesh())] if mesh is None else None
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        plan = meshinit.nnx.plan(scanned, placements=table)
        abstract = meshinit.nnx.abstract(scanned, placements=table)
        model = meshinit.nnx.init(scanned, placements=table)
    with nnx.use_eager_sharding(False):  # eager flax needs a mesh for its sharding
        eager = scanned()
    assert_plan_is_what_init_makes(plan, abstract, model)
    entries = {e.path: e for e in plan.entries}
    for path in KEYS:
        key = flat(eager)[path]
        assert entries[path].spec.shape == key.shape and entries[path].spec.dtype == key.dtype
        assert bits(flat(model)[path]) == bits(key), f"{path}: not eager's key"
    assert entries["layers.rngs.aqt.key"].spec.shape == (4,)
    if mesh is not None and mesh.size > 1:
        assert entries["layers.rngs.aqt.key"].sharding.spec == P(None)  # the key's rank
        assert entries["rngs.default.key"].sharding.spec == P()


def test_a_placement_may_shard_a_key_array_along_its_own_dimensions():
    mesh = mesh8(FSDP_TP, explicit=True)
    table = [(r"layers\.rngs\..*\.key", P("fsdp")), (r".*", None)]
    with jax.set_mesh(mesh):
        plan = meshinit.nnx.plan(scanned, placements=table)
        abstract = meshinit.nnx.abstract(scanned, placements=table)
        model = meshinit.nnx.init(scanned, placements=table)
        eager = scanned()
    assert_plan_is_what_init_makes(plan, abstract, model)
    key = model.layers.rngs.aqt.key.get_value()
    assert key.sharding == NamedSharding(mesh, P("fsdp"))
    assert model.layers.rngs.aqt.key.out_sharding == ("fsdp",)  # what was placed
    assert bits(key) == bits(eager.layers.rngs.aqt.key.get_value())


class HeldKey(nnx.Module):
    def __init__(self, rngs, **sharding):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))
        self.rngs = rngs
        self.key = nnx.Variable(jax.random.key(3), **sharding)


@pytest.mark.parametrize(
    "how",
    ["placement", "metadata"],
)
def test_a_sharding_longer_than_a_keys_rank_is_one_plan_error_naming_the_path(how, count_compiles):
    if how == "placement":
        path, kwargs = "rngs.default.key", {"placements": [(r"rngs\.default\.key", P("fsdp"))]}
        factory = lambda: HeldKey(nnx.Rngs(0))  # noqa: E731
    else:
        path, kwargs = "key", {}
        factory = lambda: HeldKey(nnx.Rngs(0), out_sharding=("fsdp",))  # noqa: E731
    with jax.set_mesh(mesh8(FSDP_TP, explicit=True)), count_compiles() as compiled:
        for call in (meshinit.nnx.plan, meshinit.nnx.abstract, meshinit.nnx.init):
            with pytest.raises(meshinit.PlanError) as e:
                call(factory, **kwargs)
            assert [p.path for p in e.value.problems] == [path], call.__name__
            message = str(e.value)
            assert "P('fsdp',), 1 entry, for a typed PRNG key array key<fry>[] of rank 0" in (
                message
            )
            assert "trailing dimension" in message
    assert compiled.count == 0


# ------------------------------------------------------------ existing=


def test_an_abstract_eqx_module_given_as_existing_is_a_plan_error_naming_each_path():
    mesh = mesh8(FSDP_TP, explicit=True)

    def factory(k):
        return eqx.nn.MLP(4, 4, 8, 1, key=k)

    table = [(r".*", None)]
    target = eqx.filter_eval_shape(factory, jax.random.key(0))
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.eqx.init(factory, 0, table, mesh=mesh, existing=target)
    paths = ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
    assert sorted(p.path for p in e.value.problems) == paths
    assert all("restore target" in p.message for p in e.value.problems)
    # the nnx adapter says the same of an abstract Module
    with jax.set_mesh(mesh), pytest.raises(meshinit.PlanError) as n:
        meshinit.nnx.init(scanned, existing=meshinit.nnx.abstract(scanned))
    assert all("restore target" in p.message for p in n.value.problems)
    assert "layers.lin.kernel" in {p.path for p in n.value.problems}


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            lambda: jax.random.split(jax.random.key(0), 2),
            "existing key array has shape (2,), planned () (key<fry>)",
        ),
        (
            lambda: jax.random.key(0, impl="rbg"),
            "existing key's implementation is rbg (key<rbg>), planned threefry2x32 "
            "(key<fry>): the implementations differ",
        ),
        (
            lambda: jax.random.key_data(jax.random.key(0, impl="rbg")),
            "existing key data has shape (4,), planned (2,): the data of a threefry2x32 key "
            "array of shape () (key<fry>)",
        ),
    ],
    ids=["split key", "rbg key", "rbg key data"],
)
def test_a_key_of_another_shape_or_implementation_is_named_as_a_key(given, message):
    with jax.set_mesh(mesh8(FSDP_TP, explicit=True)), pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.init(
            lambda: HeldKey(nnx.Rngs(0)), existing={"rngs.default.key": given(), "w": 1.0}
        )
    problems = {p.path: p.message for p in e.value.problems}
    assert sorted(problems) == ["rngs.default.key", "w"]  # with the others, at once
    assert message in problems["rngs.default.key"]


def test_a_key_array_given_as_existing_is_placed_as_a_key():
    mesh = mesh8(FSDP_TP, explicit=True)
    given = jax.random.split(jax.random.key(5), 4)
    with jax.set_mesh(mesh):
        model = meshinit.nnx.init(scanned, existing={"layers.rngs.aqt.key": given})
        plan = meshinit.nnx.plan(scanned)
    got = model.layers.rngs.aqt.key.get_value()
    assert got.dtype == given.dtype and bits(got) == bits(given)
    assert got.sharding == {e.path: e for e in plan.entries}["layers.rngs.aqt.key"].sharding
    assert re.fullmatch(r"key<fry>", str(got.dtype))


# ---------------------------------------------------------- no mesh anywhere


class Sharded(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tp"))
        self.up = nnx.Linear(8, 16, kernel_init=init, use_bias=False, rngs=rngs)


@pytest.mark.parametrize("call", ["plan", "init"])
def test_no_mesh_names_mesh_on_the_function_called_first(call):
    fn = getattr(meshinit.nnx, call)
    with pytest.raises(
        meshinit.PlanError,
        match=rf"up\.kernel: has sharding metadata but no mesh: pass mesh= to "
        rf"meshinit\.nnx\.{call} \(or to the Variable\), build it under jax\.set_mesh",
    ):
        fn(lambda: Sharded(nnx.Rngs(0)))
