import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from helpers import boxes_by_path, submesh
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

# MaxText's rule format: ordered (logical name, mesh axes) pairs.
MAXTEXT_RULES = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("norm", None),
)
VOCAB, EMBED, HEADS, HEAD_DIM, MLP = 64, 16, 4, 8, 32
FSDP_TENSOR = ("fsdp", "tensor")


def logical(init, names):
    return nn.with_logical_partitioning(init, names)


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        def proj(name, names, shape):
            return self.param(name, logical(nn.initializers.lecun_normal(), names), shape)

        q = proj("query", ("embed", "heads", "kv"), (EMBED, HEADS, HEAD_DIM))
        k = proj("key", ("embed", "heads", "kv"), (EMBED, HEADS, HEAD_DIM))
        v = proj("value", ("embed", "heads", "kv"), (EMBED, HEADS, HEAD_DIM))
        o = proj("out", ("heads", "kv", "embed"), (HEADS, HEAD_DIM, EMBED))
        qx, kx, vx = (jnp.einsum("bse,ehd->bshd", x, w) for w in (q, k, v))
        scores = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", qx, kx), axis=-1)
        return jnp.einsum("bhst,bthd,hde->bse", scores, vx, o)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.DenseGeneral
        h = dense(
            MLP,
            kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=logical(nn.initializers.normal(0.1), ("mlp",)),
            name="wi",
        )(x)
        return dense(
            EMBED,
            kernel_init=logical(nn.initializers.lecun_normal(), ("mlp", "embed")),
            use_bias=False,
            name="wo",
        )(nn.relu(h))


class Decoder(nn.Module):
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(
            VOCAB,
            EMBED,
            embedding_init=logical(nn.initializers.normal(1.0), ("vocab", "embed")),
            name="token_embedder",
        )
        x = embed(tokens)
        for i in range(self.layers):
            norm = logical(nn.initializers.ones, ("norm",))
            x = x + Attention(name=f"layers_{i}_attention")(
                nn.RMSNorm(scale_init=norm, name=f"layers_{i}_pre_norm")(x)
            )
            x = x + Mlp(name=f"layers_{i}_mlp")(
                nn.RMSNorm(scale_init=norm, name=f"layers_{i}_post_norm")(x)
            )
        x = nn.RMSNorm(scale_init=logical(nn.initializers.ones, ("norm",)), name="final_norm")(x)
        return embed.attend(x)


TOKENS = np.zeros((2, 8), np.int32)


