"""``existing=`` on ``meshinit.nnx.init``, ``meshinit.linen.init`` and
``meshinit.eqx.init``: the given variables are placed, not made; every other one gets
exactly the value a full init gives."""

import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import mesh8, same_bits
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit


def _mesh(ids, shape):
    return Mesh(np.array([jax.devices()[i] for i in ids]).reshape(shape), ("a", "b"))


AB = ("a", "b")

# ----------------------------------------------------------------------------- nnx


class Block(nnx.Module):
    def __init__(self, rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b"))
        self.up = nnx.Linear(16, 32, kernel_init=kernel, rngs=rngs)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Block(rngs) for _ in range(4)])
        head = nnx.with_partitioning(nnx.initializers.normal(0.02), ("b", None))
        self.head = nnx.Linear(32, 8, kernel_init=head, use_bias=False, rngs=rngs)
        self.rngs = rngs


def factory():
    return Model(nnx.Rngs(0))


def _flat(module):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}


def _values_of(tree):
    return {p: np.asarray(jax.random.key_data(v) if _is_key(v) else v) for p, v in tree.items()}


def _is_key(x):
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def test_nnx_existing_places_the_given_and_makes_the_rest_as_a_full_init(count_compiles):
    with jax.set_mesh(mesh8(AB)):
        full = _flat(meshinit.nnx.init(factory))
        base = {p: v for p, v in full.items() if not p.startswith("head.")}
        meshinit.clear_cache()
        with count_compiles() as partial_compiles:
            got = _flat(meshinit.nnx.init(factory, existing=base))
        meshinit.clear_cache()
        with count_compiles() as full_compiles:
            meshinit.nnx.init(factory)
    assert got.keys() == full.keys()
    for path, value in got.items():
        assert value.sharding == full[path].sharding, path
        if path in base and not _is_key(value):
            assert value is base[path], path  # already there: used as it is
    for path, value in _values_of(got).items():
        same_bits(value, _values_of(full)[path], path)
    assert partial_compiles.count < full_compiles.count  # nothing made for the base


def test_nnx_existing_evaluates_on_the_host_only_what_the_rest_reads(monkeypatch):
    # The given variables' keys, counters and small values are never computed: the
    # host part of a partial init is the part the variables it makes depend on.
    from meshinit._engine import trace as _trace

    evaluated = []
    evaluate = _trace.evaluate_host_part

    def recording(t, outs):
        evaluated.append(evaluate(t, outs))
        return evaluated[-1]

    monkeypatch.setattr(_trace, "evaluate_host_part", recording)
    with jax.set_mesh(mesh8(AB)):
        full = _flat(meshinit.nnx.init(factory))
        base = {p: v for p, v in full.items() if not p.startswith("head.")}
        got = _flat(meshinit.nnx.init(factory, existing=base))
    whole, part = evaluated
    assert 0 < len(part.host) < len(whole.host) / 2, (len(part.host), len(whole.host))
    for n, v in part.host.items():  # what it did compute is what the whole gives
        same_bits(getattr(v, "data", v), getattr(whole.host[n], "data", whole.host[n]), n)
    same_bits(got["head.kernel"], full["head.kernel"], "head.kernel")


@pytest.mark.parametrize("how", ["numpy", "other mesh", "nested", "state"])
def test_nnx_existing_takes_numpy_other_meshes_and_nested_trees(how):
    with jax.set_mesh(mesh8(AB)):
        model = meshinit.nnx.init(factory)
    full = _flat(model)
    if how == "numpy":
        existing = {"layers.2.up.kernel": np.asarray(full["layers.2.up.kernel"])}
    elif how == "other mesh":
        other = NamedSharding(_mesh(range(4, 8), (2, 2)), P("b", "a"))
        existing = {"layers.2.up.kernel": jax.device_put(full["layers.2.up.kernel"], other)}
    elif how == "nested":
        existing = {"layers": {2: {"up": {"kernel": full["layers.2.up.kernel"]}}}}
    else:
        existing = nnx.state(model)  # every Variable, keys included, as a State
    with jax.set_mesh(mesh8(AB)):
        got = _flat(meshinit.nnx.init(factory, existing=existing))
    kernel = got["layers.2.up.kernel"]
    assert kernel.sharding == full["layers.2.up.kernel"].sharding
    same_bits(kernel, full["layers.2.up.kernel"], how)
    assert _is_key(got["rngs.default.key"])


