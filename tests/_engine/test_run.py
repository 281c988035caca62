"""The constructor engine beneath meshinit.nnx.init, meshinit.linen.init and meshinit.eqx.init.

Unchanged framework code, traced once, cut per variable and compiled once per
signature: values equal eager construction, placement is exact, compiles do not grow
with depth, previews compile nothing, and what cannot be cut falls back.
"""

import logging

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import lecun, same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit


def mesh24():
    return jax.make_mesh((2, 4), ("fsdp", "tensor"))


def stages():
    devices = jax.devices()
    return (
        jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[:4]),
        jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[4:]),
    )


def nnx_stack(layers, mesh):
    """Ordinary nnx code in the style of flax's examples: metadata, rngs.params()."""

    def param(rngs, shape, axes, init=None):
        init = init or lecun()
        return nnx.Param(init(rngs.params(), shape), out_sharding=axes, mesh=mesh)

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.q = param(rngs, (32, 64), ("fsdp", "tensor"))
            self.o = param(rngs, (64, 32), ("tensor", "fsdp"))
            self.up = nnx.Linear(
                32,
                128,
                rngs=rngs,
                kernel_metadata={"out_sharding": ("fsdp", "tensor"), "mesh": mesh},
            )
            self.norm = nnx.RMSNorm(32, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = param(rngs, (256, 32), ("tensor", "fsdp"), jax.nn.initializers.normal(1.0))
            self.layers = nnx.List([Layer(rngs) for _ in range(layers)])
            self.head = param(
                rngs, (32, 256), ("fsdp", "tensor"), jax.nn.initializers.truncated_normal(0.02)
            )

    return Model


def flat(module):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}


def eager(factory):
    with nnx.use_eager_sharding(False):
        return flat(factory())


def assert_close(got, want, path):
    """``got`` is ``want``, eager construction's value, bit for bit. The contract is
    the framework's jitted init's bits; for these models on CPU, eager's are the same
    (checked on both stacks here). On a TPU eager differs from jit in most f32
    elements: compare with jit there."""
    same_bits(got, want, path)


# ----------------------------------------------------------------------------- nnx


def test_nnx_values_equal_eager_construction_and_placement_is_exact():
    mesh = mesh24()
    Model = nnx_stack(2, mesh)
    model = meshinit.nnx.init(lambda: Model(nnx.Rngs(0)))
    got, want = flat(model), eager(lambda: Model(nnx.Rngs(0)))
    assert set(got) == set(want)
    identical = 0
    for path, array in got.items():
        assert_close(array, want[path], path)
        identical += np.array_equal(np.asarray(array), np.asarray(want[path]))
    assert identical == len(got)  # on CPU the engine's programs give eager's bits
    assert got["layers.1.q"].sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    assert got["layers.0.up.kernel"].sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    assert got["head"].sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    shard = got["embed"].addressable_shards[0]
    assert shard.data.shape == (64, 16)  # each device holds only its own block


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_nnx_meshes_split_an_unchanged_model_into_disjoint_stages(explicit):
    stage0, stage1 = stages()
    if not explicit:
        stage0, stage1 = (jax.sharding.Mesh(m.devices, m.axis_names) for m in (stage0, stage1))
    Model = nnx_stack(4, mesh24())  # its metadata names a mesh over all 8 devices
    meshes = [(r"embed|layers\.[01]\..*", stage0), (r".*", stage1)]
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):  # a context mesh too
        model = meshinit.nnx.init(lambda: Model(nnx.Rngs(1)), meshes=meshes)
    got, want = flat(model), eager(lambda: Model(nnx.Rngs(1)))
    for path, array in got.items():
        on = stage0 if path == "embed" or path.startswith(("layers.0.", "layers.1.")) else stage1
        assert array.sharding.mesh == on, path
        assert_close(array, want[path], path)
    assert got["layers.3.q"].sharding == NamedSharding(stage1, P("fsdp", "tensor"))
    # no sharding metadata (the RMSNorm scale): replicated on its stage, spelled P()
    assert got["layers.0.norm.scale"].sharding == NamedSharding(stage0, P())


def test_an_empty_partition_spec_keeps_the_variable_mesh_and_mesh_alone_replicates():
    stage0, stage1 = stages()

    class Norms(nnx.Module):
        def __init__(self):
            self.q_norm = nnx.Param(jnp.ones((8,)), out_sharding=P(), mesh=stage1)
            self.k_norm = nnx.Param(jnp.ones((8,)), mesh=stage1)  # mesh, no sharding

    with jax.set_mesh(stage0):
        model = meshinit.nnx.init(Norms)
    assert model.q_norm.get_value().sharding == NamedSharding(stage1, P())  # flax's spelling
    assert model.k_norm.get_value().sharding == NamedSharding(stage1, P())  # no annotation


