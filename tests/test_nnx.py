import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from helpers import lecun, mesh8
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit


def meshes(explicit):
    if explicit:
        return jax.make_mesh
    return lambda shape, names, devices=None: Mesh(
        np.array(devices or jax.devices()).reshape(shape), names
    )


def issue_5127_model(explicit):
    """The model from flax #5127, written the way flax users write it today."""
    make = meshes(explicit)
    mesh1, rules1 = make((2, 4), ("a", "b")), (("A", "a"), ("B", "b"))
    mesh2, rules2 = make((2, 2, 2), ("x", "y", "z")), (("X", "x"), ("Y", "y"), ("Z", "z"))
    mesh3, rules3 = make((8,), ("c",)), (("C", "c"),)

    class Model(nnx.Module):
        def __init__(self):
            self.small_linear1 = nnx.Param(
                jnp.ones((16, 16)), sharding=("A", "B"), mesh=mesh1, sharding_rules=rules1
            )
            self.small_linear2 = nnx.Param(
                jnp.ones((16, 16, 16)), sharding=("X", "Y", "Z"), mesh=mesh2, sharding_rules=rules2
            )
            self.small_linear3 = nnx.Param(
                jnp.ones((16, 16)), sharding=("C",), mesh=mesh3, sharding_rules=rules3
            )

    return Model


NAMES = ["small_linear1", "small_linear2", "small_linear3"]


def assert_same_placement(got, want):
    """Same mesh object and an equivalent spec (meshinit pads specs to full length)."""
    assert isinstance(got, NamedSharding), got
    assert got.mesh is want.mesh, (got, want)
    assert got.is_equivalent_to(want, len(want.spec) or 1), (got, want)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("context", [False, True])
def test_issue_5127_model_gets_flax_eager_shardings(explicit, context):
    Model = issue_5127_model(explicit)
    ref = Model()  # flax outside jit: the shardings it describes
    if context:
        with jax.set_mesh(meshes(explicit)((4, 2), ("data", "context"))):
            model = meshinit.nnx.init(Model)
    else:
        model = meshinit.nnx.init(Model)
    for name in NAMES:
        got, want = getattr(model, name).get_value(), getattr(ref, name).get_value()
        assert_same_placement(got.sharding, want.sharding)
        np.testing.assert_array_equal(got, want)
    spec = nnx.get_partition_spec(nnx.state(model))
    assert spec["small_linear3"].get_value() == P("c")  # flax's own tools agree


def stage_model(explicit):
    make = meshes(explicit)
    stage0 = make((2, 2), ("fsdp", "tensor"), devices=jax.devices()[:4])
    stage1 = make((2, 2), ("fsdp", "tensor"), devices=jax.devices()[4:])

    class Stages(nnx.Module):
        def __init__(self, rngs):
            meta = [{"out_sharding": ("fsdp", "tensor"), "mesh": m} for m in (stage0, stage1)]
            self.first = nnx.Linear(32, 64, rngs=rngs, kernel_metadata=meta[0])
            self.second = nnx.Linear(
                64,
                32,
                rngs=rngs,
                kernel_metadata=meta[1],
                bias_metadata={"out_sharding": ("tensor",), "mesh": stage1},
            )
            self.plain = nnx.Param(jax.random.normal(rngs.params(), (8,)))  # no metadata

    return Stages, stage0, stage1


@pytest.mark.parametrize("explicit", [False, True])
def test_disjoint_submeshes_with_random_init_equal_eager_construction(explicit):
    Stages, stage0, stage1 = stage_model(explicit)
    with nnx.use_eager_sharding(False):  # the values eager construction gives
        ref = stage_model(explicit=True)[0](nnx.Rngs(7))  # (with Auto axes flax fails eagerly)
    context = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(context):
        # flax cannot build it under a context mesh
        with pytest.raises(
            (ValueError, AssertionError), match="incompatible devices|acts as an assert"
        ):
            Stages(nnx.Rngs(7))
        model = meshinit.nnx.init(lambda: Stages(nnx.Rngs(7)))
    k0, k1 = model.first.kernel.get_value(), model.second.kernel.get_value()
    assert k0.sharding == NamedSharding(stage0, P("fsdp", "tensor"))
    assert k1.sharding == NamedSharding(stage1, P("fsdp", "tensor"))
    assert model.second.bias.get_value().sharding == NamedSharding(stage1, P("tensor"))
    for got, want in [
        (k0, ref.first.kernel),
        (k1, ref.second.kernel),
        (model.plain.get_value(), ref.plain),
    ]:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.get_value()))
    # Unannotated Variables are replicated on the context mesh.
    # (spelled P(), as nnx.get_named_sharding says)
    assert model.plain.get_value().sharding == NamedSharding(context, P())
    assert model.first.bias.get_value().sharding == NamedSharding(context, P())