def test_nnx_existing_problems_are_one_plan_error_naming_each_before_allocating():
    with jax.set_mesh(mesh8(AB)):
        full = _flat(meshinit.nnx.init(factory))
        bad = {
            "layers.1.up.kernal": full["layers.1.up.kernel"],  # a typo
            "layers.0.up.kernel": jnp.zeros((16, 16)),  # wrong shape
            "layers.0.up.bias": jnp.zeros((32,), jnp.bfloat16),  # wrong dtype
        }
        before = {id(x) for x in jax.live_arrays()}
        with pytest.raises(meshinit.PlanError) as raised:
            meshinit.nnx.init(factory, existing=bad)
    message = str(raised.value)
    assert "layers.1.up.kernal" in message and "did you mean 'layers.1.up.kernel'" in message
    assert "layers.0.up.kernel" in message and "(16, 16)" in message and "(16, 32)" in message
    assert "layers.0.up.bias" in message and "bfloat16" in message
    new = [x for x in jax.live_arrays() if id(x) not in before and not x.is_deleted()]
    assert [x for x in new if x.shape in ((16, 32), (32, 8))] == []


# ----------------------------------------------------------------------------- linen


class Dense2(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = nn.with_partitioning(nn.initializers.lecun_normal(), ("a", "b"))
        x = nn.Dense(32, kernel_init=kernel, name="up")(x)
        head = nn.with_partitioning(nn.initializers.normal(0.02), ("b", None))
        return nn.Dense(8, kernel_init=head, use_bias=False, name="head")(x)


def _linen_flat(variables):
    flat = jax.tree_util.tree_flatten_with_path(
        variables, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
    )[0]
    out = {}
    for kp, v in flat:
        path = ".".join(str(getattr(k, "key", k)) for k in kp)
        out[path] = v.value if isinstance(v, nn.meta.AxisMetadata) else v
    return out


@pytest.mark.parametrize("boxed", [False, True], ids=["flat", "boxed variables"])
def test_linen_existing_places_the_given_and_makes_the_rest(boxed):
    x = jnp.ones((1, 16))
    kw = {"mesh": mesh8(AB), "default": "replicated"}
    variables = meshinit.linen.init(Dense2(), 0, x, **kw)
    full = _linen_flat(variables)
    if boxed:  # the variables dict itself, its head dropped
        existing = {"params": {"up": variables["params"]["up"]}}
    else:
        existing = {"params.up.kernel": np.asarray(full["params.up.kernel"])}
    got = _linen_flat(meshinit.linen.init(Dense2(), 0, x, existing=existing, **kw))
    assert got.keys() == full.keys()
    for path, value in got.items():
        assert value.sharding == full[path].sharding, path
        same_bits(value, full[path], path)
    with pytest.raises(meshinit.PlanError, match=r"params\.up\.kernel.*shape"):
        meshinit.linen.init(Dense2(), 0, x, existing={"params.up.kernel": np.zeros((2,))}, **kw)


# ----------------------------------------------------------------------------- equinox


def test_eqx_existing_places_the_given_and_makes_the_rest():
    def make(key):
        return eqx.nn.MLP(16, 8, 32, 2, key=key)

    placements = [(r"layers\.\d+\.weight", ("b", "a")), (r".*", None)]
    full = meshinit.eqx.init(make, 0, placements, mesh=mesh8(AB))
    flat = {
        ".".join(str(getattr(k, "idx", getattr(k, "name", k))) for k in kp): v
        for kp, v in jax.tree_util.tree_flatten_with_path(full)[0]
        if eqx.is_array(v)
    }
    elsewhere = NamedSharding(_mesh(range(4), (2, 2)), P(None, "a"))
    given = {
        "layers.0.weight": flat["layers.0.weight"],
        "layers.1.bias": flat["layers.1.bias"],
        "layers.1.weight": jax.device_put(flat["layers.1.weight"], elsewhere),  # resharded
        "layers.2.weight": np.asarray(flat["layers.2.weight"]),  # placed shard by shard
    }
    got = meshinit.eqx.init(make, 0, placements, mesh=mesh8(AB), existing=given)
    assert got.layers[0].weight is flat["layers.0.weight"]
    assert got.layers[1].weight.sharding == flat["layers.1.weight"].sharding
    arrays = [eqx.filter(t, eqx.is_array) for t in (got, full)]
    for a, b in zip(*map(jax.tree.leaves, arrays), strict=True):
        assert a.sharding == b.sharding
        same_bits(a, b, "eqx")
    with pytest.raises(meshinit.PlanError, match=r"layers\.9\.weight"):
        meshinit.eqx.init(make, 0, placements, mesh=mesh8(AB), existing={"layers.9.weight": 1})


def test_a_backbone_checkpoint_restores_into_abstract_and_init_makes_the_head(tmp_path):
    import orbax.checkpoint as ocp

    with jax.set_mesh(mesh8(AB)):
        model = meshinit.nnx.init(factory)
        backbone = nnx.state(model)
        del backbone["head"]
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "ckpt", backbone)
            checkpointer.wait_until_finished()
            graphdef, target = nnx.split(meshinit.nnx.abstract(factory))
            del target["head"]  # as docs/checkpoints.md shows
            restored = checkpointer.restore(tmp_path / "ckpt", target)
        got = _flat(meshinit.nnx.init(factory, existing=restored))
    want = _flat(model)
    for path, value in _values_of(got).items():
        assert got[path].sharding == want[path].sharding, path
        same_bits(value, _values_of(want)[path], path)