def test_set_mesh_inside_the_factory_says_what_to_do_instead():
    mesh = mesh24()

    def factory():
        with jax.set_mesh(mesh):
            return nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match=r"call jax.set_mesh around meshinit.nnx.init.*meshes="):
        meshinit.nnx.init(factory)


@pytest.mark.parametrize("adapter", ["nnx", "linen", "eqx"])
def test_plan_previews_compile_and_allocate_nothing(adapter, count_compiles, new_arrays):
    mesh = jax.sharding.AbstractMesh((2, 4), ("fsdp", "tensor"))
    with count_compiles() as c, new_arrays() as made:
        if adapter == "nnx":
            p = meshinit.nnx.plan(lambda: nnx_stack(2, mesh)(nnx.Rngs(0)))
        elif adapter == "linen":
            p = meshinit.linen.plan(LinenStack(2), 0, TOKENS, mesh=mesh, rules=LINEN_RULES)
        else:
            p = meshinit.eqx.plan(eqx_stack(2), 0, EQX_PLACEMENTS, mesh=mesh)
    assert c.count == 0 and list(made) == []
    paths = [e.path for e in p.entries]
    expected = {
        "nnx": "layers.1.up.kernel",
        "linen": "params.layers_1.up.kernel",
        "eqx": "layers.1.weight",
    }[adapter]
    assert expected in paths
    entry = p.entries[paths.index(expected)]
    assert entry.mesh == mesh and tuple(entry.sharding.spec) in {
        ("fsdp", "tensor"),
        ("tensor", "fsdp"),
    }


def test_nnx_plan_paths_are_the_ones_init_places():
    mesh = mesh24()
    factory = lambda: nnx_stack(1, mesh)(nnx.Rngs(0))  # noqa: E731
    planned = {e.path: e.sharding for e in meshinit.nnx.plan(factory).entries}
    placed = {p: a.sharding for p, a in flat(meshinit.nnx.init(factory)).items()}
    assert planned == placed


# ----------------------------------------------------------------------- linen, eqx

LINEN_RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"), ("layers", None))
TOKENS = jax.ShapeDtypeStruct((2, 8), jnp.int32)


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        h = nn.Dense(64, kernel_init=init, use_bias=False, name="up")(x)
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        return x + nn.Dense(32, kernel_init=init, use_bias=False, name="down")(h)


class LinenStack(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, tokens):
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
        x = nn.Embed(128, 32, embedding_init=init, name="embed")(tokens)
        for i in range(self.layers):
            x = LinenLayer(name=f"layers_{i}")(x)
        return x


def test_linen_values_equal_module_init_and_meshes_split_stages():
    stage0, stage1 = stages()
    model = LinenStack(3)
    meshes = [(r"params\.(embed|layers_0)\..*", stage0), (r".*", stage1)]
    variables = meshinit.linen.init(
        model, jax.random.PRNGKey(0), TOKENS, mesh=mesh24(), rules=LINEN_RULES, meshes=meshes
    )
    want = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 8), jnp.int32))
    got = nn.unbox(variables)["params"]
    ref = nn.unbox(want)["params"]
    for name, expected_mesh in [("embed", stage0), ("layers_0", stage0), ("layers_2", stage1)]:
        for leaf, ref_leaf in zip(
            jax.tree.leaves(got[name]), jax.tree.leaves(ref[name]), strict=True
        ):
            assert leaf.sharding.mesh == expected_mesh, name
            assert_close(leaf, ref_leaf, name)
    assert got["layers_2"]["up"]["kernel"].sharding == NamedSharding(stage1, P("fsdp", "tensor"))


EQX_PLACEMENTS = [(r"layers\.\d+\.weight", ("tensor", "fsdp")), (r".*", None)]


def eqx_stack(layers):
    def factory(key):
        keys = jax.random.split(key, layers)
        return eqx.nn.Sequential([eqx.nn.Linear(32, 32, key=k) for k in keys])

    return factory


def test_eqx_values_equal_the_constructor_run_eagerly():
    mesh = mesh24()
    out = meshinit.eqx.init(eqx_stack(3), 0, EQX_PLACEMENTS, mesh=mesh)
    ref = eqx_stack(3)(jax.random.key(0))
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert_close(got, want, "eqx")
    assert out.layers[2].weight.sharding == NamedSharding(mesh, P("tensor", "fsdp"))


# --------------------------------------------------------------- stacked layers


