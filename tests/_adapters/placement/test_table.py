"""placements= for nnx and linen (issue 35): a sharding table kept outside the model.

The models here carry no sharding metadata (as EasyDeL's do not), or metadata that a
table overrides. Each placed variable must land exactly where its table entry says,
keep eager's bits, and come back with metadata that makes flax's own tools report
what was placed.
"""

import re
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import submesh
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

AUTO = jax.sharding.AxisType.Auto
RULES = (("embed", "fsdp"), ("mlp", "tp"), ("heads", "tp"), ("vocab", "tp"))


def mesh8(explicit=False):
    return submesh(range(8), (2, 4), ("fsdp", "tp"), explicit=explicit)


def stages():
    return submesh(range(0, 4), (2, 2), ("fsdp", "tp")), submesh(
        range(4, 8), (2, 2), ("fsdp", "tp")
    )


def same_bits(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert got.tobytes() == want.tobytes(), f"{what}: placed values differ from eager's"


# --------------------------------------------------------------------------- nnx models


class Block(nnx.Module):
    """An EasyDeL-style block: no sharding metadata anywhere."""

    def __init__(self, d, ffn, rngs):
        self.q_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(d, ffn, rngs=rngs)
        self.down_proj = nnx.Linear(ffn, d, rngs=rngs)
        self.norm = nnx.RMSNorm(d, rngs=rngs)


class Model(nnx.Module):
    def __init__(self, rngs, layers=4, d=32, ffn=64, vocab=64):
        self.embed_tokens = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([Block(d, ffn, rngs) for _ in range(layers)])
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)


def model():
    return Model(nnx.Rngs(0))


# EasyDeL's own form, ("/"-joined paths, re.search), adapted to dot-joined full matches
TABLE = [
    (r"embed_tokens\.embedding", P("tp", "fsdp")),
    (r".*(q_proj|up_proj)\.kernel", P("fsdp", "tp")),
    (r".*(o_proj|down_proj)\.kernel", P("tp", "fsdp")),
    (r".*up_proj\.bias", P("tp")),
    (r"lm_head\.kernel", P("fsdp", "tp")),
    (r".*", P(None)),
]

LOGICAL = [
    (r"embed_tokens\.embedding", ("vocab", "embed")),
    (r".*(q_proj|up_proj)\.kernel", ("embed", "mlp")),
    (r".*(o_proj|down_proj)\.kernel", ("mlp", "embed")),
    (r".*up_proj\.bias", ("mlp",)),
    (r"lm_head\.kernel", ("embed", "vocab")),
    (r".*", None),
]

WANT = {  # path pattern -> PartitionSpec, as TABLE and LOGICAL (with RULES) say
    r"embed_tokens\.embedding": P("tp", "fsdp"),
    r".*(q_proj|up_proj)\.kernel": P("fsdp", "tp"),
    r".*(o_proj|down_proj)\.kernel": P("tp", "fsdp"),
    r".*up_proj\.bias": P("tp"),
    r"lm_head\.kernel": P("fsdp", "tp"),
}


def want_spec(path, logical=False):
    for pattern, spec in WANT.items():
        if re.fullmatch(pattern, path):
            return spec
    return P() if logical else P(None)


def flat(module):
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(module))}


def unplaced():
    """The model's values as meshinit.nnx.init gives them without a table (on the
    default device): eager's bits wherever eager and jax.jit agree (docs/concepts.md)."""
    if not _UNPLACED:
        _UNPLACED.update(
            {p: np.asarray(v.get_value()) for p, v in flat(meshinit.nnx.init(model)).items()}
        )
    return _UNPLACED


_UNPLACED: dict = {}


def check_nnx(module, mesh_of, *, logical=False):
    """Every Variable where the table says, with the bits it has unplaced (a placement
    moves a Variable, never changes it), flax reporting where it is."""
    eager, before = flat(model()), unplaced()
    got = flat(module)
    assert got.keys() == eager.keys()
    for path, var in got.items():
        value = var.get_value()
        mesh = mesh_of(path)
        assert value.sharding == NamedSharding(mesh, want_spec(path, logical)), path
        same_bits(value, before[path], path)
        np.testing.assert_allclose(value, eager[path].get_value(), rtol=1e-6, atol=1e-6)
        # the metadata says what was placed: flax's own tools report it
        assert nnx.spmd.get_var_pspec(var) == value.sharding.spec, path
        assert var.get_metadata()["mesh"] == mesh, path
    named = nnx.get_named_sharding(nnx.state(module), mesh_of("lm_head.kernel"))
    assert named["lm_head"]["kernel"].get_value() == module.lm_head.kernel.get_value().sharding


