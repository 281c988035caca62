"""Shardings spelled as each framework spells them: ``==``, not only equivalent.

jax compares PartitionSpecs entry by entry, so ``P()`` and ``P(None, None)`` place
alike but are not ``==``; user code, orbax's checks and tests that compare shardings
see the difference. The framework's answers these tests hold meshinit to:

- nnx: ``nnx.get_named_sharding(nnx.state(nnx.eval_shape(factory)), mesh)``, what
  tunix, bonsai and MaxText compute as "the" placement: as many entries as the
  annotation has, and ``P()`` for a Variable without one, on Auto and Explicit meshes.
  A typed key array is spelled with the key array's rank, the only spelling jax gives
  one (``jax.jit(..., out_shardings=P())`` of a ``(2,)`` key gives ``P(None,)``).
- linen: ``nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)``.
- eqx: a ``None`` placement replicates, spelled as jax spells a replicated array on
  the mesh: ``P()`` on an Auto mesh, one None per dimension on an Explicit one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

AXES = ("fsdp", "tensor")
KINDS = pytest.mark.parametrize(
    "kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
EXPLICIT_FAST = pytest.mark.parametrize(  # Auto axes in MESHINIT_TESTS=all
    "kind",
    [pytest.param(AxisType.Auto, marks=pytest.mark.slow), AxisType.Explicit],
    ids=["auto", "explicit"],
)
EMBED_MLP_RULES = (("embed", "fsdp"), ("mlp", "tensor"))


def mesh_of(kind, ids=range(8), shape=(2, 4)):
    devices = [jax.devices()[i] for i in ids]
    return jax.make_mesh(shape, AXES, axis_types=(kind, kind), devices=devices)


class Model(nnx.Module):
    """Every kind of nnx Variable a real model has, annotated and not."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.plain = nnx.Param(init(rngs.params(), (16, 8)))  # no metadata (a router)
        self.bias = nnx.Param(jnp.zeros((16,)))  # no metadata, rank 1
        self.full = nnx.Param(init(rngs.params(), (16, 8)), out_sharding=("fsdp", "tensor"))
        self.short = nnx.Param(init(rngs.params(), (16, 8, 4)), out_sharding=("fsdp",))
        self.empty = nnx.Param(jnp.ones((8,)), out_sharding=())  # P(): replicated on purpose
        self.logical = nnx.Param(
            init(rngs.params(), (16, 8)),
            out_sharding=("embed", "mlp"),
            sharding_rules=EMBED_MLP_RULES,
        )
        self.stat = nnx.BatchStat(jnp.zeros((8,)))
        self.keys = nnx.RngKey(jax.random.split(rngs.params(), 2))  # a (2,) typed key array
        self.rngs = nnx.Rngs(rngs.params())  # a scalar key and its counter


def factory():
    return Model(nnx.Rngs(0))


def flat(state):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def flax_answer(mesh):
    """flax's own placement of every Variable, as tunix computes it."""
    with jax.set_mesh(mesh):
        return flat(nnx.get_named_sharding(nnx.state(nnx.eval_shape(factory)), mesh))


def is_key(x):
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def differences(got: dict, want: dict, keys: set[str]) -> list[str]:
    """Every path whose sharding is not ``==`` the answer, keys at their own rank."""
    problems = []
    assert sorted(got) == sorted(want)
    for path, sharding in want.items():
        if path in keys:  # jax spells a key array's sharding with the key array's rank
            ndim = len(got[path].shape)
            entries = (*sharding.spec, *[None] * ndim)[:ndim]
            sharding = NamedSharding(sharding.mesh, P(*entries))
        if got[path].sharding != sharding:
            problems.append(f"{path}: {got[path].sharding.spec}, flax says {sharding.spec}")
    return problems


@KINDS
def test_nnx_init_abstract_and_plan_equal_flax_named_sharding(kind):
    mesh = mesh_of(kind)
    want = flax_answer(mesh)
    with jax.set_mesh(mesh):
        model = meshinit.nnx.init(factory)
        abstract = meshinit.nnx.abstract(factory)
        plan = meshinit.nnx.plan(factory)
    got = flat(nnx.state(model))
    keys = {p for p, x in got.items() if is_key(x)}
    assert keys == {"keys", "rngs.default.key"}, keys
    assert want["plain"].spec == P() and want["short"].spec == P("fsdp")  # what's checked
    assert not differences(got, want, keys), "\n".join(differences(got, want, keys))
    structs = flat(nnx.state(abstract))
    assert not differences(structs, want, keys), "\n".join(differences(structs, want, keys))
    planned = {e.path: e.sharding for e in plan.entries}
    for path, sharding in want.items():
        if path not in keys:  # planned as key data (one more dimension)
            assert planned[path] == sharding, f"{path}: plan says {planned[path].spec}"


@EXPLICIT_FAST
def test_nnx_typed_keys_are_spelled_as_flax_own_jitted_init_gives_them(kind):
    mesh = mesh_of(kind)
    with jax.set_mesh(mesh):
        shardings = nnx.get_named_sharding(nnx.state(nnx.eval_shape(factory)), mesh)
        own = flat(jax.jit(lambda: nnx.state(factory()), out_shardings=shardings)())
        got = flat(nnx.state(meshinit.nnx.init(factory)))
    for path in ("keys", "rngs.default.key", "rngs.default.count"):
        assert got[path].sharding == own[path].sharding, (
            f"{path}: {got[path].sharding.spec}, flax's jitted init {own[path].sharding.spec}"
        )
    assert got["keys"].sharding.spec == P(None)  # the (2,) key array's rank


