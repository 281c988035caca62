"""placements= in the forms users already have (issue 42, items 10, 11, 14 and 15).

- a table entry matching a variable that holds no array (an int, None) is a PlanError
  naming the path and the entry, in nnx, linen and eqx alike;
- a bytes regex in any table (placements=, meshes=, names=) is a Problem naming the entry;
- EasyDeL's rules (re.search on "/"-joined paths) go in unchanged through
  meshinit.searched, and a "/" in an idle full-match entry says how;
- a tree of shardings (flax's, a linen spec tree, an eqx Module of specs) or a rule
  ``(path, shape_dtype) -> axes`` places exactly what the same table places, and what
  flax's own jit places with those shardings.
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

FSDP_SP = ("fsdp", "sp")


def mesh3():
    """EasyDeL's axis names: (fsdp, sp, tp)."""
    return submesh(range(8), (2, 1, 4), ("fsdp", "sp", "tp"), explicit=True)


def shardings_nnx(module):
    return {
        ".".join(map(str, p)): v.get_value().sharding
        for p, v in nnx.to_flat_state(nnx.state(module))
    }


def bits_nnx(module):
    return {
        ".".join(map(str, p)): np.asarray(jax.random.key_data(v.get_value()))
        if jnp.issubdtype(v.get_value().dtype, jax.dtypes.prng_key)
        else np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(module))
    }


def assert_same_bits(got, want):
    assert got.keys() == want.keys()
    for path in got:
        assert got[path].dtype == want[path].dtype, path
        assert got[path].tobytes() == want[path].tobytes(), path


# ------------------------------------------------- an nnx model with EasyDeL's paths


class Attention(nnx.Module):
    def __init__(self, d, rngs):
        self.q_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)


class Mlp(nnx.Module):
    def __init__(self, d, rngs):
        self.gate_proj = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)


class Layer(nnx.Module):
    def __init__(self, d, rngs):
        self.self_attn = Attention(d, rngs)
        self.mlp = Mlp(d, rngs)
        self.input_layernorm = nnx.RMSNorm(d, rngs=rngs)