def test_nnx_init_places_an_unannotated_model_by_a_partitionspec_table():
    mesh = mesh8()
    check_nnx(meshinit.nnx.init(model, placements=TABLE, mesh=mesh), lambda _: mesh)


def test_nnx_init_takes_the_context_mesh_for_placements_that_name_none():
    mesh = mesh8()
    with jax.set_mesh(mesh):
        module = meshinit.nnx.init(model, placements=TABLE)
    check_nnx(module, lambda _: mesh)


def test_nnx_logical_names_in_the_table_resolve_through_rules():
    mesh = mesh8()
    module = meshinit.nnx.init(model, placements=LOGICAL, mesh=mesh, rules=RULES)
    check_nnx(module, lambda _: mesh, logical=True)
    assert module.lm_head.kernel.get_metadata()["logical_axes"] == ("embed", "vocab")
    # flax's context rules serve as well as rules=
    with nn.logical_axis_rules(RULES):
        again = meshinit.nnx.init(model, placements=LOGICAL, mesh=mesh)
    assert again.lm_head.kernel.get_value().sharding == module.lm_head.kernel.get_value().sharding


def test_a_partitionspec_names_mesh_axes_even_where_rules_are_given():
    mesh = mesh8()
    rules = (("fsdp", "tp"), ("tp", "fsdp"))  # would swap them, if a spec were logical
    module = meshinit.nnx.init(model, placements=TABLE, mesh=mesh, rules=rules)
    assert module.lm_head.kernel.get_value().sharding.spec == P("fsdp", "tp")


@pytest.mark.parametrize("logical", [False, True], ids=["partitionspecs", "logical"])
def test_nnx_stages_take_a_tables_axes_on_each_stages_mesh(logical):
    s0, s1 = stages()
    meshes = [(r"embed_tokens\..*|layers\.[01]\..*", s0), (r".*", s1)]
    table = {"placements": LOGICAL, "rules": RULES} if logical else {"placements": TABLE}

    def stage(path):
        return s0 if re.fullmatch(meshes[0][0], path) else s1

    module = meshinit.nnx.init(model, meshes=meshes, **table)
    check_nnx(module, stage, logical=logical)
    plan = meshinit.nnx.plan(model, meshes=meshes, **table)
    assert [g.mesh for g in plan.groups] == [s0, s1]
    made = flat(module)
    assert {e.path: e.sharding for e in plan.entries} == {
        p: v.get_value().sharding for p, v in made.items()
    }
    target = flat(meshinit.nnx.abstract(model, meshes=meshes, **table))
    for path, var in target.items():
        assert var.get_value().sharding == made[path].get_value().sharding, path
        assert var.get_metadata() == made[path].get_metadata(), path