def test_an_array_on_another_mesh_is_placed_block_by_block_never_gathered(monkeypatch):
    from jax._src import array as jax_array  # where jax gathers a whole array to the host

    from meshinit._run.place import place

    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    source = jax.device_put(x, NamedSharding(_mesh(range(4), (2, 2)), P("b", "a")))
    target = NamedSharding(_mesh(range(8), (2, 4)), P("a", "b"))

    def gathered(self):
        raise AssertionError("the whole array was gathered on the host")

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(gathered))
    placed = place(source, target)
    assert placed.sharding == target
    for shard in placed.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), x[shard.index])


# ------------------------------------------ what every adapter refuses alike
# A typed PRNG key for a weight, a big-endian array, a path given twice, a restore
# target given for its values. Each adapter's weight is a float32 (in, out) kernel.

ADAPTERS = ["spec", "nnx", "linen", "eqx"]
WEIGHT = {"spec": "up.kernel", "nnx": "layers.0.up.kernel", "linen": "params.up.kernel"}
WEIGHT["eqx"] = "layers.0.weight"
SHAPE = {"spec": (16, 32), "nnx": (16, 32), "linen": (16, 32), "eqx": (32, 16)}
EQX_PLACEMENTS = [(r"layers\.\d+\.weight", ("b", "a")), (r".*", None)]


def _spec_plan():
    def param(shape, init, axes):
        return meshinit.param(shape, init, axes=axes, mesh=mesh8(AB))

    lecun, normal = jax.nn.initializers.lecun_normal(), jax.nn.initializers.normal(0.02)
    return meshinit.plan(
        {
            "up": {"kernel": param((16, 32), lecun, ("a", "b"))},
            "head": param((32, 8), normal, ("b", None)),
        }
    )


def _eqx_make(key):
    return eqx.nn.MLP(16, 8, 32, 2, key=key)