class Decoder(nnx.Module):
    def __init__(self, d, vocab, layers, rngs):
        self.embed_tokens = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([Layer(d, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)


class CausalLM(nnx.Module):
    """EasyDeL's layout: model.embed_tokens.embedding, model.layers.N.mlp.gate_proj.kernel,
    lm_head.kernel; no sharding metadata anywhere (EasyDeL keeps it in its rules)."""

    def __init__(self, rngs, d=32, vocab=64, layers=3):
        self.model = Decoder(d, vocab, layers, rngs)
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)
        self.rngs = rngs  # RNG state: a typed key and a counter, as EasyDeL models hold


def causal_lm():
    return CausalLM(nnx.Rngs(0))


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


# ----------------------------------------------------------------- item 10: int, None


class Counted(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((8, 8)))
        self.step = nnx.Variable(3)
        self.cache = nnx.Variable(None)


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


class EqxCounted(eqx.Module):
    w: jax.Array
    step: int
    cache: object

    def __init__(self, key):
        self.w = jax.random.normal(key, (8, 8))
        self.step = 3
        self.cache = None


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


class LinenCounted(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.variable("stats", "step", lambda: 3)
        return nn.Dense(8, use_bias=False)(x)


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


# ------------------------------------------------------------ item 11: bytes regexes


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


# ------------------------------------------------- item 14: EasyDeL's rules, unchanged


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
    # (a typed key is planned as its key data, one dimension more: issue 42's item 6)
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


TOKENS = jnp.zeros((2, 4), jnp.int32)

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
        variables = meshinit.linen.init(LinenCausalLM(), 0, TOKENS, mesh=mesh, placements=table)
        flat = jax.tree_util.tree_flatten_with_path(nn.unbox(variables))[0]
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}, {
            jax.tree_util.keystr(k): v.sharding for k, v in flat
        }

    bits, got = placed(meshinit.searched(LINEN_RULES))
    want_bits, want = placed(LINEN_DOTTED)
    assert got == want
    assert got["['params']['model']['embed_tokens']['embedding']"].spec == P(FSDP_SP, "tp")
    assert_same_bits(bits, want_bits)


class ELinear(eqx.Module):
    kernel: jax.Array

    def __init__(self, n_in, n_out, key):
        self.kernel = jax.random.normal(key, (n_in, n_out)) / n_in**0.5


class ENorm(eqx.Module):
    scale: jax.Array

    def __init__(self, d):
        self.scale = jnp.ones((d,))


class EAttention(eqx.Module):
    q_proj: ELinear
    k_proj: ELinear
    o_proj: ELinear

    def __init__(self, d, key):
        kq, kk, ko = jax.random.split(key, 3)
        self.q_proj, self.k_proj, self.o_proj = (
            ELinear(d, d, kq),
            ELinear(d, d, kk),
            ELinear(d, d, ko),
        )


class EMlp(eqx.Module):
    gate_proj: ELinear
    up_proj: ELinear
    down_proj: ELinear

    def __init__(self, d, key):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj, self.up_proj = ELinear(d, 4 * d, kg), ELinear(d, 4 * d, ku)
        self.down_proj = ELinear(4 * d, d, kd)


class ELayer(eqx.Module):
    self_attn: EAttention
    mlp: EMlp
    input_layernorm: ENorm

    def __init__(self, d, key):
        ka, km = jax.random.split(key)
        self.self_attn, self.mlp, self.input_layernorm = EAttention(d, ka), EMlp(d, km), ENorm(d)


class EEmbed(eqx.Module):
    embedding: jax.Array

    def __init__(self, vocab, d, key):
        self.embedding = jax.random.normal(key, (vocab, d))


class EDecoder(eqx.Module):
    embed_tokens: EEmbed
    layers: list
    norm: ENorm

    def __init__(self, d, vocab, layers, key):
        keys = jax.random.split(key, layers + 1)
        self.embed_tokens = EEmbed(vocab, d, keys[0])
        self.layers = [ELayer(d, k) for k in keys[1:]]
        self.norm = ENorm(d)


class ECausalLM(eqx.Module):
    """The same paths as CausalLM's, in equinox."""

    model: EDecoder
    lm_head: ELinear

    def __init__(self, key, d=32, vocab=64, layers=3):
        km, kh = jax.random.split(key)
        self.model, self.lm_head = EDecoder(d, vocab, layers, km), ELinear(d, vocab, kh)


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
        meshinit.linen.plan(LinenCausalLM(), 0, TOKENS, mesh=mesh, placements=list(LINEN_RULES))
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


# ---------------------------------------------- item 15: a tree of shardings, a rule


class Block(nnx.Module):
    """With ``sharded``, flax's own metadata says where each kernel goes; without, the
    same Module carries none (the spec tree then comes from outside)."""

    def __init__(self, rngs, sharded):
        init = nnx.initializers.lecun_normal()

        def kernel(names):
            return nnx.with_partitioning(init, names) if sharded else init

        self.up = nnx.Linear(32, 128, kernel_init=kernel(("fsdp", "tp")), rngs=rngs)
        self.down = nnx.Linear(128, 32, kernel_init=kernel(("tp", "fsdp")), rngs=rngs)
        self.norm = nnx.RMSNorm(32, rngs=rngs)


class Stack(nnx.Module):
    def __init__(self, rngs, sharded=False):
        self.blocks = nnx.List([Block(rngs, sharded) for _ in range(2)])
        self.rngs = rngs


BLOCK_TABLE = [
    (r"blocks\.\d\.up\.kernel", P("fsdp", "tp")),
    (r"blocks\.\d\.down\.kernel", P("tp", "fsdp")),
    (r".*", P()),
]


def flax_jit_with(factory, shardings):
    """flax's own answer: the Module made in nnx.jit, its state constrained to
    ``shardings`` (a State of NamedShardings), as flax's sharding guide does it
    (``reshard`` on Explicit axes, where jax asks for it)."""
    pure = nnx.to_pure_dict(shardings)
    explicit = jax.sharding.AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types
    constrain = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint

    @nnx.jit
    def create():
        model = factory()
        state = nnx.state(model)
        nnx.replace_by_pure_dict(state, constrain(nnx.to_pure_dict(state), pure))
        nnx.update(model, state)
        return model

    return create()


def same_placement(got, want, ndims, spelled_alike):
    """``==`` where jax spells the two alike, else the same placement
    (``is_equivalent_to``): inside nnx.jit, jax spells a constrained output as it
    likes, P(None,) for a replicated one on Explicit axes (flax's metadata: P()), and
    P("fsdp",) for P("fsdp", None) on Auto axes."""
    assert got.keys() == want.keys()
    for path in got:
        if spelled_alike:
            assert got[path] == want[path], path
        else:
            assert got[path].is_equivalent_to(want[path], ndims[path]), path


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_nnx_takes_flaxs_partition_spec_tree_and_places_as_a_table_and_flax_do(explicit):
    mesh = submesh(range(8), (2, 1, 4), ("fsdp", "sp", "tp"), explicit=explicit)
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: Stack(nnx.Rngs(0), sharded=True))
    specs = nnx.get_partition_spec(nnx.state(abstract))  # a State of PartitionSpecs

    def plain():
        return Stack(nnx.Rngs(0))  # no metadata: the tree says where

    tree = meshinit.nnx.init(plain, placements=specs, mesh=mesh)
    table = meshinit.nnx.init(plain, placements=BLOCK_TABLE, mesh=mesh)
    got = shardings_nnx(tree)
    assert got == shardings_nnx(table)
    assert got["blocks.1.down.kernel"] == NamedSharding(mesh, P("tp", "fsdp"))
    assert_same_bits(bits_nnx(tree), bits_nnx(table))
    # a State of NamedShardings (nnx.get_named_sharding): the mesh comes with it
    named = nnx.get_named_sharding(nnx.state(abstract), mesh)
    assert shardings_nnx(meshinit.nnx.init(plain, placements=named)) == got
    # flax's own: nnx.jit with the same shardings
    with jax.set_mesh(mesh):
        flax_made = flax_jit_with(plain, named)
    ndims = {p: v.ndim for p, v in bits_nnx(tree).items()}
    same_placement(shardings_nnx(flax_made), got, ndims, not explicit)
    for path, value in bits_nnx(flax_made).items():
        np.testing.assert_allclose(value, bits_nnx(tree)[path], rtol=1e-6, atol=1e-6)
    # and the metadata of a placed Variable says what was placed
    assert nnx.get_partition_spec(nnx.state(tree)).blocks[0].up.kernel.get_value() == P(
        "fsdp", "tp"
    )