@EXPLICIT_FAST
def test_nnx_stages_spell_each_variable_as_flax_would_on_its_stage(kind):
    stage0, stage1 = mesh_of(kind, range(4), (2, 2)), mesh_of(kind, range(4, 8), (2, 2))
    meshes = [(r"(plain|full)", stage1), (r".*", stage0)]
    with jax.set_mesh(stage0):
        got = flat(nnx.state(meshinit.nnx.init(factory, meshes=meshes)))
    assert got["plain"].sharding == NamedSharding(stage1, P())
    assert got["full"].sharding == NamedSharding(stage1, P("fsdp", "tensor"))
    assert got["bias"].sharding == NamedSharding(stage0, P())
    assert got["short"].sharding == NamedSharding(stage0, P("fsdp"))
    assert got["stat"].sharding == NamedSharding(stage0, P())


def test_nnx_values_do_not_change_with_the_spelling():
    mesh = mesh_of(AxisType.Explicit)
    with jax.set_mesh(mesh):
        got = flat(nnx.state(meshinit.nnx.init(factory)))
    with nnx.use_eager_sharding(False):
        want = flat(nnx.state(factory()))
    for path, x in want.items():
        a, b = (jax.random.key_data(v) if is_key(v) else v for v in (got[path], x))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)


class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        x = nn.Dense(16, kernel_init=kernel)(x)
        x = nn.Dense(8)(x)  # no boxes
        self.param("s", nn.with_logical_partitioning(nn.initializers.ones, ("mlp",)), (16, 4))
        self.variable("stats", "count", lambda: jnp.zeros((3,)))
        return x


@KINDS
def test_linen_init_and_plan_equal_flax_logical_to_mesh_sharding(kind):
    mesh = mesh_of(kind)
    module, x = Linen(), np.ones((2, 8), np.float32)
    abstract = jax.eval_shape(lambda: module.init(jax.random.key(0), x))
    want = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, EMBED_MLP_RULES)
    want = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(want)[0]}
    kwargs = dict(mesh=mesh, rules=EMBED_MLP_RULES, default="replicated")
    got = nn.meta.unbox(meshinit.linen.init(module, jax.random.key(0), x, **kwargs))
    got = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(got)[0]}
    planned = meshinit.linen.plan(module, jax.random.key(0), x, **kwargs)
    planned = {e.path: e.sharding for e in planned.entries}
    assert want["['params']['Dense_1']['kernel']"].spec == P()  # an unboxed leaf is checked
    assert sorted(got) == sorted(want)
    bad = [
        f"{p}: {got[p].sharding.spec}, flax {s.spec}"
        for p, s in want.items()
        if got[p].sharding != s
    ]
    assert not bad, "\n".join(bad)
    dotted = {p[2:-2].replace("']['", "."): s for p, s in want.items()}
    bad = [f"{p}: {planned[p].spec}, flax {s.spec}" for p, s in dotted.items() if planned[p] != s]
    assert not bad, "\n".join(bad)


@KINDS
def test_eqx_none_placement_is_spelled_as_jax_spells_a_replicated_array(kind):
    eqx = pytest.importorskip("equinox")
    mesh = mesh_of(kind)
    placements = [(r"weight", ("fsdp", None)), (r".*", None)]
    linear = meshinit.eqx.init(lambda k: eqx.nn.Linear(8, 16, key=k), 0, placements, mesh=mesh)
    # what a jit of the same module gives back for a replicated array on this mesh
    jitted = jax.jit(lambda b: b, out_shardings=NamedSharding(mesh, P()))(linear.bias)
    jitted = jax.jit(lambda b: b + 0)(jitted)
    assert linear.bias.sharding == jitted.sharding, (linear.bias.sharding, jitted.sharding)
    assert linear.weight.sharding == NamedSharding(mesh, P("fsdp", None))


class Logical(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w = nnx.Param(init(rngs.params(), (16, 8)), out_sharding=("embed", "mlp"))
        self.direct = nnx.Param(init(rngs.params(), (16, 8)), out_sharding=("fsdp", "context"))


@KINDS
def test_nnx_names_resolved_by_rules_leave_out_mesh_axes_of_size_1_as_maxtext_does(kind):
    # MaxText's rules list several mesh axes per logical name, most of size 1 on a
    # given mesh; its own nnx init (and jax's sharding types) leave those out.
    devices = np.array(jax.devices()).reshape(2, 4, 1, 1)
    names = ("fsdp", "tensor", "context", "stage")
    mesh = jax.sharding.Mesh(devices, names, axis_types=(kind,) * 4)
    rules = (("embed", ("fsdp", "context")), ("mlp", ("tensor", "stage")))
    with jax.set_mesh(mesh):
        model = meshinit.nnx.init(lambda: Logical(nnx.Rngs(0)), rules=rules)
        plan = meshinit.nnx.plan(lambda: Logical(nnx.Rngs(0)), rules=rules)
    assert model.w.get_value().sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    assert plan.entries[1].path == "w" and plan.entries[1].sharding.spec == P("fsdp", "tensor")
    # under rules, every name is resolved as MaxText resolves it: a mesh axis passes
    # through, and one of size 1 is left out the same way
    assert model.direct.get_value().sharding == NamedSharding(mesh, P("fsdp", None))
    # without rules, the metadata is the user's own spelling, as flax keeps it
    with jax.set_mesh(mesh):
        direct = meshinit.nnx.init(lambda: Direct(nnx.Rngs(0)))
    assert direct.direct.get_value().sharding == NamedSharding(mesh, P("fsdp", "context"))


class Direct(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.direct = nnx.Param(init(rngs.params(), (16, 8)), out_sharding=("fsdp", "context"))