def test_unannotated_variables_go_to_the_default_device_without_a_context():
    Stages, _, _ = stage_model(True)
    model = meshinit.nnx.init(lambda: Stages(nnx.Rngs(0)))
    sharding = model.plain.get_value().sharding
    assert sharding.mesh.devices.shape == () and sharding.mesh.devices.item() == jax.devices()[0]


def test_one_compiled_computation_per_mesh_group(count_compiles):
    Stages, _, _ = stage_model(True)
    meshinit.clear_cache()
    with count_compiles() as c:
        meshinit.nnx.init(lambda: Stages(nnx.Rngs(0)))
    # stage0's kernel, stage1's kernel and the default device's random `plain`; the
    # biases (zeros) come from the host, and the trace compiles nothing
    assert c.count == 3
    with count_compiles() as again:
        meshinit.nnx.init(lambda: Stages(nnx.Rngs(1)))
    assert again.count == 0  # the same computations with other keys: all cached


def test_a_name_that_is_not_a_mesh_axis_is_a_plan_error_naming_the_variable():
    mesh = jax.make_mesh((2, 4), ("a", "b"))

    class Model(nnx.Module):
        def __init__(self):
            self.inner = nnx.Dict(
                w=nnx.Param(
                    jnp.ones((8, 8)),
                    out_sharding=("a", "B"),
                    mesh=mesh,
                    sharding_rules=(("A", "a"),),
                )
            )

    with pytest.raises(
        meshinit.PlanError,
        match=r"inner.w: logical axis 'B' in its sharding \('a', 'B'\) has no rule in its "
        r"sharding_rules and is not a mesh axis",
    ):
        meshinit.nnx.init(Model)


def test_a_factory_using_outside_rngs_gets_a_clear_error():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="must build its own nnx.Rngs"):
        meshinit.nnx.init(lambda: nnx.Linear(4, 4, rngs=rngs))


def test_a_factory_reusing_a_module_it_built_before_gets_a_clear_error():
    # Caching the Module in outside state leaks the first trace's tracers into the next.
    cache = []

    def factory():
        if not cache:
            cache.append(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
        return cache[0]

    meshinit.nnx.init(factory)
    with pytest.raises(ValueError, match="must build its own nnx.Rngs and must not touch"):
        meshinit.nnx.init(factory)


LAYER_RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("layers", None))


class Block(nnx.Module):
    def __init__(self):
        self.up = nnx.Param(meshinit.param((64, 256), lecun(), axes=("embed", "mlp")))
        self.norm = nnx.Param(meshinit.param((64,), jax.nn.initializers.ones, axes=("embed",)))


class SpecModel(nnx.Module):
    def __init__(self, mesh, n=2):
        with meshinit.defaults(mesh=mesh, rules=LAYER_RULES):
            self.layers = nnx.List([Block() for _ in range(n)])
            self.head = nnx.Param(meshinit.param((64, 128), lecun(), axes=("embed", None)))
        self.rngs = nnx.Rngs(3)


def test_spec_module_materializes_exactly_and_keeps_metadata(new_arrays):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with new_arrays() as made:
        module = SpecModel(mesh)
    assert len(made) <= 2  # only the Rngs' key and count
    model = meshinit.nnx.materialize(module, 0)
    assert isinstance(module.head.get_value(), meshinit.ParamSpec)  # input left as it was
    up = model.layers[1].up
    assert up.get_value().sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    assert up.get_metadata()["logical_axes"] == ("embed", "mlp")
    specs = nnx.get_partition_spec(nnx.state(model))
    assert specs["layers"][1]["up"].get_value() == P("fsdp", "tensor")
    assert specs["head"].get_value() == P("fsdp", None)
    # RNG state passes through unchanged
    assert np.array_equal(
        jax.random.key_data(model.rngs.default.key.get_value()),
        jax.random.key_data(module.rngs.default.key.get_value()),
    )