class LinenBlocks(nn.Module):
    sharded: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()

        def kernel(names):
            return nn.with_partitioning(init, names) if self.sharded else init

        for i in range(2):
            h = nn.Dense(128, kernel_init=kernel(("fsdp", "tp")), name=f"up_{i}")(x)
            x = x + nn.Dense(32, kernel_init=kernel(("tp", "fsdp")), name=f"down_{i}")(h)
        return x


X = jnp.ones((2, 32))


def linen_leaves(variables):
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(variables))[0]
    return {".".join(str(k.key) for k in kp): v for kp, v in flat}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_linen_takes_a_spec_tree_and_places_as_a_table_and_jax_jit_do(explicit):
    mesh = submesh(range(8), (2, 1, 4), ("fsdp", "sp", "tp"), explicit=explicit)
    abstract = jax.eval_shape(LinenBlocks(sharded=True).init, jax.random.key(0), X)
    specs = nn.get_partition_spec(abstract)  # {"params": {...: PartitionSpec}}
    table = [
        (r"params\.up_\d\.kernel", P("fsdp", "tp")),
        (r"params\.down_\d\.kernel", P("tp", "fsdp")),
        (r".*", P()),
    ]
    tree = linen_leaves(meshinit.linen.init(LinenBlocks(), 0, X, mesh=mesh, placements=specs))
    tabled = linen_leaves(meshinit.linen.init(LinenBlocks(), 0, X, mesh=mesh, placements=table))
    got = {p: v.sharding for p, v in tree.items()}
    assert got == {p: v.sharding for p, v in tabled.items()}
    assert got["params.down_1.kernel"] == NamedSharding(mesh, P("tp", "fsdp"))
    assert_same_bits(
        {p: np.asarray(v) for p, v in tree.items()}, {p: np.asarray(v) for p, v in tabled.items()}
    )
    # jax's own: jax.jit(module.init) with those shardings as out_shardings
    named = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    made = jax.jit(LinenBlocks().init, out_shardings=named)(jax.random.key(0), X)
    ndims = {p: v.ndim for p, v in tree.items()}
    same_placement({p: v.sharding for p, v in linen_leaves(made).items()}, got, ndims, not explicit)


class EStack(eqx.Module):
    blocks: list

    def __init__(self, key):
        self.blocks = [ELayer(32, k) for k in jax.random.split(key, 2)]


def eqx_spec(path):
    if re.fullmatch(r"blocks\.\d\.mlp\.(gate|up)_proj\.kernel", path):
        return P("fsdp", "tp")
    if re.fullmatch(r"blocks\.\d\.mlp\.down_proj\.kernel", path):
        return P("tp", "fsdp")
    return P()


def test_eqx_takes_a_module_of_specs_and_places_as_a_table_and_jax_jit_do():
    mesh = submesh(range(8), (2, 1, 4), ("fsdp", "sp", "tp"))
    abstract = eqx.filter_eval_shape(EStack, jax.random.key(0))
    specs = jax.tree_util.tree_map_with_path(  # an EStack holding PartitionSpecs
        lambda kp, _: eqx_spec(jax.tree_util.keystr(kp, simple=True, separator=".")), abstract
    )
    table = [
        (r"blocks\.\d\.mlp\.(gate|up)_proj\.kernel", P("fsdp", "tp")),
        (r"blocks\.\d\.mlp\.down_proj\.kernel", P("tp", "fsdp")),
        (r".*", P()),
    ]
    tree = meshinit.eqx.init(EStack, 0, specs, mesh=mesh)
    tabled = meshinit.eqx.init(EStack, 0, table, mesh=mesh)
    named = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    made = jax.jit(EStack, out_shardings=named)(jax.random.key(0))
    for got, want, jitted in zip(*map(jax.tree.leaves, (tree, tabled, made)), strict=True):
        assert got.sharding == want.sharding == jitted.sharding
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert tree.blocks[1].mlp.down_proj.kernel.sharding == NamedSharding(mesh, P("tp", "fsdp"))
    # a Module of NamedShardings: the mesh comes with it
    again = meshinit.eqx.init(EStack, 0, named)
    assert [x.sharding for x in jax.tree.leaves(again)] == [
        x.sharding for x in jax.tree.leaves(tree)
    ]