def test_nnx_vmap_and_scan_stacked_layers():
    mesh = mesh24()

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(
                lecun()(rngs.params(), (32, 64)), out_sharding=(None, "fsdp", "tensor"), mesh=mesh
            )

    class VmapStack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=4)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Layer(rngs)

            self.layers = make(rngs)

    class ScanStack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=4)
            @nnx.scan(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Layer(rngs)

            self.layers = make(rngs)

    for Stack in (VmapStack, ScanStack):
        got = flat(meshinit.nnx.init(lambda S=Stack: S(nnx.Rngs(0))))
        want = eager(lambda S=Stack: S(nnx.Rngs(0)))
        assert got["layers.w"].shape == (4, 32, 64), Stack
        assert got["layers.w"].sharding == NamedSharding(mesh, P(None, "fsdp", "tensor"))
        for path in got:
            assert_close(got[path], want[path], f"{Stack.__name__}.{path}")


def test_linen_scan_stacked_layers():
    mesh = mesh24()

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            h = nn.Dense(32, kernel_init=init, use_bias=False)(x)
            return x + h, None

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=4,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            return stack(name="stack")(x, None)[0]

    x = jax.ShapeDtypeStruct((2, 32), jnp.float32)
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("layers", None))
    variables = meshinit.linen.init(Scanned(), jax.random.PRNGKey(0), x, mesh=mesh, rules=rules)
    kernel = variables["params"]["stack"]["Dense_0"]["kernel"].value
    assert kernel.shape == (4, 32, 32)
    assert kernel.sharding == NamedSharding(mesh, P(None, "fsdp", "tensor"))
    ref = Scanned().init(jax.random.PRNGKey(0), jnp.zeros((2, 32)))
    assert_close(kernel, ref["params"]["stack"]["Dense_0"]["kernel"].value, "scan kernel")


def test_eqx_filter_vmap_stacked_layers():
    mesh = mesh24()

    def factory(key):
        keys = jax.random.split(key, 4)
        return eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 64, key=k))(keys)

    placements = [(r"weight", (None, "tensor", "fsdp")), (r"bias", (None, "tensor"))]
    out = meshinit.eqx.init(factory, 0, placements, mesh=mesh)
    ref = factory(jax.random.key(0))
    assert out.weight.shape == (4, 64, 32)
    assert out.weight.sharding == NamedSharding(mesh, P(None, "tensor", "fsdp"))
    assert_close(out.weight, ref.weight, "weight")
    assert_close(out.bias, ref.bias, "bias")


# ------------------------------------------------------- structure: depth, constants


def _cold_compiles(count_compiles, init, layers):
    with count_compiles() as c:
        jax.block_until_ready(jax.tree.leaves(init(layers)))
    return c.count


INITS = {
    "nnx": lambda n: nnx.state(meshinit.nnx.init(lambda: nnx_stack(n, mesh24())(nnx.Rngs(0)))),
    "linen": lambda n: meshinit.linen.init(
        LinenStack(n), 0, TOKENS, mesh=mesh24(), rules=LINEN_RULES
    ),
    "eqx": lambda n: meshinit.eqx.init(eqx_stack(n), 0, EQX_PLACEMENTS, mesh=mesh24()),
}


@pytest.mark.parametrize("adapter", sorted(INITS))
def test_compiles_do_not_grow_with_depth(adapter, count_compiles):
    # A whole-constructor program would compile anew, and larger, for each depth.
    init = INITS[adapter]
    meshinit.clear_cache()
    shallow = _cold_compiles(count_compiles, init, 2)
    # 8 layers compile nothing after 2: the very same executables, so neither the
    # number of compiles nor the compile time grows with depth.
    assert _cold_compiles(count_compiles, init, 8) == 0
    meshinit.clear_cache()
    assert _cold_compiles(count_compiles, init, 8) == shallow
    assert 1 <= shallow <= 4, shallow