def test_spec_module_values_equal_a_dict_with_the_same_paths():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    model = meshinit.nnx.materialize(SpecModel(mesh), 5)
    with meshinit.defaults(mesh=jax.make_mesh((4, 2), ("fsdp", "tensor")), rules=LAYER_RULES):
        tree = {
            "layers": [
                {
                    "up": meshinit.param((64, 256), lecun(), axes=("embed", "mlp")),
                    "norm": meshinit.param((64,), jax.nn.initializers.ones, axes=("embed",)),
                }
                for _ in range(2)
            ],
            "head": meshinit.param((64, 128), lecun(), axes=("embed", None)),
        }
    values = meshinit.init(tree, 5)
    for i in range(2):
        assert np.array_equal(model.layers[i].up.get_value(), values["layers"][i]["up"])
    assert np.array_equal(model.head.get_value(), values["head"])


def test_optimizer_step_right_after_materialization_keeps_shardings():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    model = meshinit.nnx.materialize(SpecModel(mesh), 0)
    before = jax.tree.map(lambda x: x.sharding, nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x):
        def loss_fn(model):
            h = x @ model.layers[0].up.get_value()
            return jnp.mean(h**2) + jnp.mean((x @ model.head.get_value()) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    x = jnp.ones((4, 64))
    old = np.asarray(model.head.get_value())
    loss = train_step(model, optimizer, x)
    assert np.isfinite(float(loss))
    assert not np.array_equal(np.asarray(model.head.get_value()), old)  # it trained
    after = jax.tree.map(lambda x: x.sharding, nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert a == b


def test_missing_flax_names_the_extra():
    code = (
        "import sys; sys.modules['flax'] = None\n"
        "import meshinit\n"
        "try:\n    meshinit.nnx\n"
        "except ImportError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'meshinit[nnx]'" in r.stdout, r.stdout + r.stderr


def test_importing_meshinit_does_not_import_flax():
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, meshinit; print('flax' in sys.modules, 'equinox' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.strip() == "False False", r.stdout + r.stderr


warnings.filterwarnings("ignore", category=DeprecationWarning, module="flax")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("key", ["out_sharding", "sharding", "sharding_names"])
def test_every_flax_metadata_spelling_without_a_mesh_uses_the_context_mesh(key):
    context = jax.make_mesh((2, 4), ("data", "model"))

    class Model(nnx.Module):
        def __init__(self):
            # a shorter tuple: the last dimension pads with None, as in flax
            self.w = nnx.Param(jnp.ones((8, 16, 3)), **{key: ("data", "model")})

    with jax.set_mesh(context):
        model = meshinit.nnx.init(Model)
    # spelled as flax spells it (nnx.get_partition_spec): one entry per annotated name
    assert model.w.get_value().sharding == NamedSharding(context, P("data", "model"))
    assert model.w.get_value().sharding.mesh is context


def test_sharded_variable_without_any_mesh_is_a_plan_error():
    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((8,)), out_sharding=("data",))

    with pytest.raises(meshinit.PlanError, match="w: has sharding metadata but no mesh"):
        meshinit.nnx.init(Model)


# ------------------------------------------------ abstract: init's Module as structs


def ab_mesh(ids, shape, axis_types=None):
    devices = np.array([jax.devices()[i] for i in ids]).reshape(shape)
    return Mesh(devices, ("a", "b"), axis_types=axis_types)


def ab_stages():
    return ab_mesh(range(4), (2, 2)), ab_mesh(range(4, 8), (2, 2))


class AbstractBlock(nnx.Module):
    def __init__(self, rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b"))
        self.up = nnx.Linear(8, 16, kernel_init=kernel, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((16,), jnp.bfloat16), out_sharding=("b",))
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))


class AbstractModel(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([AbstractBlock(rngs) for _ in range(3)])
        self.rngs = rngs  # typed keys in the state


def abstract_factory():
    return AbstractModel(nnx.Rngs(0))


def flat_variables(module):
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(module))}


AB_STAGES = [(r"layers\.0\..*", 0), (r".*", 1)]


def ab_stage_meshes():
    s = ab_stages()
    return [(pattern, s[i]) for pattern, i in AB_STAGES]


@pytest.mark.parametrize("staged", [False, True], ids=["one mesh", "two stages"])
def test_abstract_is_init_as_structs_with_the_same_shardings_and_metadata(staged, count_compiles):
    meshes = ab_stage_meshes() if staged else None
    with jax.set_mesh(mesh8(("a", "b"))):
        with count_compiles() as compiles:
            before = {id(x) for x in jax.live_arrays()}
            abstract = meshinit.nnx.abstract(abstract_factory, meshes=meshes)
            assert {id(x) for x in jax.live_arrays()} <= before  # nothing allocated
        model = meshinit.nnx.init(abstract_factory, meshes=meshes)
    assert compiles.count == 0
    structs, arrays = flat_variables(abstract), flat_variables(model)
    assert structs.keys() == arrays.keys()
    for path, var in structs.items():
        struct, array = var.get_value(), arrays[path].get_value()
        assert isinstance(struct, jax.ShapeDtypeStruct), path
        assert (struct.shape, struct.dtype) == (array.shape, array.dtype), path
        assert struct.sharding == array.sharding, path
        assert type(var) is type(arrays[path]), path
        assert var.get_metadata() == arrays[path].get_metadata(), path
    assert jax.dtypes.issubdtype(structs["rngs.default.key"].get_value().dtype, jax.dtypes.prng_key)
    if staged:
        first, rest = ab_stages()
        assert structs["layers.0.up.kernel"].get_value().sharding.mesh == first
        assert structs["layers.2.up.kernel"].get_value().sharding.mesh == rest


def test_abstract_plans_on_abstract_meshes_before_the_hardware_exists():
    auto = (AxisType.Auto,) * 2
    big = jax.sharding.AbstractMesh((16, 64), ("a", "b"), axis_types=auto)

    class Wide(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b"))
            self.w = nnx.Linear(1024, 4096, kernel_init=init, use_bias=False, rngs=rngs)

    struct = meshinit.nnx.abstract(lambda: Wide(nnx.Rngs(0)), meshes=[(r".*", big)]).w.kernel
    assert struct.get_value().sharding.mesh == big
    assert struct.get_value().sharding.shard_shape((1024, 4096)) == (64, 64)


@pytest.mark.parametrize(
    "saved, restored",
    [("one mesh", "two stages"), ("two stages", "one mesh"), ("one mesh", "4x2 explicit")],
)
def test_an_nnx_checkpoint_restores_into_abstract_in_another_layout(saved, restored, tmp_path):
    def layout(name):
        if name == "one mesh":
            return [(r".*", mesh8(("a", "b")))]
        if name == "two stages":
            return ab_stage_meshes()
        return [(r".*", ab_mesh(range(8), (4, 2), (AxisType.Explicit,) * 2))]

    model = meshinit.nnx.init(abstract_factory, meshes=layout(saved))
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, nnx.state(model))  # flax's usual checkpoint
        checkpointer.wait_until_finished()
        graphdef, target = nnx.split(
            meshinit.nnx.abstract(abstract_factory, meshes=layout(restored))
        )
        back = nnx.merge(graphdef, checkpointer.restore(path, target))
    want, structs, got = (
        flat_variables(model),
        flat_variables(nnx.merge(graphdef, target)),
        flat_variables(back),
    )
    assert got.keys() == want.keys()
    for p, var in got.items():
        value, saved_value = var.get_value(), want[p].get_value()
        assert value.sharding == structs[p].get_value().sharding, p
        assert value.dtype == saved_value.dtype, p
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value, saved_value = jax.random.key_data(value), jax.random.key_data(saved_value)
        assert np.asarray(value).tobytes() == np.asarray(saved_value).tobytes(), p
    # the restored Module is an ordinary one: its keys draw as the saved model's do
    drawn, want_drawn = back.rngs.params(), model.rngs.params()
    assert np.array_equal(jax.random.key_data(drawn), jax.random.key_data(want_drawn))