def fsdp_rule(devices, min_bytes):
    """kauldron's FSDPSharding as a rule: the largest dimension the device count
    divides goes on 'fsdp'; an array under ``min_bytes`` (or a key) is replicated."""

    def rule(path, shape_dtype):
        if jnp.issubdtype(shape_dtype.dtype, jax.dtypes.prng_key):
            return None
        if shape_dtype.size * shape_dtype.dtype.itemsize < min_bytes:
            return None
        for dim in sorted(range(shape_dtype.ndim), key=lambda i: -shape_dtype.shape[i]):
            if shape_dtype.shape[dim] % devices == 0:
                return P(*("fsdp" if i == dim else None for i in range(shape_dtype.ndim)))
        return None

    return rule


def test_nnx_a_kauldron_like_rule_places_as_its_table_its_tree_and_flax_do():
    mesh = submesh(range(8), (8,), ("fsdp",))
    rule = fsdp_rule(8, min_bytes=256)
    asked = []

    def logged(path, shape_dtype):
        assert isinstance(path, str) and isinstance(shape_dtype, jax.ShapeDtypeStruct)
        asked.append(path)
        return rule(path, shape_dtype)

    by_rule = meshinit.nnx.init(causal_lm, placements=logged, mesh=mesh)
    got = shardings_nnx(by_rule)
    assert sorted(asked) == sorted(got)  # once per variable, with its dot-joined path
    assert got["model.embed_tokens.embedding"] == NamedSharding(mesh, P("fsdp", None))
    assert got["model.layers.0.mlp.gate_proj.kernel"] == NamedSharding(mesh, P(None, "fsdp"))
    assert got["model.norm.scale"] == NamedSharding(mesh, P())  # 128 bytes: replicated
    # the same placements as a table
    abstract = nnx.state(nnx.eval_shape(causal_lm))
    structs = {
        ".".join(map(str, p)): jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype)
        for p, v in nnx.to_flat_state(abstract)
    }
    table = [(re.escape(p), rule(p, s)) for p, s in structs.items()]
    tabled = meshinit.nnx.init(causal_lm, placements=table, mesh=mesh)
    assert shardings_nnx(tabled) == got
    assert_same_bits(bits_nnx(by_rule), bits_nnx(tabled))
    # jax.eval_shape plus the strategy: a tree of NamedShardings, and flax's jit with it
    named = nnx.map_state(
        lambda p, v: NamedSharding(mesh, rule(None, v.get_value()) or P()), abstract
    )
    assert shardings_nnx(meshinit.nnx.init(causal_lm, placements=named)) == got
    with jax.set_mesh(mesh):
        flax_made = flax_jit_with(causal_lm, named)
    ndims = {p: v.ndim for p, v in bits_nnx(by_rule).items()}
    same_placement(shardings_nnx(flax_made), got, ndims, spelled_alike=False)


def test_linen_and_eqx_take_the_rule_as_nnx_does():
    mesh = submesh(range(8), (8,), ("fsdp",))
    rule = fsdp_rule(8, min_bytes=256)
    variables = meshinit.linen.init(LinenBlocks(), 0, X, mesh=mesh, placements=rule)
    got = {p: v.sharding for p, v in linen_leaves(variables).items()}
    assert got["params.up_0.kernel"] == NamedSharding(mesh, P(None, "fsdp"))  # (32, 128)
    assert got["params.up_0.bias"] == NamedSharding(mesh, P("fsdp"))  # 512 B
    assert got["params.down_0.bias"] == NamedSharding(mesh, P())  # 128 B: replicated
    abstract = jax.eval_shape(LinenBlocks().init, jax.random.key(0), X)
    named = jax.tree_util.tree_map_with_path(
        lambda kp, s: NamedSharding(mesh, rule(None, s) or P()), abstract
    )
    made = jax.jit(LinenBlocks().init, out_shardings=named)(jax.random.key(0), X)
    assert {p: v.sharding for p, v in linen_leaves(made).items()} == got
    module = meshinit.eqx.init(EStack, 0, rule, mesh=mesh)
    named = jax.tree.map(
        lambda s: NamedSharding(mesh, rule(None, s) or P()),
        eqx.filter_eval_shape(EStack, jax.random.key(0)),
    )
    made = jax.jit(EStack, out_shardings=named)(jax.random.key(0))
    assert [x.sharding for x in jax.tree.leaves(module)] == [
        x.sharding for x in jax.tree.leaves(made)
    ]