def test_a_captured_numpy_constant_is_placed_shard_by_shard(count_compiles, monkeypatch):
    mesh = mesh24()
    pretrained = np.random.default_rng(0).standard_normal((256, 32)).astype(np.float32)

    class Model(nnx.Module):
        def __init__(self):
            self.embed = nnx.Param(
                jnp.asarray(pretrained), out_sharding=("tensor", "fsdp"), mesh=mesh
            )
            self.half = nnx.Param(
                jnp.asarray(pretrained).astype(jnp.bfloat16),
                out_sharding=("tensor", "fsdp"),
                mesh=mesh,
            )

    # Every host-to-device copy of the constant must be one device's block, never the
    # whole array.
    real = jax.make_array_from_callback
    blocks = []

    def spy(shape, sharding, cb, dtype=None):
        def record(index):
            block = cb(index)
            blocks.append(np.shape(block))
            return block

        return real(shape, sharding, record, dtype=dtype)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    meshinit.clear_cache()
    with count_compiles() as c:
        model = meshinit.nnx.init(Model)
    assert c.count == 1  # the cast; the constant itself needs no program
    assert blocks and all(b == (64, 16) for b in blocks), blocks
    np.testing.assert_array_equal(np.asarray(model.embed.get_value()), pretrained)
    np.testing.assert_array_equal(
        np.asarray(model.half.get_value()), pretrained.astype(jnp.bfloat16)
    )
    assert model.half.get_value().sharding == NamedSharding(mesh, P("tensor", "fsdp"))


# ----------------------------------------------------------------------- fallback


def test_what_cannot_be_cut_falls_back_with_a_warning_saying_why_and_what_to_do(caplog):
    mesh = mesh24()

    def host_init(key, shape):
        return jax.pure_callback(
            lambda: np.full(shape, 3.0, np.float32), jax.ShapeDtypeStruct(shape, jnp.float32)
        )

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(
                lecun()(rngs.params(), (32, 64)), out_sharding=("fsdp", "tensor"), mesh=mesh
            )
            self.odd = nnx.List(
                [nnx.Param(host_init(rngs.params(), (64, 64)) * 2, mesh=mesh) for _ in range(4)]
            )

    from meshinit._run import compile as _compile

    with (
        caplog.at_level(logging.DEBUG, logger="meshinit"),
        pytest.warns(meshinit.FallbackWarning) as said,
    ):
        model = meshinit.nnx.init(lambda: Model(nnx.Rngs(0)))
    # the whole-constructor program is this call's own: nothing of it stays cached
    assert not any("constructor_fallback" in str(k) for k in _compile.executables)
    (warning,) = [w for w in said if w.category is meshinit.FallbackWarning]  # one cause
    text = str(warning.message)
    assert text.startswith("meshinit.nnx.init: 4 variables (odd.0, odd.1, odd.2 and 1 more)")
    assert "pure_callback's parameter is a Python callable (_FlatCallback)" in text
    assert "compile time grows with the model's depth" in text
    assert "To avoid it: make this value with jax operations instead of a Python" in text
    assert warning.filename == __file__  # points at the call, not into meshinit
    assert len(text) < 600 and "\n" not in text
    assert " w" not in text.split("(")[1]  # only the variables that needed it
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("odd.0, odd.1, odd.2, odd.3" in m for m in debug), debug  # every path
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(model.odd[i].get_value()), np.full((64, 64), 6.0))
        assert model.odd[i].get_value().sharding == NamedSharding(mesh, P())
    want = eager(lambda: Model(nnx.Rngs(0)))
    assert_close(model.w.get_value(), want["w"], "w")


def test_malformed_meshes_are_one_error_naming_each_pair():
    mesh = mesh24()
    bad = [("(", mesh), (3, mesh), ("a", "mesh"), (r".*", mesh)]
    with pytest.raises(meshinit.PlanError, match=r"meshes= is malformed") as e:
        meshinit.nnx.init(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), meshes=bad)
    assert [str(p).split(":")[0] for p in e.value.problems] == [
        "meshes[0]",
        "meshes[1]",
        "meshes[2]",
    ]
    with pytest.raises(TypeError, match="ordered sequence of \\(regex, mesh\\) pairs"):
        meshinit.linen.plan(LinenStack(1), 0, TOKENS, mesh=mesh, rules=LINEN_RULES, meshes="x")


def test_the_engine_programs_move_nothing_between_devices():
    # Each device computes its own shards from replicated host inputs; a collective in
    # these programs would mean the partitioner split an input and shipped pieces (it
    # did, for host-made norms cut from a packed buffer, before they were constrained
    # replicated; on CPU such programs can also stall in flight).
    from meshinit._run import compile as _compile

    meshinit.clear_cache()
    mesh = mesh24()
    meshinit.nnx.init(lambda: nnx_stack(3, mesh)(nnx.Rngs(0)))
    texts = [exe.as_text() for k, exe in _compile.executables.items() if k[0][0] == "constructor"]
    assert texts
    for op in ("collective-permute", "all-gather", "all-to-all", "all-reduce", "reduce-scatter"):
        assert not any(op in t for t in texts), op