def test_a_placement_overrides_metadata_and_the_rest_keeps_it():
    mesh = mesh8()

    class Annotated(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Param(
                jax.random.normal(rngs.params(), (16, 8)), out_sharding=("tp", "fsdp")
            )
            self.b = nnx.Param(jax.random.normal(rngs.params(), (16, 8)), out_sharding=("tp", None))
            self.c = nnx.Param(jax.random.normal(rngs.params(), (16, 8)))

    def factory():
        return Annotated(nnx.Rngs(0))

    with jax.set_mesh(mesh):
        module = meshinit.nnx.init(factory, placements=[(r"a", P("fsdp", "tp"))])
        eager = factory()
    assert module.a.get_value().sharding.spec == P("fsdp", "tp")
    assert module.a.get_metadata()["out_sharding"] == ("fsdp", "tp")
    assert module.b.get_value().sharding.spec == P("tp", None)  # its metadata, as before
    assert module.b.get_metadata()["out_sharding"] == ("tp", None)
    assert module.c.get_value().sharding.spec == P()  # unannotated: replicated
    for name in "abc":
        same_bits(getattr(module, name).get_value(), getattr(eager, name).get_value(), name)


def test_nnx_plan_and_abstract_say_what_init_places():
    mesh = mesh8()
    plan = meshinit.nnx.plan(model, placements=LOGICAL, mesh=mesh, rules=RULES)
    module = meshinit.nnx.init(model, placements=LOGICAL, mesh=mesh, rules=RULES)
    made = flat(module)
    assert {e.path: e.sharding for e in plan.entries} == {
        p: v.get_value().sharding for p, v in made.items()
    }
    target = flat(meshinit.nnx.abstract(model, placements=LOGICAL, mesh=mesh, rules=RULES))
    for path, var in target.items():
        struct = var.get_value()
        assert isinstance(struct, jax.ShapeDtypeStruct)
        assert struct.sharding == made[path].get_value().sharding, path
        assert var.get_metadata() == made[path].get_metadata(), path
    # before the hardware: an AbstractMesh plans the same specs
    abstract = AbstractMesh((2, 4), ("fsdp", "tp"), axis_types=(AUTO, AUTO))
    ahead = meshinit.nnx.plan(model, placements=LOGICAL, mesh=abstract, rules=RULES)
    assert [e.sharding.spec for e in ahead.entries] == [e.sharding.spec for e in plan.entries]


def test_nnx_placements_compose_with_existing_and_memory_kinds():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        pytest.skip("this backend has no pinned_host memory")
    mesh = mesh8()
    table = [(r"lm_head\.kernel", P("fsdp", "tp"), None, "pinned_host"), *TABLE]
    given = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    module = meshinit.nnx.init(
        model, placements=table, mesh=mesh, existing={"layers.0.q_proj.kernel": given[:, :32]}
    )
    head = module.lm_head.kernel
    assert head.get_value().sharding == NamedSharding(
        mesh, P("fsdp", "tp"), memory_kind="pinned_host"
    )
    assert head.get_metadata()["memory_kind"] == "pinned_host"
    q = module.layers[0].q_proj.kernel.get_value()
    assert q.sharding == NamedSharding(mesh, P("fsdp", "tp"))
    np.testing.assert_array_equal(np.asarray(q), given[:, :32])


def test_a_placement_that_matches_nothing_is_warned_about():
    mesh = mesh8()
    table = [*TABLE[:-1], (r"layers\.\d+\.mlp\.kernel", P("fsdp", None)), TABLE[-1]]
    with pytest.warns(meshinit.UnusedPatternWarning, match=r'placements\[5\] r"layers.*matched no'):
        meshinit.nnx.plan(model, placements=table, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", meshinit.UnusedPatternWarning)
        meshinit.nnx.plan(model, placements=TABLE, mesh=mesh)  # shadowed entries count as used


def test_every_problem_of_a_table_is_one_plan_error_naming_each_path():
    mesh = mesh8()
    table = [
        (r"embed_tokens\.embedding", P("tp", "fsdp", None)),  # rank 3 for a matrix
        (r"lm_head\.kernel", P("nope", None)),  # no such mesh axis
        (r".*up_proj\.bias", P("fsdp", "tp")),  # too many entries
        (r"layers\.0\.norm\.scale", P(("fsdp", "tp"))),  # 32 over 8 divides; fine
        (r"layers\.1\.norm\.scale", P("tp"), "not a mesh"),
        (r"(", None),  # does not compile
        (r".*", P(None), None, 3),  # memory kind not a str
        ("only a regex",),
        (r".*q_proj\.kernel", "fsdp"),  # a str, not a tuple
        (r".*o_proj\.kernel", P(P.UNCONSTRAINED, None)),
        (r".*", None),
    ]
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.init(model, placements=table, mesh=mesh)
    text = str(e.value)
    for expected in [
        "embed_tokens.embedding: axes ('tp', 'fsdp', None) have 3 entries",
        "lm_head.kernel: mesh axis name(s) 'nope' not in the mesh",
        "layers.0.up_proj.bias: axes ('fsdp', 'tp') have 2 entries",
        'placements[4] r"layers\\.1\\.norm\\.scale": the mesh must be a jax.sharding.Mesh',
        "placements[5]: regex '(' does not compile",
        'placements[6] r".*": the memory kind must be a str',
        "placements[7] must be (regex, axes), (regex, axes, mesh) or (regex, axes, mesh, "
        "memory_kind)",
        'placements[8] r".*q_proj\\.kernel": axes must be None, a jax.sharding.PartitionSpec',
        'placements[9] r".*o_proj\\.kernel": UNCONSTRAINED cannot be placed exactly',
    ]:
        assert expected in text, (expected, text)
    # every layer's bias is named, not only the first
    assert all(f"layers.{i}.up_proj.bias" in text for i in range(4))
    with pytest.raises(meshinit.PlanError, match="the placements tree has no leaf for"):
        meshinit.nnx.init(model, placements={"a": P()})  # a tree (issue 42), not this model's
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        meshinit.nnx.init(model, placements=TABLE, mesh="mesh")


def test_an_indivisible_dimension_and_a_missing_mesh_name_their_paths():
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.plan(
            lambda: Model(nnx.Rngs(0), d=30),
            placements=[(r"lm_head\.kernel", P("tp", None)), (r".*q_proj\.kernel", P("fsdp"))],
        )
    text = str(e.value)
    assert (
        'lm_head.kernel: placements[0] r"lm_head\\.kernel" shards it but there is no mesh' in text
    )
    assert "layers.3.q_proj.kernel: placements[1]" in text
    with pytest.raises(meshinit.PlanError, match=r"lm_head\.kernel: .*30.* not divisible|lm_head"):
        meshinit.nnx.plan(
            lambda: Model(nnx.Rngs(0), d=30),
            placements=[(r"lm_head\.kernel", P("tp"))],
            mesh=mesh8(),
        )


def test_a_table_costs_no_extra_compile(count_compiles):
    """Placed by a table, a model compiles what the same model annotated in code does."""
    mesh = mesh8()

    def annotated():
        layer = dict(use_bias=False, rngs=nnx.Rngs(0))
        m = nnx.Module()
        m.layers = nnx.List(
            [
                nnx.Linear(32, 32, kernel_metadata={"out_sharding": ("fsdp", "tp")}, **layer)
                for _ in range(4)
            ]
        )
        return m

    def bare():
        layer = dict(use_bias=False, rngs=nnx.Rngs(0))
        m = nnx.Module()
        m.layers = nnx.List([nnx.Linear(32, 32, **layer) for _ in range(4)])
        return m

    with jax.set_mesh(mesh):
        meshinit.clear_cache()
        with count_compiles() as by_metadata:
            a = meshinit.nnx.init(annotated)
        meshinit.clear_cache()
        with count_compiles() as by_table:
            b = meshinit.nnx.init(bare, placements=[(r".*kernel", P("fsdp", "tp"))])
    assert by_table.count == by_metadata.count
    for i in range(4):
        ka, kb = a.layers[i].kernel.get_value(), b.layers[i].kernel.get_value()
        assert ka.sharding == kb.sharding
        same_bits(kb, ka, f"layers.{i}.kernel")


# ------------------------------------------------------------------------------- linen


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64, name="up_proj")(x)
        h = nn.Dense(
            32,
            name="down_proj",
            kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tp")),
        )(h)
        return nn.RMSNorm(name="norm")(h)


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32, name="embed_tokens")(tokens)
        for i in range(2):
            x = LinenBlock(name=f"layers_{i}")(x)
        return nn.Dense(64, use_bias=False, name="lm_head")(x)