def test_a_tree_that_does_not_fit_the_variables_is_one_plan_error_naming_the_paths():
    mesh = mesh3()
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: Stack(nnx.Rngs(0), sharded=True))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(abstract)))
    del specs["blocks"][1]["norm"]
    specs["bogus"] = P("fsdp")
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.plan(lambda: Stack(nnx.Rngs(0)), placements=specs, mesh=mesh)
    assert [str(p) for p in e.value.problems] == [
        "the placements tree has no leaf for 1 variable(s): blocks.1.norm.scale; give it the "
        "model's structure, with None for a replicated variable",
        "the placements tree has 1 leaf(s) at paths that are no variable's: bogus; the "
        "variables' paths are like blocks.0.down.bias, blocks.0.down.kernel, blocks.0.norm.scale",
    ]
    # linen: variables["params"]'s specs for the whole variables dict
    abstract_vars = jax.eval_shape(LinenBlocks(sharded=True).init, jax.random.key(0), X)
    specs = nn.get_partition_spec(abstract_vars)
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.linen.plan(LinenBlocks(), 0, X, mesh=mesh, placements=specs["params"])
    assert "the placements tree has no leaf for 8 variable(s): params.down_0.bias" in str(e.value)
    assert "(its paths lack the prefix 'params.')" in str(e.value)
    # eqx: another model's tree
    other = jax.tree.map(lambda _: P(), eqx.filter_eval_shape(EStack, jax.random.key(0)))
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.eqx.plan(ECausalLM, 0, other, mesh=mesh)
    text = str(e.value)
    assert "no leaf for 24 variable(s): model.embed_tokens.embedding" in text
    assert "at paths that are no variable's: blocks.0.self_attn.q_proj.kernel" in text
    # a leaf that is no sharding, at the variable's own path
    state = nnx.to_pure_dict(nnx.state(abstract))  # ShapeDtypeStructs, not shardings
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.plan(lambda: Stack(nnx.Rngs(0)), placements=state, mesh=mesh)
    assert str(e.value.problems[0]).startswith(
        "blocks.0.down.bias: the placements tree: got ShapeDtypeStruct"
    )
    assert str(e.value.problems[0]).endswith(
        "give a jax.sharding.NamedSharding, a PartitionSpec, a tuple of axes or None (replicated)"
    )


