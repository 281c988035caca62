"""A placement that replicates (None, ``P()``) without a mesh of its own, where the call
names none: on the one mesh the other placements name, as flax and jax.jit replicate;
with none or several, one PlanError naming the paths."""

import equinox as eqx
import flax.linen as nn
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
    bits_nnx,
    flax_jit_with,
    linen_leaves,
    same_placement,
    shardings_nnx,
)

import meshinit

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