LINEN_TABLE = [
    (r"params\.embed_tokens\.embedding", P("tp", "fsdp")),
    (r".*up_proj\.kernel", ("embed", "mlp")),
    (r".*down_proj\.kernel", P("tp", "fsdp")),
    (r".*up_proj\.bias", P("tp")),
    (r"params\.lm_head\.kernel", ("embed", "vocab")),
    (r".*", None),
]

LINEN_WANT = {
    r"params\.embed_tokens\.embedding": P("tp", "fsdp"),
    r".*up_proj\.kernel": P("fsdp", "tp"),
    r".*down_proj\.kernel": P("tp", "fsdp"),
    r".*up_proj\.bias": P("tp"),
    r"params\.lm_head\.kernel": P("fsdp", "tp"),
}

TOKENS = jnp.zeros((2, 8), jnp.int32)


def linen_paths(variables):
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    flat, _ = jax.tree_util.tree_flatten_with_path(variables, is_leaf=is_box)
    return {".".join(str(k.key) for k in kp): leaf for kp, leaf in flat}


def flax_sharding(box, mesh):
    """flax's answer for one placed box: logical names through the rules, mesh axes
    as they are (nn.Partitioned.get_sharding)."""
    if isinstance(box, nn.LogicallyPartitioned):
        return nn.logical_to_mesh_sharding(P(*box.names), mesh, RULES)
    return box.get_sharding(mesh)


