"""``placements=`` as a table of patterns: the sharding kept outside the model.

The models here carry no sharding metadata (as EasyDeL's do not), or metadata that a
table overrides. Each placed variable must land exactly where its table entry says,
keep eager's bits, and come back with metadata that makes flax's own tools report
what was placed. An entry written for a variable that holds no array (an int, None)
is a PlanError naming the path and the entry, in nnx, linen and eqx alike; a bytes
regex in any table (placements=, meshes=, names=) is a problem naming the entry; and
EasyDeL's rules (re.search on "/"-joined paths) go in unchanged through
meshinit.searched, with a "/" in an idle full-match entry saying how.
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
from helpers import mesh8, same_bits, submesh
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from placement_models import (
    Counted,
    ECausalLM,
    EqxCounted,
    LinenCounted,
    assert_same_bits,
    bits_nnx,
    causal_lm,
    mesh3,
    shardings_nnx,
)

import meshinit

AUTO = jax.sharding.AxisType.Auto
FSDP_TP = ("fsdp", "tp")
TP_RULES = (("embed", "fsdp"), ("mlp", "tp"), ("heads", "tp"), ("vocab", "tp"))


def stages():
    return submesh(range(0, 4), (2, 2), ("fsdp", "tp")), submesh(
        range(4, 8), (2, 2), ("fsdp", "tp")
    )


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

WANT = {  # path pattern -> PartitionSpec, as TABLE and LOGICAL (with TP_RULES) say
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
    mesh = mesh8(FSDP_TP)
    check_nnx(meshinit.nnx.init(model, placements=TABLE, mesh=mesh), lambda _: mesh)


def test_nnx_init_takes_the_context_mesh_for_placements_that_name_none():
    mesh = mesh8(FSDP_TP)
    with jax.set_mesh(mesh):
        module = meshinit.nnx.init(model, placements=TABLE)
    check_nnx(module, lambda _: mesh)


def test_nnx_logical_names_in_the_table_resolve_through_rules():
    mesh = mesh8(FSDP_TP)
    module = meshinit.nnx.init(model, placements=LOGICAL, mesh=mesh, rules=TP_RULES)
    check_nnx(module, lambda _: mesh, logical=True)
    assert module.lm_head.kernel.get_metadata()["logical_axes"] == ("embed", "vocab")
    # flax's context rules serve as well as rules=
    with nn.logical_axis_rules(TP_RULES):
        again = meshinit.nnx.init(model, placements=LOGICAL, mesh=mesh)
    assert again.lm_head.kernel.get_value().sharding == module.lm_head.kernel.get_value().sharding


def test_a_partitionspec_names_mesh_axes_even_where_rules_are_given():
    mesh = mesh8(FSDP_TP)
    rules = (("fsdp", "tp"), ("tp", "fsdp"))  # would swap them, if a spec were logical
    module = meshinit.nnx.init(model, placements=TABLE, mesh=mesh, rules=rules)
    assert module.lm_head.kernel.get_value().sharding.spec == P("fsdp", "tp")


@pytest.mark.parametrize("logical", [False, True], ids=["partitionspecs", "logical"])
def test_nnx_stages_take_a_tables_axes_on_each_stages_mesh(logical):
    s0, s1 = stages()
    meshes = [(r"embed_tokens\..*|layers\.[01]\..*", s0), (r".*", s1)]
    table = {"placements": LOGICAL, "rules": TP_RULES} if logical else {"placements": TABLE}

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
    mesh = mesh8(FSDP_TP)

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
    mesh = mesh8(FSDP_TP)
    plan = meshinit.nnx.plan(model, placements=LOGICAL, mesh=mesh, rules=TP_RULES)
    module = meshinit.nnx.init(model, placements=LOGICAL, mesh=mesh, rules=TP_RULES)
    made = flat(module)
    assert {e.path: e.sharding for e in plan.entries} == {
        p: v.get_value().sharding for p, v in made.items()
    }
    target = flat(meshinit.nnx.abstract(model, placements=LOGICAL, mesh=mesh, rules=TP_RULES))
    for path, var in target.items():
        struct = var.get_value()
        assert isinstance(struct, jax.ShapeDtypeStruct)
        assert struct.sharding == made[path].get_value().sharding, path
        assert var.get_metadata() == made[path].get_metadata(), path
    # before the hardware: an AbstractMesh plans the same specs
    abstract = AbstractMesh((2, 4), ("fsdp", "tp"), axis_types=(AUTO, AUTO))
    ahead = meshinit.nnx.plan(model, placements=LOGICAL, mesh=abstract, rules=TP_RULES)
    assert [e.sharding.spec for e in ahead.entries] == [e.sharding.spec for e in plan.entries]


def test_nnx_placements_compose_with_existing_and_memory_kinds():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        pytest.skip("this backend has no pinned_host memory")
    mesh = mesh8(FSDP_TP)
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
    mesh = mesh8(FSDP_TP)
    table = [*TABLE[:-1], (r"layers\.\d+\.mlp\.kernel", P("fsdp", None)), TABLE[-1]]
    with pytest.warns(meshinit.UnusedPatternWarning, match=r'placements\[5\] r"layers.*matched no'):
        meshinit.nnx.plan(model, placements=table, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", meshinit.UnusedPatternWarning)
        meshinit.nnx.plan(model, placements=TABLE, mesh=mesh)  # shadowed entries count as used


def test_every_problem_of_a_table_is_one_plan_error_naming_each_path():
    mesh = mesh8(FSDP_TP)
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
        "layers.{0..3}.up_proj.bias: axes ('fsdp', 'tp') have 2 entries",
        'placements[4] r"layers\\.1\\.norm\\.scale": the mesh must be a jax.sharding.Mesh',
        "placements[5]: regex '(' does not compile",
        'placements[6] r".*": the memory kind must be a str',
        "placements[7] must be (regex, axes), (regex, axes, mesh) or (regex, axes, mesh, "
        "memory_kind)",
        'placements[8] r".*q_proj\\.kernel": axes must be None, a jax.sharding.PartitionSpec',
        'placements[9] r".*o_proj\\.kernel": UNCONSTRAINED cannot be placed exactly',
    ]:
        assert expected in text, (expected, text)
    # every layer's bias is named, not only the first (one line names all four)
    paths = [p.path for p in e.value.problems]
    assert all(f"layers.{i}.up_proj.bias" in paths for i in range(4))
    with pytest.raises(meshinit.PlanError, match="the placements tree has no leaf for"):
        meshinit.nnx.init(model, placements={"a": P()})  # a tree, not this model's
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
    assert "layers.{0..3}.q_proj.kernel: placements[1]" in text
    with pytest.raises(meshinit.PlanError, match=r"lm_head\.kernel: .*30.* not divisible|lm_head"):
        meshinit.nnx.plan(
            lambda: Model(nnx.Rngs(0), d=30),
            placements=[(r"lm_head\.kernel", P("tp"))],
            mesh=mesh8(FSDP_TP),
        )


def test_a_table_costs_no_extra_compile(count_compiles):
    """Placed by a table, a model compiles what the same model annotated in code does."""
    mesh = mesh8(FSDP_TP)

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
        return nn.logical_to_mesh_sharding(P(*box.names), mesh, TP_RULES)
    return box.get_sharding(mesh)


def check_linen(variables, mesh_of):
    eager = linen_paths(nn.unbox(LinenModel().init(jax.random.key(0), TOKENS)))
    unplaced = linen_paths(  # the bits without a table: a placement never changes them
        nn.unbox(
            meshinit.linen.init(
                LinenModel(), jax.random.key(0), TOKENS, mesh=mesh8(FSDP_TP), default="replicated"
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
    mesh = mesh8(FSDP_TP)
    variables = meshinit.linen.init(
        LinenModel(), jax.random.key(0), TOKENS, mesh=mesh, rules=TP_RULES, placements=LINEN_TABLE
    )
    check_linen(variables, lambda _: mesh)
    assert type(linen_paths(variables)["params.lm_head.kernel"]) is nn.LogicallyPartitioned
    with jax.set_mesh(mesh), nn.logical_axis_rules(TP_RULES):  # and the model runs on them
        out = LinenModel().apply(variables, TOKENS)
    assert out.shape == (2, 8, 64)
    plan = meshinit.linen.plan(
        LinenModel(), 0, TOKENS, mesh=mesh, rules=TP_RULES, placements=LINEN_TABLE
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
        LinenModel(),
        jax.random.key(0),
        TOKENS,
        rules=TP_RULES,
        meshes=meshes,
        placements=LINEN_TABLE,
    )
    check_linen(variables, stage)
    # a box placed on a stage names its mesh: linen's unbox constrains it there
    assert linen_paths(variables)["params.lm_head.kernel"].mesh == s1
    plan = meshinit.linen.plan(
        LinenModel(), 0, TOKENS, rules=TP_RULES, meshes=meshes, placements=LINEN_TABLE
    )
    assert [g.mesh for g in plan.groups] == [s0, s1]
    placed = linen_paths(variables)
    assert {e.path: e.sharding for e in plan.entries} == {
        p: b.value.sharding for p, b in placed.items()
    }


def test_linen_placement_overrides_an_annotation_and_unplaced_keep_theirs():
    mesh = mesh8(FSDP_TP)
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
    mesh = mesh8(FSDP_TP)
    table = [(r"params\.lm_head\.kernel", P("fsdp", "tp"), None, "pinned_host"), *LINEN_TABLE]
    given = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    variables = meshinit.linen.init(
        LinenModel(),
        jax.random.key(0),
        TOKENS,
        mesh=mesh,
        rules=TP_RULES,
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
            mesh=mesh8(FSDP_TP),
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
    mesh = mesh8(FSDP_TP)
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
    mesh = mesh8(FSDP_TP)
    # every sharding entry names the mesh; the catch-all replicates and names none
    nnx_table = [(r, axes, mesh) for r, axes in TABLE[:-1]] + [TABLE[-1]]  # P(None)
    check_nnx(meshinit.nnx.init(model, placements=nnx_table), lambda _: mesh)
    linen_table = [(r, axes, mesh) for r, axes in LINEN_TABLE[:-1]] + [LINEN_TABLE[-1]]
    variables = meshinit.linen.init(
        LinenModel(), jax.random.key(0), TOKENS, rules=TP_RULES, placements=linen_table
    )
    check_linen(variables, lambda _: mesh)
    # the box of a replicated variable names the mesh it took, as the others' do
    assert linen_paths(variables)["params.layers_0.norm.scale"].mesh == mesh
    layer = meshinit.eqx.init(
        lambda k: eqx.nn.Linear(32, 16, key=k), 0, [(r"weight", P("tp"), mesh), (r"bias", None)]
    )
    assert layer.bias.sharding == NamedSharding(mesh, P())


def test_every_adapter_takes_the_same_context_meshes_for_placements_that_name_none():
    mesh = mesh8(FSDP_TP)
    # meshinit.defaults(mesh=...) for nnx and linen, as eqx takes it
    with meshinit.defaults(mesh=mesh):
        module = meshinit.nnx.init(model, placements=TABLE)
        variables = meshinit.linen.init(
            LinenModel(), jax.random.key(0), TOKENS, rules=TP_RULES, placements=LINEN_TABLE
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


FSDP_SP = ("fsdp", "sp")


# EasyDeL 0.3.0's form: re.search on "/"-joined paths, first match wins; the first rule is
# what resolve_shardings_automatically() makes (anchored, optimizer-prefix tolerant), the
# others as config.get_partition_rules() of older families spell them.
EASYDEL_RULES = (
    (r"^(?:.*/)?model/embed_tokens/embedding(?:/.*)?$", P(FSDP_SP, "tp")),
    ("self_attn/(q_proj|k_proj)/kernel", P(FSDP_SP, "tp")),
    ("self_attn/o_proj/kernel", P("tp", FSDP_SP)),
    (".*/mlp/gate_proj/kernel", P(FSDP_SP, "tp")),
    (".*/mlp/up_proj/kernel", P(FSDP_SP, "tp")),
    (".*/mlp/down_proj/kernel", P("tp", FSDP_SP)),
    (".*/input_layernorm/scale", P(None)),
    ("lm_head/kernel", P(FSDP_SP, "tp")),
    (".*", P()),
)


# the same table as meshinit writes it: dot-joined paths, each regex full-matched
DOTTED = [
    (r"model\.embed_tokens\.embedding", P(FSDP_SP, "tp")),
    (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj)\.kernel", P(FSDP_SP, "tp")),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.kernel", P("tp", FSDP_SP)),
    (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj)\.kernel", P(FSDP_SP, "tp")),
    (r"model\.layers\.\d+\.mlp\.down_proj\.kernel", P("tp", FSDP_SP)),
    (r"model\.layers\.\d+\.input_layernorm\.scale", P(None)),
    (r"lm_head\.kernel", P(FSDP_SP, "tp")),
    (r".*", P()),
]


def test_nnx_a_placement_for_an_int_or_none_variable_is_a_plan_error_naming_it():
    mesh = mesh3()
    table = [(r"step", P("fsdp")), (r"cache", None), (r".*", P())]
    with warnings.catch_warnings():
        warnings.simplefilter("error", meshinit.UnusedPatternWarning)  # not "matched no path"
        with pytest.raises(meshinit.PlanError) as e:
            meshinit.nnx.plan(Counted, placements=table, mesh=mesh)
    text = str(e.value)
    assert 'step: placements[0] r"step": holds int, not an array; meshinit cannot place it' in text
    assert 'cache: placements[1] r"cache": holds None, not an array' in text
    assert {p.path for p in e.value.problems} == {"step", "cache"}
    # a catch-all that also places arrays leaves them as they are, as without a table
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = meshinit.nnx.init(Counted, placements=[(r".*", P("fsdp"))], mesh=mesh)
    assert model.step.get_value() == 3 and model.cache.get_value() is None
    assert model.w.get_value().sharding == NamedSharding(mesh, P("fsdp"))


def test_eqx_a_placement_for_an_int_or_none_field_is_a_plan_error_naming_it():
    mesh = mesh3()
    table = [(r"step", P("fsdp")), (r"cache", None), (r".*", P())]
    with warnings.catch_warnings():
        warnings.simplefilter("error", meshinit.UnusedPatternWarning)
        with pytest.raises(meshinit.PlanError) as e:
            meshinit.eqx.plan(EqxCounted, 0, table, mesh=mesh)
    text = str(e.value)
    assert 'step: placements[0] r"step": holds int, not an array; meshinit cannot place it' in text
    assert 'cache: placements[1] r"cache": holds None, not an array' in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = meshinit.eqx.init(EqxCounted, 0, [(r".*", P("fsdp"))], mesh=mesh)
    assert module.step == 3 and module.cache is None


def test_linen_a_placement_for_an_int_variable_names_the_entry_as_nnx_and_eqx_do():
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.linen.plan(
            LinenCounted(),
            0,
            jnp.ones((1, 8)),
            mesh=mesh3(),
            placements=[(r"stats\.step", None), (r".*", P())],
        )
    assert str(e.value.problems[0]) == (
        'stats.step: placements[0] r"stats\\.step": holds int, not an array; meshinit cannot '
        "place it"
    )


# ------------------------------------------------------------ bytes regexes


@pytest.mark.parametrize("regex", [b"w", re.compile(b"w")], ids=["bytes", "compiled"])
def test_a_bytes_regex_in_placements_or_meshes_is_a_problem_naming_the_entry(regex):
    mesh = mesh3()
    shown = "re.compile(b'w')" if isinstance(regex, re.Pattern) else "b'w'"
    want = f"the regex is bytes {shown}; give a str: r'w'"
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.plan(Counted, placements=[(r".*", None), (regex, None)], mesh=mesh)
    assert str(e.value.problems[0]) == f"placements[1]: {want}"
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.eqx.plan(EqxCounted, 0, [(regex, None), (r".*", None)], mesh=mesh)
    assert str(e.value.problems[0]) == f"placements[0]: {want}"
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.linen.plan(
            LinenCounted(), 0, jnp.ones((1, 8)), mesh=mesh, placements=[(regex, None)]
        )
    assert str(e.value.problems[0]) == f"placements[0]: {want}"
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.plan(Counted, meshes=[(regex, mesh)])
    assert str(e.value.problems[0]) == f"meshes[0]: {want}"


@pytest.mark.parametrize("regex", [b"w", re.compile(b"w")], ids=["bytes", "compiled"])
def test_a_bytes_regex_in_names_is_a_problem_naming_the_entry(regex, tmp_path):
    save_file = pytest.importorskip("safetensors.numpy").save_file
    save_file({"w": np.ones((8,), np.float32)}, str(tmp_path / "model.safetensors"))
    plan = meshinit.plan({"w": meshinit.param((8,), jax.nn.initializers.zeros, mesh=mesh3())})
    shown = "re.compile(b'w')" if isinstance(regex, re.Pattern) else "b'w'"
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.safetensors.load(plan, tmp_path, names=[(r"v", "v"), (regex, "w")])
    assert str(e.value.problems[0]) == f"names[1]: the regex is bytes {shown}; give a str: r'w'"


# ------------------------------------------------- EasyDeL's rules, unchanged


def test_easydel_rules_through_searched_place_as_the_dotted_table_does_nnx():
    mesh = mesh3()
    searched = meshinit.nnx.init(causal_lm, placements=meshinit.searched(EASYDEL_RULES), mesh=mesh)
    dotted = meshinit.nnx.init(causal_lm, placements=DOTTED, mesh=mesh)
    got, want = shardings_nnx(searched), shardings_nnx(dotted)
    assert got == want
    # and they are EasyDeL 0.3.0's: the embedding on P(("fsdp", "sp"), "tp")
    assert got["model.embed_tokens.embedding"] == NamedSharding(mesh, P(FSDP_SP, "tp"))
    assert got["model.layers.2.mlp.down_proj.kernel"] == NamedSharding(mesh, P("tp", FSDP_SP))
    assert got["model.norm.scale"] == NamedSharding(mesh, P())  # the catch-all
    assert_same_bits(bits_nnx(searched), bits_nnx(dotted))
    plan = meshinit.nnx.plan(causal_lm, placements=meshinit.searched(EASYDEL_RULES), mesh=mesh)
    planned = {e.path: e.sharding for e in plan.entries}
    # (a typed key is planned as its key data, one dimension more)
    assert {p: s for p, s in planned.items() if p != "rngs.default.key"} == {
        p: s for p, s in want.items() if p != "rngs.default.key"
    }


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        q = nn.Dense(x.shape[-1], use_bias=False, name="q_proj")
        k = nn.Dense(x.shape[-1], use_bias=False, name="k_proj")
        o = nn.Dense(x.shape[-1], use_bias=False, name="o_proj")
        x = x + nn.Dense(x.shape[-1], use_bias=False, name="o_proj_in")(q(x) * k(x))
        x = x + o(x)
        h = nn.Dense(4 * x.shape[-1], use_bias=False, name="gate_proj")(x)
        h = h * nn.Dense(4 * x.shape[-1], use_bias=False, name="up_proj")(x)
        return nn.RMSNorm(name="input_layernorm")(x + nn.Dense(x.shape[-1], name="down_proj")(h))


class LinenDecoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32, name="embed_tokens")(tokens)
        for i in range(2):
            x = LinenLayer(name=f"layers_{i}")(x)
        return x


class LinenCausalLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(64, use_bias=False, name="lm_head")(LinenDecoder(name="model")(tokens))


EASYDEL_TOKENS = jnp.zeros((2, 4), jnp.int32)


LINEN_RULES = (  # EasyDeL's form over linen's paths (params/model/layers_0/...)
    ("model/embed_tokens/embedding", P(FSDP_SP, "tp")),
    ("(q_proj|k_proj|gate_proj|up_proj)/kernel", P(FSDP_SP, "tp")),
    ("(o_proj|o_proj_in|down_proj)/kernel", P("tp", FSDP_SP)),
    ("lm_head/kernel", P(FSDP_SP, "tp")),
    (".*", P()),
)


LINEN_DOTTED = [
    (r"params\.model\.embed_tokens\.embedding", P(FSDP_SP, "tp")),
    (r"params\.model\.layers_\d\.(q_proj|k_proj|gate_proj|up_proj)\.kernel", P(FSDP_SP, "tp")),
    (r"params\.model\.layers_\d\.(o_proj|o_proj_in|down_proj)\.kernel", P("tp", FSDP_SP)),
    (r"params\.lm_head\.kernel", P(FSDP_SP, "tp")),
    (r".*", P()),
]


def test_easydel_rules_through_searched_place_as_the_dotted_table_does_linen():
    mesh = mesh3()

    def placed(table):
        variables = meshinit.linen.init(
            LinenCausalLM(), 0, EASYDEL_TOKENS, mesh=mesh, placements=table
        )
        flat = jax.tree_util.tree_flatten_with_path(nn.unbox(variables))[0]
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}, {
            jax.tree_util.keystr(k): v.sharding for k, v in flat
        }

    bits, got = placed(meshinit.searched(LINEN_RULES))
    want_bits, want = placed(LINEN_DOTTED)
    assert got == want
    assert got["['params']['model']['embed_tokens']['embedding']"].spec == P(FSDP_SP, "tp")
    assert_same_bits(bits, want_bits)


def test_easydel_rules_through_searched_place_as_the_dotted_table_does_eqx():
    mesh = mesh3()
    searched = meshinit.eqx.init(ECausalLM, 0, meshinit.searched(EASYDEL_RULES), mesh=mesh)
    dotted = meshinit.eqx.init(ECausalLM, 0, DOTTED, mesh=mesh)
    flat_s = jax.tree_util.tree_flatten_with_path(searched)[0]
    flat_d = jax.tree_util.tree_flatten_with_path(dotted)[0]
    assert [(k, v.sharding) for k, v in flat_s] == [(k, v.sharding) for k, v in flat_d]
    assert searched.model.embed_tokens.embedding.sharding == NamedSharding(mesh, P(FSDP_SP, "tp"))
    for (_, a), (_, b) in zip(flat_s, flat_d, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # a leaf no rule finds is named as a searched table spells it
    with pytest.raises(meshinit.PlanError, match=r"each regex is searched in the '/'-joined"):
        meshinit.eqx.plan(ECausalLM, 0, meshinit.searched(EASYDEL_RULES[:-1]), mesh=mesh)


def test_an_idle_entry_with_a_slash_says_how_to_pass_a_searched_table():
    mesh = mesh3()
    # EasyDeL's rules passed as they are: 8 of 9 match nothing, the catch-all replicates
    with pytest.warns(meshinit.UnusedPatternWarning) as record:
        plan = meshinit.nnx.plan(causal_lm, placements=list(EASYDEL_RULES), mesh=mesh)
    text = str(record[0].message)
    assert 'placements[1] r"self_attn/(q_proj|k_proj)/kernel"' in text
    assert "meshinit joins a path with dots (layers.0.mlp.kernel) and matches it with " in text
    assert "goes in unchanged as placements=meshinit.searched(rules)" in text
    # what the warning is about: every variable replicated by the catch-all
    assert all(e.sharding.is_fully_replicated for e in plan.entries)
    with pytest.warns(meshinit.UnusedPatternWarning, match=re.escape("meshinit.searched(rules)")):
        meshinit.eqx.plan(ECausalLM, 0, list(EASYDEL_RULES), mesh=mesh)
    with pytest.warns(meshinit.UnusedPatternWarning, match=re.escape("meshinit.searched(rules)")):
        meshinit.linen.plan(
            LinenCausalLM(), 0, EASYDEL_TOKENS, mesh=mesh, placements=list(LINEN_RULES)
        )
    # without a slash, no such hint; a searched table's idle entry says how it searched
    with pytest.warns(meshinit.UnusedPatternWarning) as record:
        meshinit.nnx.plan(causal_lm, placements=[(r"nothing", None), (r".*", None)], mesh=mesh)
    assert "meshinit.searched" not in str(record[0].message)
    with pytest.warns(meshinit.UnusedPatternWarning) as record:
        meshinit.nnx.plan(
            causal_lm, placements=meshinit.searched([("no/where", None), (".*", None)]), mesh=mesh
        )
    text = str(record[0].message)
    assert "Each regex is searched (re.search) in the '/'-joined path" in text
    assert "'lm_head/kernel'" in text


def test_searched_refuses_what_it_cannot_take():
    with pytest.raises(TypeError, match="meshinit.searched takes an ordered sequence"):
        meshinit.searched({"model/.*": P()})
    with pytest.raises(TypeError, match="sep must be a non-empty str"):
        meshinit.searched(EASYDEL_RULES, sep="")
    with pytest.raises(TypeError, match="meshes= is matched with re.fullmatch"):
        meshinit.nnx.plan(causal_lm, meshes=meshinit.searched([(".*", mesh3())]))
    # another separator, for rules written over "::"-joined paths
    plan = meshinit.nnx.plan(
        causal_lm,
        placements=meshinit.searched(
            [("lm_head::kernel$", P(FSDP_SP, "tp")), (".*", None)], sep="::"
        ),
        mesh=mesh3(),
    )
    assert {e.path: e.sharding.spec for e in plan.entries}["lm_head.kernel"] == P(FSDP_SP, "tp")