def test_a_model_written_like_bonsai_qwen3_under_a_context_mesh():
    # Metadata names PartitionSpecs and no mesh (the context mesh supplies it), norms
    # carry the empty P(), the embedding and head tie nothing: bonsai's style.
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))

    class Attention(nnx.Module):
        def __init__(self, rngs):
            meta = {"out_sharding": P("tp", "fsdp", None)}
            self.q_proj = nnx.LinearGeneral(
                32, (4, 8), use_bias=False, rngs=rngs, kernel_metadata=meta
            )
            self.q_norm = nnx.RMSNorm(8, rngs=rngs, scale_metadata={"out_sharding": P()})

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embedder = nnx.Embed(
                64, 32, rngs=rngs, embedding_metadata={"out_sharding": P("tp", "fsdp")}
            )
            self.layers = nnx.List([Attention(rngs) for _ in range(3)])

    stage = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.devices()[4:])
    with jax.set_mesh(mesh):
        model = meshinit.nnx.init(lambda: Model(nnx.Rngs(0)))
        eager_model = Model(nnx.Rngs(0))  # flax's own eager placement, as reference
        split = meshinit.nnx.init(lambda: Model(nnx.Rngs(0)), meshes=[(r"layers\.2\..*", stage)])
    # the values' reference: nnx.jit on the Explicit mesh itself (meshinit lowers the
    # sharding constraints jit lowers there: on its all-Auto twin the scaled embedding
    # was 1 ulp off in 1282 of 2048, jax 0.10.2)
    with jax.set_mesh(mesh):
        jitted = flat(nnx.jit(lambda: Model(nnx.Rngs(0)))())
    got, want = flat(model), flat(eager_model)
    for path, array in got.items():
        assert array.sharding.is_equivalent_to(want[path].sharding, array.ndim), path
        same_bits(array, jitted[path], path)
    # nnx.Embed's default init scales a normal by sqrt(1/32): jax.jit fuses the
    # scaling, 1 ulp off eager in about half the elements (jax 0.10.2). The rest is
    # eager's bits too.
    same_bits(got["layers.1.q_proj.kernel"], want["layers.1.q_proj.kernel"], "eager q_proj")
    assert got["layers.0.q_norm.scale"].sharding.mesh == mesh
    parts = flat(split)
    assert parts["layers.2.q_norm.scale"].sharding == NamedSharding(stage, P())
    assert parts["layers.2.q_proj.kernel"].sharding == NamedSharding(stage, P("tp", "fsdp", None))
    assert parts["layers.1.q_proj.kernel"].sharding.mesh == mesh


def test_nnx_init_and_plan_refuse_a_spec_declared_module_and_point_to_materialize():
    mesh = mesh24()

    class Declared(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(meshinit.param((8, 8), lecun(), axes=("fsdp", "tensor"), mesh=mesh))

    for fn, name in [(meshinit.nnx.init, "init"), (meshinit.nnx.plan, "plan")]:
        with pytest.raises(
            meshinit.PlanError, match=rf"meshinit.nnx.{name} is for .*materialize"
        ) as e:
            fn(Declared)
        assert [p.path for p in e.value.problems] == ["w"]
    with pytest.raises(ValueError, match="meshinit.nnx.plan: the factory is traced"):
        rngs = nnx.Rngs(0)
        meshinit.nnx.plan(lambda: nnx.Linear(4, 4, rngs=rngs))


@pytest.mark.parametrize("explicit", [False, True])
def test_a_scalar_of_a_literal_seed_is_made_by_jits_program(monkeypatch, explicit):
    """Issue 67: a 0-d ``normal(0.02)`` is made by a program of no arguments, its key a
    constant, as ``nnx.jit`` makes it (which XLA on a TPU folds at compile time; 8 ulp
    off the device's own code before), with nnx.jit's bits."""
    from meshinit._run import compile as _compile

    mesh = mesh24() if explicit else jax.sharding.Mesh(mesh24().devices, ("fsdp", "tensor"))
    lowered: list[str] = []
    real = _compile.compile_lowered

    def record(low, m):
        lowered.append(low.as_text())
        return real(low, m)

    class Scalar(nnx.Module):
        def __init__(self, rngs):
            self.s = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (), jnp.float32))

    monkeypatch.setattr(_compile, "compile_lowered", record)
    meshinit.clear_cache()
    with jax.set_mesh(mesh):
        made = meshinit.nnx.init(lambda: Scalar(nnx.Rngs(0))).s.get_value()
        want = nnx.jit(lambda: Scalar(nnx.Rngs(0)))().s.get_value()
    (text,) = lowered
    assert "func.func public @main() ->" in text, "the scalar's program reads arguments"
    same_bits(made, want, "a 0-d normal(0.02)")