def check_linen(variables, mesh_of):
    eager = linen_paths(nn.unbox(LinenModel().init(jax.random.key(0), TOKENS)))
    unplaced = linen_paths(  # the bits without a table: a placement never changes them
        nn.unbox(
            meshinit.linen.init(
                LinenModel(), jax.random.key(0), TOKENS, mesh=mesh8(), default="replicated"
            )
        )
    )
    got = linen_paths(variables)
    assert got.keys() == eager.keys()
    for path, box in got.items():
        assert isinstance(box, nn.Partitioned), path  # placed: its box says what
        value, mesh = box.value, mesh_of(path)
        want = next((s for p, s in LINEN_WANT.items() if re.fullmatch(p, path)), P())
        assert value.sharding == NamedSharding(mesh, want), path
        assert flax_sharding(box, mesh) == value.sharding, path
        same_bits(value, unplaced[path], path)
        np.testing.assert_allclose(value, eager[path], rtol=1e-6, atol=1e-6)


def test_linen_init_places_by_a_table_of_specs_and_logical_names():
    mesh = mesh8()
    variables = meshinit.linen.init(
        LinenModel(), jax.random.key(0), TOKENS, mesh=mesh, rules=RULES, placements=LINEN_TABLE
    )
    check_linen(variables, lambda _: mesh)
    assert type(linen_paths(variables)["params.lm_head.kernel"]) is nn.LogicallyPartitioned
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):  # and the model runs on them
        out = LinenModel().apply(variables, TOKENS)
    assert out.shape == (2, 8, 64)
    plan = meshinit.linen.plan(
        LinenModel(), 0, TOKENS, mesh=mesh, rules=RULES, placements=LINEN_TABLE
    )
    placed = linen_paths(variables)
    assert {e.path: e.sharding for e in plan.entries} == {
        p: b.value.sharding for p, b in placed.items()
    }


def test_linen_stages_take_a_tables_axes_on_each_stages_mesh():
    s0, s1 = stages()
    meshes = [(r"params\.(embed_tokens|layers_0)\..*", s0), (r".*", s1)]

    def stage(path):
        return s0 if re.fullmatch(meshes[0][0], path) else s1

    variables = meshinit.linen.init(
        LinenModel(), jax.random.key(0), TOKENS, rules=RULES, meshes=meshes, placements=LINEN_TABLE
    )
    check_linen(variables, stage)
    # a box placed on a stage names its mesh: linen's unbox constrains it there
    assert linen_paths(variables)["params.lm_head.kernel"].mesh == s1
    plan = meshinit.linen.plan(
        LinenModel(), 0, TOKENS, rules=RULES, meshes=meshes, placements=LINEN_TABLE
    )
    assert [g.mesh for g in plan.groups] == [s0, s1]
    placed = linen_paths(variables)
    assert {e.path: e.sharding for e in plan.entries} == {
        p: b.value.sharding for p, b in placed.items()
    }


def test_linen_placement_overrides_an_annotation_and_unplaced_keep_theirs():
    mesh = mesh8()
    variables = meshinit.linen.init(
        LinenModel(),
        jax.random.key(0),
        TOKENS,
        mesh=mesh,
        default="replicated",
        placements=[(r"params\.layers_0\.down_proj\.kernel", P("tp", "fsdp"))],
    )
    boxes = linen_paths(variables)
    assert boxes["params.layers_0.down_proj.kernel"].names == ("tp", "fsdp")
    assert boxes["params.layers_0.down_proj.kernel"].value.sharding.spec == P("tp", "fsdp")
    assert boxes["params.layers_1.down_proj.kernel"].names == (None, "tp")  # its annotation
    assert boxes["params.layers_1.down_proj.kernel"].value.sharding.spec == P(None, "tp")
    assert boxes["params.lm_head.kernel"].sharding.spec == P()  # unboxed, default=