def _paths_of(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    keep = (jax.Array, jax.ShapeDtypeStruct)  # not an MLP's activation function
    return {meshinit._paths.path_str(kp): v for kp, v in leaves if isinstance(v, keep)}


def _init(adapter, existing=None):
    """The flat result of ``adapter``'s full init, or of its init with ``existing``."""
    if adapter == "spec":
        return _paths_of(meshinit.materialize(_spec_plan(), 0, existing=existing))
    if adapter == "nnx":
        with jax.set_mesh(mesh8(AB)):
            return _flat(meshinit.nnx.init(factory, existing=existing))
    if adapter == "linen":
        kw = {"mesh": mesh8(AB), "default": "replicated", "existing": existing}
        return _linen_flat(meshinit.linen.init(Dense2(), 0, jnp.ones((1, 16)), **kw))
    got = meshinit.eqx.init(_eqx_make, 0, EQX_PLACEMENTS, mesh=mesh8(AB), existing=existing)
    return _paths_of(got)


def _restore_target(adapter):
    """What a checkpointer restores into, given where its values belong."""
    if adapter == "spec":
        return _paths_of(_spec_plan().abstract())
    if adapter == "nnx":
        with jax.set_mesh(mesh8(AB)):
            return nnx.state(meshinit.nnx.abstract(factory))
    if adapter == "linen":
        kw = {"mesh": mesh8(AB), "default": "replicated"}
        return meshinit.linen.plan(Dense2(), 0, jnp.ones((1, 16)), **kw).abstract()
    return _paths_of(meshinit.eqx.plan(_eqx_make, 0, EQX_PLACEMENTS, mesh=mesh8(AB)).abstract())


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("keys", ["one key", "four keys"])
def test_typed_prng_keys_given_for_a_weight_are_a_plan_error_naming_the_path(adapter, keys):
    key = jax.random.key(0)
    given = key if keys == "one key" else jax.random.split(key, 4)
    path, shape = WEIGHT[adapter], re.escape(str(SHAPE[adapter]))
    with pytest.raises(
        meshinit.PlanError,
        match=rf"{re.escape(path)}: existing value is an array of typed PRNG keys \(key<fry>.*\), "
        rf"where the plan makes a float32 {shape} array; pass the parameter's values",
    ):
        _init(adapter, {path: given})


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_big_endian_array_is_placed_with_its_values_on_the_planned_sharding(adapter):
    full = _init(adapter)
    path = WEIGHT[adapter]
    native = np.asarray(full[path])
    swapped = native.astype(native.dtype.newbyteorder(">"))
    assert swapped.dtype.byteorder == ">" and np.array_equal(swapped, native)
    got = _init(adapter, {path: swapped})
    assert got[path].sharding == full[path].sharding
    same_bits(got[path], native, path)
    assert swapped.dtype.byteorder == ">"  # the caller's array is left as it was
    with pytest.raises(  # another dtype is still refused, and named as it is
        meshinit.PlanError,
        match=rf"{re.escape(path)}: existing array has dtype float64, planned float32; cast",
    ):
        _init(adapter, {path: native.astype(">f8")})


# (adapter, how): existing= with the adapter's weight given twice, and its two spellings
DUPLICATES = {
    ("nnx", "flat and nested"): (
        lambda a, b: {"layers.0.up.kernel": a, "layers": {0: {"up": {"kernel": b}}}},
        "existing['layers.0.up.kernel'] and existing['layers'][0]['up']['kernel']",
    ),
    ("nnx", "0 and '0'"): (
        lambda a, b: {"layers": {0: {"up": {"kernel": a}}, "0": {"up": {"kernel": b}}}},
        "existing['layers'][0]['up']['kernel'] and existing['layers']['0']['up']['kernel']",
    ),
    ("linen", "flat and nested"): (
        lambda a, b: {"params.up.kernel": a, "params": {"up": {"kernel": b}}},
        "existing['params.up.kernel'] and existing['params']['up']['kernel']",
    ),
    ("linen", "partly nested"): (
        lambda a, b: {"params": {"up.kernel": a, "up": {"kernel": b}}},
        "existing['params']['up.kernel'] and existing['params']['up']['kernel']",
    ),
    ("eqx", "flat and nested"): (
        lambda a, b: {"layers.0.weight": a, "layers": {0: {"weight": b}}},
        "existing['layers.0.weight'] and existing['layers'][0]['weight']",
    ),
    ("eqx", "0 and '0'"): (
        lambda a, b: {"layers": {0: {"weight": a}, "0": {"weight": b}}},
        "existing['layers'][0]['weight'] and existing['layers']['0']['weight']",
    ),
}


@pytest.mark.parametrize(("adapter", "how"), list(DUPLICATES))
def test_a_path_given_twice_is_a_plan_error_naming_both_spellings(adapter, how):
    spell, spellings = DUPLICATES[adapter, how]
    weight = np.asarray(_init(adapter)[WEIGHT[adapter]])
    want = f"{WEIGHT[adapter]}: given twice, as {spellings}; give each path once"
    with pytest.raises(meshinit.PlanError, match=re.escape(want)):  # not one of them silently
        _init(adapter, spell(weight, np.zeros_like(weight)))


@pytest.mark.parametrize("adapter", ["nnx", "linen", "eqx"])
def test_a_path_given_twice_is_listed_with_the_other_problems_in_one_error(adapter):
    spell, _ = DUPLICATES[adapter, "flat and nested"]
    weight = np.asarray(_init(adapter)[WEIGHT[adapter]])
    existing = spell(weight, weight)
    other = {"nnx": "head.kernel", "linen": "params.head.kernel", "eqx": "layers.2.weight"}
    existing[other[adapter]] = np.zeros((3,), np.float32)  # a wrong shape elsewhere
    with pytest.raises(meshinit.PlanError) as raised:
        _init(adapter, existing)
    paths = sorted(p.path for p in raised.value.problems)
    assert paths == sorted([WEIGHT[adapter], other[adapter]]), str(raised.value)
    assert "given twice" in str(raised.value) and "has shape (3,)" in str(raised.value)


def test_linen_existing_reads_int_and_str_keys_in_order_boxes_and_all():
    # jax's tree_map sorts dict keys and cannot order 0 against "params"
    variables = meshinit.linen.init(
        Dense2(), 0, jnp.ones((1, 16)), mesh=mesh8(AB), default="replicated"
    )
    with pytest.raises(meshinit.PlanError, match=r"\n  0: not a planned parameter"):
        _init("linen", {**variables, 0: np.zeros((2,), np.float32)})


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_restore_target_given_for_the_values_is_a_plan_error_that_says_so(adapter):
    target = _restore_target(adapter)
    said = (
        "existing value must be a jax.Array or numpy array, got ShapeDtypeStruct: a restore "
        "target (shapes and shardings), not values; pass what the checkpointer restored into it"
    )
    # the message collapses repeated layers (layers.{0..3}.up.kernel); .problems keeps each
    with pytest.raises(meshinit.PlanError, match=re.escape(f": {said}")) as raised:
        _init(adapter, target)
    assert (WEIGHT[adapter], said) in [(p.path, p.message) for p in raised.value.problems]