class Odd(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.a = nnx.Linear(6, 8, rngs=rngs)
        self.b = nnx.Linear(8, 8, rngs=rngs)
        self.c = nnx.Linear(8, 8, rngs=rngs)


def test_everything_a_rule_gives_that_does_not_fit_is_one_plan_error_naming_the_path():
    mesh = mesh3()
    answers = {
        "a.kernel": P("tp", None),  # 6 rows over tp=4
        "a.bias": 3,
        "b.kernel": ("nope", None),  # no rules: mesh axes
        "b.bias": "fsdp",  # a str, not a tuple
        "c.kernel": P("fsdp", None, None),  # rank 3 for a matrix
        "c.bias": None,
    }

    def rule(path, shape_dtype):
        return answers[path]

    with pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.plan(Odd, placements=rule, mesh=mesh)
    by_path = {p.path: p.message for p in e.value.problems}
    assert set(by_path) == {"a.kernel", "a.bias", "b.kernel", "b.bias", "c.kernel"}
    assert by_path["a.bias"].startswith("placements=rule: got int 3")
    assert "got int 3; give a jax.sharding.NamedSharding" in by_path["a.bias"]
    assert "axes must be None, a jax.sharding.PartitionSpec" in by_path["b.bias"]
    assert "for one dimension write ('fsdp',)" in by_path["b.bias"]
    assert "mesh axis name(s) 'nope' not in the mesh" in by_path["b.kernel"]
    assert by_path["a.kernel"].startswith("dimension 0 of size 6 is not divisible by mesh axes")
    assert "have 3 entries" in by_path["c.kernel"]
    # a rule that raises: its own error, saying for which path
    with pytest.raises(KeyError) as e:
        meshinit.nnx.plan(Odd, placements=lambda path, s: {}[path], mesh=mesh)
    assert e.value.__notes__ == [
        "raised by placements=<lambda> for ('a.bias', ShapeDtypeStruct(shape=(8,), dtype=float32))"
    ]
    # eqx alike
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.eqx.plan(
            EStack, 0, lambda path, s: P("nope") if "gate" in path else None, mesh=mesh
        )
    assert {p.path for p in e.value.problems} == {
        f"blocks.{i}.mlp.gate_proj.kernel" for i in range(2)
    }


def test_a_rules_named_sharding_gives_the_mesh_as_a_tables_mesh_does():
    s0 = submesh(range(4), (2, 2), ("fsdp", "tp"))
    s1 = submesh(range(4, 8), (2, 2), ("fsdp", "tp"))

    def staged(path, shape_dtype):
        mesh = s0 if path.startswith("a.") else s1
        return NamedSharding(mesh, P("fsdp") if path.endswith("kernel") else P())

    model = meshinit.nnx.init(Odd, placements=staged)
    table = [
        (r"a\.kernel", P("fsdp"), s0),
        (r"a\..*", P(), s0),
        (r".*kernel", P("fsdp"), s1),
        (r".*", P(), s1),
    ]
    assert shardings_nnx(model) == shardings_nnx(meshinit.nnx.init(Odd, placements=table))
    assert {d.id for d in model.c.kernel.get_value().devices()} == {4, 5, 6, 7}
    assert_same_bits(bits_nnx(model), bits_nnx(meshinit.nnx.init(Odd)))


# ------------------------------------------- a model that is a list: its tree is a list


def elayers(key, container=list):
    """An equinox model that is a list (or tuple) of layers, as eqx.nn.Sequential holds."""
    return container(ELayer(32, k) for k in jax.random.split(key, 2))


@pytest.mark.parametrize("container", [list, tuple])
def test_eqx_a_model_that_is_a_list_of_layers_takes_its_spec_tree_as_jax_jit_does(container):
    mesh = submesh(range(8), (2, 1, 4), ("fsdp", "sp", "tp"))

    def factory(key):
        return elayers(key, container)

    abstract = eqx.filter_eval_shape(factory, jax.random.key(0))
    assert type(abstract) is container
    specs = jax.tree_util.tree_map_with_path(  # a list of ELayers holding PartitionSpecs
        lambda kp, _: eqx_spec("blocks." + jax.tree_util.keystr(kp, simple=True, separator=".")),
        abstract,
    )
    table = [
        (r"\d\.mlp\.(gate|up)_proj\.kernel", P("fsdp", "tp")),
        (r"\d\.mlp\.down_proj\.kernel", P("tp", "fsdp")),
        (r".*", P()),
    ]
    tree = meshinit.eqx.init(factory, 0, specs, mesh=mesh)
    tabled = meshinit.eqx.init(factory, 0, table, mesh=mesh)
    named = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    made = jax.jit(factory, out_shardings=named)(jax.random.key(0))
    for got, want, jitted in zip(*map(jax.tree.leaves, (tree, tabled, made)), strict=True):
        assert got.sharding == want.sharding == jitted.sharding
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert tree[1].mlp.down_proj.kernel.sharding == NamedSharding(mesh, P("tp", "fsdp"))
    # a list of NamedShardings: the mesh comes with it
    again = meshinit.eqx.init(factory, 0, named)
    assert [x.sharding for x in jax.tree.leaves(again)] == [
        x.sharding for x in jax.tree.leaves(tree)
    ]
    # a list led by a regex stays a table: one entry not wrapped in its list, or a tree
    # leaf among entries, is a table's problem
    for placements, want in [
        ((r".*", None), r"placements\[0\] must be \(regex, axes\), .*; got '\.\*'"),
        ([(r".*", P()), {"0": P()}], r"placements\[1\] must be \(regex, axes\), .*; got \{'0'"),
    ]:
        with pytest.raises(meshinit.PlanError, match=want):
            meshinit.eqx.plan(factory, 0, placements, mesh=mesh)


def nnx_layers(sharded=False):
    """An nnx model that is a list of layers (nnx.List)."""
    rngs = nnx.Rngs(0)
    return nnx.List([Block(rngs, sharded) for _ in range(2)])


def test_nnx_a_list_of_layers_takes_its_spec_tree_as_a_list_as_flax_gives_it():
    mesh = mesh3()
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: nnx_layers(sharded=True))
    state = nnx.get_partition_spec(nnx.state(abstract))  # an nnx.State keyed 0, 1
    as_list = [nnx.to_pure_dict(state)[i] for i in range(2)]  # the same tree, list-rooted
    want = shardings_nnx(meshinit.nnx.init(nnx_layers, placements=state, mesh=mesh))
    model = meshinit.nnx.init(nnx_layers, placements=as_list, mesh=mesh)
    assert shardings_nnx(model) == want
    assert want["1.down.kernel"] == NamedSharding(mesh, P("tp", "fsdp"))
    # and as flax's own tools say for the annotated twin
    named = nnx.get_named_sharding(nnx.state(abstract), mesh)
    assert model[1].up.kernel.get_value().sharding == named[1]["up"]["kernel"].get_value()
    # a Module of specs (nnx.get_partition_spec of the Module): the same
    module_specs = nnx.get_partition_spec(abstract)
    assert isinstance(module_specs, nnx.List)
    got = meshinit.nnx.init(nnx_layers, placements=module_specs, mesh=mesh)
    assert shardings_nnx(got) == want


