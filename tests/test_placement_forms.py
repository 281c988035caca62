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
