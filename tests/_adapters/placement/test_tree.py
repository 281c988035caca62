"""``placements=`` as a tree of shardings (flax's ``nnx.get_partition_spec``, a linen
spec tree, an eqx Module of specs, a list for a model that is a list of layers): it
places exactly what the same table places, and what flax's own jit places with those
shardings; a tree that does not fit the variables is one PlanError naming the paths."""

import re

import equinox as eqx
import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from helpers import submesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from placement_models import (
    ECausalLM,
    ELayer,
    EStack,
    LinenBlocks,
    X,
    assert_same_bits,
    bits_nnx,
    flax_jit_with,
    linen_leaves,
    mesh3,
    same_placement,
    shardings_nnx,
)

import meshinit

# ---------------------------------------------- a tree of shardings, a rule


class TreeBlock(nnx.Module):
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
        self.blocks = nnx.List([TreeBlock(rngs, sharded) for _ in range(2)])
        self.rngs = rngs


BLOCK_TABLE = [
    (r"blocks\.\d\.up\.kernel", P("fsdp", "tp")),
    (r"blocks\.\d\.down\.kernel", P("tp", "fsdp")),
    (r".*", P()),
]


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


# ------------------------------------------- a model that is a list: its tree is a list


def elayers(key, container=list):
    """An equinox model that is a list (or tuple) of layers, as eqx.nn.Sequential holds."""
    return container(ELayer(32, k) for k in jax.random.split(key, 2))


@pytest.mark.parametrize(
    "container",
    [list, pytest.param(tuple, marks=pytest.mark.slow)],  # a tuple: in "all"
)
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
    return nnx.List([TreeBlock(rngs, sharded) for _ in range(2)])


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
