"""``placements=`` as a rule ``(path, shape_dtype) -> axes or NamedSharding`` (kauldron's
``FSDPSharding`` is one): it places what its table, its tree and flax place, and
everything it gives that does not fit is one PlanError naming the path."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import submesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from placement_models import (
    EStack,
    LinenBlocks,
    X,
    assert_same_bits,
    bits_nnx,
    causal_lm,
    flax_jit_with,
    linen_leaves,
    mesh3,
    same_placement,
    shardings_nnx,
)

import meshinit


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