@pytest.mark.parametrize(
    "placements, holds",
    [
        ([1, 2], r"int 1 at placements\[0\]"),
        ([[]], r"list \[\] at placements\[0\]"),
        (  # the model's abstract values given for its shardings
            [jax.ShapeDtypeStruct((8,), jnp.float32)],
            r"ShapeDtypeStruct\(shape=\(8,\), dtype=float32\) at placements\[0\]",
        ),
    ],
    ids=["ints", "empty", "structs"],
)
@pytest.mark.parametrize("adapter", ["nnx", "linen", "eqx"])
def test_a_sequence_neither_a_table_nor_a_tree_names_both_forms(adapter, placements, holds):
    mesh = mesh3()
    want = (
        r"placements is a list of neither table entries nor shardings: a table is an ordered "
        r"sequence of \(regex, axes\), .* tuples \(first match wins\); a tree of shardings has "
        r"the model's structure with a NamedSharding, PartitionSpec or None per array; this "
        rf"one holds {holds}$"
    )
    with pytest.raises(TypeError, match=want):
        if adapter == "nnx":
            meshinit.nnx.plan(Counted, placements=placements, mesh=mesh)
        elif adapter == "linen":
            meshinit.linen.plan(
                LinenCounted(), 0, jnp.ones((1, 8)), mesh=mesh, placements=placements
            )
        else:
            meshinit.eqx.plan(EqxCounted, 0, placements, mesh=mesh)


# ------------------------------------- a replicated placement without a mesh of its own


class DocsMLP(nnx.Module):
    """docs/nnx.md's model: unannotated, (64, 256) and (256, 64) with biases."""

    def __init__(self, rngs):
        self.up = nnx.Linear(64, 256, rngs=rngs)
        self.down = nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
        return self.down(self.up(x))


def docs_mlp():
    return DocsMLP(nnx.Rngs(0))


def docs_fsdp(mesh):
    """docs/nnx.md's rule: a NamedSharding on 'fsdp' along the largest dimension the
    device count divides; None (replicated) below 1 KiB or where none divides."""

    def fsdp(path, shape_dtype):
        if shape_dtype.size * shape_dtype.dtype.itemsize < 1024:
            return None
        dims = sorted(range(shape_dtype.ndim), key=lambda i: -shape_dtype.shape[i])
        dim = next((i for i in dims if shape_dtype.shape[i] % 8 == 0), None)
        if dim is None:
            return None
        return NamedSharding(
            mesh, P(*("fsdp" if i == dim else None for i in range(shape_dtype.ndim)))
        )

    return fsdp


def test_nnx_a_rules_none_replicates_on_the_mesh_its_other_answers_name_as_flax_does():
    mesh = submesh(range(8), (8,), ("fsdp",))  # Auto axes: the forward runs unannotated
    rule = docs_fsdp(mesh)
    model = meshinit.nnx.init(docs_mlp, placements=rule)  # no mesh=: the rule's mesh
    got = shardings_nnx(model)
    assert got["down.bias"] == NamedSharding(mesh, P())  # 256 B: the rule said None
    assert got["down.kernel"] == NamedSharding(mesh, P("fsdp", None))
    # flax's own: nnx.jit with the rule's shardings, None as P() on the rule's mesh
    abstract = nnx.state(nnx.eval_shape(docs_mlp))
    named = nnx.map_state(
        lambda p, v: rule(None, v.get_value()) or NamedSharding(mesh, P()), abstract
    )
    with jax.set_mesh(mesh):
        flax_made = flax_jit_with(docs_mlp, named)
    ndims = {p: v.ndim for p, v in bits_nnx(model).items()}
    same_placement(shardings_nnx(flax_made), got, ndims, spelled_alike=False)
    # one model, one mesh: a jitted step takes it (it was "incompatible devices")
    out = nnx.jit(lambda m, x: m(x))(model, jnp.ones((8, 64)))
    assert out.sharding.mesh == mesh
    # a tree of NamedShardings and None: the same
    tree = nnx.map_state(lambda p, v: rule(None, v.get_value()), abstract)
    assert shardings_nnx(meshinit.nnx.init(docs_mlp, placements=tree)) == got