@pytest.mark.parametrize(
    "explicit",  # the fast tier: jax.make_mesh's default, Explicit axes
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["explicit", "auto"],
)
def test_a_maxtext_like_model_gets_flax_own_shardings_and_eager_values(explicit, count_compiles):
    if explicit:
        mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    else:
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    model, key = Decoder(), jax.random.PRNGKey(0)
    with count_compiles() as compiles:
        variables = meshinit.linen.init(model, key, TOKENS, mesh=mesh, rules=MAXTEXT_RULES)
    # One executable per bucket of per-variable computations (rounds), none per layer;
    # tests/_engine/test_run.py checks that the count does not grow with depth.
    assert compiles.count <= 4, f"one mesh group, {compiles.count} compiles"

    # flax's own answer: the logical specs of the abstract variables, through its rules.
    abstract = jax.eval_shape(model.init, key, TOKENS)
    expected = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, MAXTEXT_RULES)
    eager = model.init(key, TOKENS)

    got, want, values = (
        boxes_by_path(variables),
        boxes_by_path(expected),
        boxes_by_path(eager),
    )
    assert set(got) == set(want) and len(got) == 2 * 9 + 2, sorted(got)
    assert type(variables["params"]["layers_0_mlp"]["wi"]["kernel"]) is nn.LogicallyPartitioned
    for path, box in got.items():
        array = box.value
        assert isinstance(array, jax.Array), path
        assert array.sharding == want[path], (path, array.sharding, want[path])
        np.testing.assert_allclose(array, values[path].value, rtol=1e-6, atol=1e-6, err_msg=path)
        assert box.names == values[path].names, path
    # Sharded as the rules say, not replicated by accident.
    kernel = got["params.layers_0_attention.query"].value
    assert kernel.sharding.spec == P("fsdp", "tensor", None)
    assert got["params.token_embedder.embedding"].value.sharding.spec == P("tensor", "fsdp")

    if explicit:
        return  # this model's embedding gather would need out_sharding= under Explicit axes
    # The unboxed variables apply like eager ones.
    out = model.apply(nn.unbox(variables), TOKENS)
    np.testing.assert_allclose(out, model.apply(eager, TOKENS), rtol=1e-5, atol=1e-5)


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        kernel = logical(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return nn.Dense(EMBED, kernel_init=kernel, use_bias=False)(x), None


class Scanned(nn.Module):
    """MaxText's scanned layers: nn.scan adds a leading "layers" axis to the names."""

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            ScanLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return layers(name="layers")(x, None)[0]


def test_scanned_layers_shard_with_the_added_axis():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    key, x = jax.random.PRNGKey(2), np.ones((2, EMBED), np.float32)
    variables = meshinit.linen.init(
        Scanned(), key, x, mesh=mesh, rules=(("layers", None), *MAXTEXT_RULES)
    )
    box = variables["params"]["layers"]["Dense_0"]["kernel"]
    assert box.names == ("layers", "embed", "mlp")
    assert box.value.sharding == NamedSharding(mesh, P(None, "fsdp", "tensor"))
    eager = Scanned().init(key, x)["params"]["layers"]["Dense_0"]["kernel"].value
    np.testing.assert_allclose(box.value, eager, rtol=1e-6, atol=1e-6)


class TwoStages(nn.Module):
    """A pipeline: each stage's parameters on their own mesh, named in the annotation."""

    first: Mesh
    second: Mesh

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(
            32,
            kernel_init=nn.with_partitioning(init, ("fsdp", "tensor"), mesh=self.first),
            bias_init=nn.with_partitioning(nn.initializers.zeros, ("tensor",), mesh=self.first),
            name="stage0",
        )(x)
        return nn.Dense(
            16,
            kernel_init=nn.with_partitioning(init, ("tensor", None), mesh=self.second),
            bias_init=nn.with_partitioning(nn.initializers.zeros, (None,), mesh=self.second),
            name="stage1",
        )(x)


def test_per_parameter_meshes_on_disjoint_submeshes(count_compiles):
    first, second = (
        submesh(range(4), (2, 2), FSDP_TENSOR),
        submesh(range(4, 8), (2, 2), FSDP_TENSOR),
    )
    model = TwoStages(first, second)
    key, x = jax.random.PRNGKey(1), np.ones((4, 16), np.float32)
    with count_compiles() as compiles:
        variables = meshinit.linen.init(model, key, x)
    assert compiles.count <= 2, f"two mesh groups, {compiles.count} compiles"
    params = variables["params"]
    expected = {
        ("stage0", "kernel"): NamedSharding(first, P("fsdp", "tensor")),
        ("stage0", "bias"): NamedSharding(first, P("tensor")),
        ("stage1", "kernel"): NamedSharding(second, P("tensor", None)),
        ("stage1", "bias"): NamedSharding(second, P(None)),
    }
    with pytest.raises(ValueError, match="incompatible devices"):
        model.init(key, x)  # flax itself cannot: the forward pass mixes the two meshes
    eager = TwoStages(None, None).init(key, x)["params"]  # the same values, unplaced
    for (layer, name), sharding in expected.items():
        box = params[layer][name]
        assert type(box) is nn.Partitioned and box.mesh is sharding.mesh
        assert box.value.sharding == sharding, (layer, name, box.value.sharding)
        ids = {d.id for d in box.value.sharding.device_set}
        assert ids == {d.id for d in sharding.mesh.devices.flat}, (layer, name, ids)
        np.testing.assert_allclose(box.value, eager[layer][name].value, rtol=1e-6, atol=1e-6)


def test_a_box_on_an_explicit_mesh_is_named_with_its_fix():
    # linen's unbox constrains to the box's own mesh, and jax refuses a constraint on
    # Explicit axes; meshinit leaves flax's classes alone, so it names the box instead.
    first, second = (
        submesh(range(4), (2, 2), FSDP_TENSOR, explicit=True),
        submesh(range(4, 8), (2, 2), FSDP_TENSOR, explicit=True),
    )
    model, key, x = TwoStages(first, second), jax.random.PRNGKey(1), np.ones((4, 16), np.float32)
    with pytest.raises(ValueError, match="Auto axes"):
        model.init(key, x)  # flax fails the same way
    with pytest.raises(meshinit.PlanError, match="Explicit") as err:
        meshinit.linen.init(model, key, x)
    (problem,) = err.value.problems
    assert problem.path == "params.stage0.kernel"
    assert "axis_types=(jax.sharding.AxisType.Auto,)" in problem.message
    assert "meshinit.linen.init(mesh=" in problem.message
    # the fix it names works: the same Explicit meshes, given to meshinit instead
    plain = TwoStages(None, None)
    variables = meshinit.linen.init(
        plain, key, x, meshes=[(r"params\.stage0\..*", first), (r"params\.stage1\..*", second)]
    )
    kernel = variables["params"]["stage1"]["kernel"].value
    assert {d.id for d in kernel.sharding.device_set} == set(range(4, 8))


def test_meshinit_never_modifies_flax_classes():
    before = {cls: dict(vars(cls)) for cls in (meta.Partitioned, nn.LogicallyPartitioned)}
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    meshinit.linen.init(
        TwoStages(
            submesh(range(4), (2, 2), FSDP_TENSOR), submesh(range(4, 8), (2, 2), FSDP_TENSOR)
        ),
        0,
        np.ones((4, 16)),
    )
    meshinit.linen.init(nn.Dense(8), 0, np.ones((2, 4)), mesh=mesh, default="replicated")
    assert {cls: dict(vars(cls)) for cls in before} == before


def test_logical_names_resolve_with_the_annotations_own_rules_and_report_problems():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    own = (("embed", "tensor"), ("mlp", "fsdp"))

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param(
                "w",
                nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"), rules=own),
                (8, 4),
            )
            u = self.param("u", logical(nn.initializers.ones, ("embed", "mlpp")), (8, 4))
            v = self.param("v", nn.with_partitioning(nn.initializers.ones, ("fsdp", None)), (3, 4))
            z = self.param("z", nn.with_partitioning(nn.initializers.ones, ("x",)), (4,))
            return x @ w + x @ u + v.sum() + z

    x = np.ones((1, 8), np.float32)
    with pytest.raises(meshinit.PlanError) as err:
        meshinit.linen.init(M(), jax.random.PRNGKey(0), x, mesh=mesh, rules=MAXTEXT_RULES)
    text = str(err.value)
    assert "params.u" in text and "'mlpp' has no rule" in text, text
    assert "params.z" in text and "'x' not in the mesh" in text, text
    assert "params.v: dimension 0 of size 3 is not divisible" in text, text
    assert "params.w" not in text, text


def test_a_logical_annotation_without_rules_or_mesh_is_a_plan_error():
    x = np.ones((1, 8), np.float32)
    dense = nn.Dense(4, kernel_init=logical(nn.initializers.ones, ("embed", "mlp")))
    with pytest.raises(meshinit.PlanError, match="params.kernel: .*no mesh"):
        meshinit.linen.init(dense, jax.random.PRNGKey(0), x, default="replicated")
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with pytest.raises(meshinit.PlanError, match="params.kernel: .*no rules"):
        meshinit.linen.init(dense, jax.random.PRNGKey(0), x, mesh=mesh, default="replicated")
    # flax's own rule context counts, as it does for linen.
    with nn.logical_axis_rules(MAXTEXT_RULES):
        variables = meshinit.linen.init(
            dense, jax.random.PRNGKey(0), x, mesh=mesh, default="replicated"
        )
    assert variables["params"]["kernel"].value.sharding.spec == P("fsdp", "tensor")


def test_context_mesh_typed_keys_rng_dicts_and_abstract_inputs():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            kernel = nn.with_partitioning(nn.initializers.normal(), ("fsdp", "tensor"))
            x = nn.Dense(8, kernel_init=kernel, use_bias=False)(x)
            return nn.Dropout(0.5, deterministic=not train)(x)

    model = Drop()
    key = jax.random.key(3)
    x = jnp.ones((2, 4))
    rngs = {"params": key, "dropout": jax.random.key(4)}
    eager = model.init(rngs, x, train=True)
    with jax.set_mesh(mesh):
        variables = meshinit.linen.init(
            model, rngs, jax.ShapeDtypeStruct((2, 4), jnp.float32), train=True
        )
    kernel = variables["params"]["Dense_0"]["kernel"].value
    assert kernel.sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    np.testing.assert_allclose(kernel, eager["params"]["Dense_0"]["kernel"].value, rtol=1e-6)
    # An int seed is jax.random.key(seed).
    seeded = meshinit.linen.init(model, 3, x, mesh=mesh, train=False)
    np.testing.assert_allclose(seeded["params"]["Dense_0"]["kernel"].value, kernel, rtol=1e-6)


def test_logical_annotations_with_their_own_mesh_and_rules():
    second = submesh(range(4, 8), (2, 2), FSDP_TENSOR)
    own = (("embed", "tensor"), ("mlp", "fsdp"))
    kernel = nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp"), mesh=second, rules=own
    )
    dense = nn.Dense(8, kernel_init=kernel, use_bias=False)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    key, x = jax.random.PRNGKey(5), np.ones((2, 4), np.float32)
    variables = meshinit.linen.init(dense, key, x, mesh=mesh, rules=MAXTEXT_RULES)
    placed = variables["params"]["kernel"].value
    assert placed.sharding == NamedSharding(second, P("tensor", "fsdp"))
    eager = nn.Dense(8, use_bias=False).init(key, x)["params"]["kernel"]
    np.testing.assert_allclose(placed, eager, rtol=1e-6, atol=1e-6)


def test_linen_unboxing_is_restored_after_init_even_when_it_fails():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

    auto = Mesh(mesh.devices, mesh.axis_names)  # linen constrains on Auto axes only

    def constrained() -> bool:
        def use(x):
            return nn.Partitioned(x, names=("fsdp", "tensor"), mesh=auto).unbox()

        return "sharding_constraint" in str(jax.make_jaxpr(use)(np.zeros((2, 4), np.float32)))

    with pytest.raises(meshinit.PlanError, match="params.kernel"):
        meshinit.linen.init(nn.Dense(4), jax.random.PRNGKey(0), np.ones((1, 2)), mesh=mesh)

    class Broken(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.param("w", nn.with_partitioning(nn.initializers.ones, (None,)), (2,))
            raise RuntimeError("broken module")

    with pytest.raises(RuntimeError, match="broken module"):
        meshinit.linen.init(Broken(), jax.random.PRNGKey(0), np.ones((1, 2)), mesh=mesh)
    assert constrained()  # flax's own unbox again, in this thread