def test_linen_placements_compose_with_existing_and_memory_kinds():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        pytest.skip("this backend has no pinned_host memory")
    mesh = mesh8()
    table = [(r"params\.lm_head\.kernel", P("fsdp", "tp"), None, "pinned_host"), *LINEN_TABLE]
    given = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    variables = meshinit.linen.init(
        LinenModel(),
        jax.random.key(0),
        TOKENS,
        mesh=mesh,
        rules=RULES,
        placements=table,
        existing={"params.layers_0.up_proj.kernel": given},
    )
    boxes = linen_paths(variables)
    head = boxes["params.lm_head.kernel"].value
    assert head.sharding == NamedSharding(mesh, P("fsdp", "tp"), memory_kind="pinned_host")
    up = boxes["params.layers_0.up_proj.kernel"].value
    assert up.sharding == NamedSharding(mesh, P("fsdp", "tp"))
    np.testing.assert_array_equal(np.asarray(up), given)


def test_linen_table_problems_are_one_plan_error():
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.linen.plan(
            LinenModel(),
            0,
            TOKENS,
            mesh=mesh8(),
            placements=[
                (r".*up_proj\.kernel", ("embed", "mlp")),  # logical, but no rules
                (r"params\.lm_head\.kernel", P("tp", "nope")),
                (r"[", None),
                (r".*", None),
            ],
        )
    text = str(e.value)
    assert (
        "params.layers_0.up_proj.kernel: mesh axis name(s) 'embed', 'mlp' not in the mesh" in text
    )
    assert "params.layers_1.up_proj.kernel" in text
    assert "params.lm_head.kernel: mesh axis name(s) 'nope' not in the mesh" in text
    assert "placements[2]: regex '[' does not compile" in text


# --------------------------------------------------------------------------------- eqx


def test_eqx_takes_partitionspecs_as_mesh_axes_spelled_as_given():
    mesh = mesh8()
    rules = (("fsdp", "tp"),)  # a PartitionSpec's names are mesh axes, never logical
    layer = meshinit.eqx.init(
        lambda k: eqx.nn.Linear(32, 16, key=k),
        jax.random.key(0),
        [(r"weight", P("tp")), (r"bias", P())],
        mesh=mesh,
        rules=rules,
    )
    assert layer.weight.sharding == NamedSharding(mesh, P("tp"))  # as jax spells it
    assert layer.bias.sharding == NamedSharding(mesh, P())
    same_bits(layer.weight, eqx.nn.Linear(32, 16, key=jax.random.key(0)).weight, "weight")


# ---------------------------------------- placements that name no mesh, in every adapter


def test_a_replicating_entry_without_a_mesh_takes_the_one_mesh_the_table_names():
    mesh = mesh8()
    # every sharding entry names the mesh; the catch-all replicates and names none
    nnx_table = [(r, axes, mesh) for r, axes in TABLE[:-1]] + [TABLE[-1]]  # P(None)
    check_nnx(meshinit.nnx.init(model, placements=nnx_table), lambda _: mesh)
    linen_table = [(r, axes, mesh) for r, axes in LINEN_TABLE[:-1]] + [LINEN_TABLE[-1]]
    variables = meshinit.linen.init(
        LinenModel(), jax.random.key(0), TOKENS, rules=RULES, placements=linen_table
    )
    check_linen(variables, lambda _: mesh)
    # the box of a replicated variable names the mesh it took, as the others' do
    assert linen_paths(variables)["params.layers_0.norm.scale"].mesh == mesh
    layer = meshinit.eqx.init(
        lambda k: eqx.nn.Linear(32, 16, key=k), 0, [(r"weight", P("tp"), mesh), (r"bias", None)]
    )
    assert layer.bias.sharding == NamedSharding(mesh, P())


def test_every_adapter_takes_the_same_context_meshes_for_placements_that_name_none():
    mesh = mesh8()
    # meshinit.defaults(mesh=...) for nnx and linen, as eqx takes it
    with meshinit.defaults(mesh=mesh):
        module = meshinit.nnx.init(model, placements=TABLE)
        variables = meshinit.linen.init(
            LinenModel(), jax.random.key(0), TOKENS, rules=RULES, placements=LINEN_TABLE
        )
    check_nnx(module, lambda _: mesh)
    check_linen(variables, lambda _: mesh)
    # jax.set_mesh for eqx, as nnx and linen take it
    with jax.set_mesh(mesh):
        layer = meshinit.eqx.init(
            lambda k: eqx.nn.Linear(32, 16, key=k), 0, [(r"weight", P("tp")), (r"bias", None)]
        )
    assert layer.weight.sharding == NamedSharding(mesh, P("tp"))
    assert layer.bias.sharding == NamedSharding(mesh, P())