def test_linen_and_eqx_replicate_a_none_on_the_mesh_the_others_name_as_jax_jit_does():
    mesh = submesh(range(8), (8,), ("fsdp",))
    rule = docs_fsdp(mesh)

    def named(structs):  # jax's answer: the rule's shardings, None as P() on its mesh
        return jax.tree.map(lambda s: rule(None, s) or NamedSharding(mesh, P()), structs)

    abstract = jax.eval_shape(LinenBlocks().init, jax.random.key(0), X)
    made = jax.jit(LinenBlocks().init, out_shardings=named(abstract))(jax.random.key(0), X)
    want = {p: v.sharding for p, v in linen_leaves(made).items()}
    assert want["params.down_0.bias"] == NamedSharding(mesh, P())  # 128 B: None
    tree = jax.tree.map(lambda s: rule(None, s), abstract)  # NamedShardings and None
    for placements in (rule, tree):
        variables = meshinit.linen.init(LinenBlocks(), 0, X, placements=placements)
        assert {p: v.sharding for p, v in linen_leaves(variables).items()} == want
    abstract = eqx.filter_eval_shape(EStack, jax.random.key(0))
    made = jax.jit(EStack, out_shardings=named(abstract))(jax.random.key(0))
    want = [x.sharding for x in jax.tree.leaves(made)]
    for placements in (rule, jax.tree.map(lambda s: rule(None, s), abstract)):
        module = meshinit.eqx.init(EStack, 0, placements)  # it was "no mesh for the leaves"
        assert [x.sharding for x in jax.tree.leaves(module)] == want


def plan_with(adapter, placements, **kwargs):
    """``adapter``'s plan of a model of two Linears (nnx: a, b; linen: params.a, params.b;
    eqx: a, b)."""
    if adapter == "nnx":

        class Two(nnx.Module):
            def __init__(self):
                rngs = nnx.Rngs(0)
                self.a = nnx.Linear(8, 8, rngs=rngs)
                self.b = nnx.Linear(8, 8, rngs=rngs)

        return meshinit.nnx.plan(Two, placements=placements, **kwargs)
    if adapter == "linen":

        class Two(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(8, name="b")(nn.Dense(8, name="a")(x))

        return meshinit.linen.plan(Two(), 0, jnp.ones((1, 8)), placements=placements, **kwargs)

    def two(key):
        ka, kb = jax.random.split(key)
        return {"a": eqx.nn.Linear(8, 8, key=ka), "b": eqx.nn.Linear(8, 8, key=kb)}

    return meshinit.eqx.plan(two, 0, placements, **kwargs)


@pytest.mark.parametrize("adapter", ["nnx", "linen", "eqx"])
def test_a_replicated_placement_with_no_mesh_or_several_is_one_plan_error_naming_paths(adapter):
    s0, s1 = submesh(range(4), (2, 2), ("fsdp", "tp")), submesh(range(4, 8), (2, 2), ("fsdp", "tp"))
    prefix = "params." if adapter == "linen" else ""
    call = f"meshinit.{adapter}.plan"
    fix = f"pass mesh= to {call}, call under meshinit.defaults(mesh=...) or jax.set_mesh, or "

    def replicated(path, shape_dtype):
        return None

    with pytest.raises(meshinit.PlanError) as e:
        plan_with(adapter, replicated)
    # every array, in each framework's order (eqx's Linear: weight, then bias)
    names = ("weight", "bias") if adapter == "eqx" else ("bias", "kernel")
    paths = ", ".join(f"{prefix}{layer}.{name}" for layer in "ab" for name in names)
    assert [str(p) for p in e.value.problems] == [
        f"placements=replicated: no mesh for the 4 variable(s) it replicates ({paths}), and "
        f"no placement names one; {fix}return a NamedSharding"
    ]

    def staged(path, shape_dtype):  # pipeline stages: which one is a bias's is unclear
        if path.endswith("bias"):
            return None
        return NamedSharding(s0 if path.startswith(f"{prefix}a.") else s1, P("fsdp"))

    with pytest.raises(meshinit.PlanError) as e:
        plan_with(adapter, staged)
    assert [str(p) for p in e.value.problems] == [
        f"placements=staged: no mesh for the 2 variable(s) it replicates ({prefix}a.bias, "
        f"{prefix}b.bias), and the placements name 2 meshes (Mesh(fsdp=2, tp=2; Auto; "
        f"devices 0-3); Mesh(fsdp=2, tp=2; Auto; devices 4-7)), so which is unclear; "
        f"{fix}return a NamedSharding"
    ]
    # a table entry alike
    table = [(r".*", None)]
    with pytest.raises(meshinit.PlanError, match=r'placements\[0\] r"\.\*": no mesh for the 4'):
        plan_with(adapter, table)
    # the fix: mesh= (or the one mesh a table names)
    plan = plan_with(adapter, staged, mesh=s1)
    assert {e.path: e.sharding for e in plan.entries}[f"{prefix}a.bias"].mesh == s1
    plan = plan_with(adapter, [(r".*kernel|.*weight", P("fsdp"), s0), (r".*", None)])
    assert {e.sharding.mesh for e in plan.entries} == {s0}
