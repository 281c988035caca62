import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import eqx_linear, eqx_mlp, lecun, reference, same_bits, submesh
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

VOCAB_NORM_RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"), ("norm", None))


def two_meshes():
    """The whole (2, 4) mesh (Explicit) and an Auto 2x2 submesh on devices 4-7."""
    full = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    tail = submesh(range(4, 8), (2, 2), ("fsdp", "tensor"))
    return full, tail


def block_specs(mesh):
    with meshinit.defaults(mesh=mesh, rules=VOCAB_NORM_RULES):
        return {
            "up": meshinit.param((16, 64), lecun(), axes=("embed", "mlp")),
            "down": meshinit.param((64, 16), lecun(), axes=("mlp", "embed")),
            "norm": meshinit.param((16,), jax.nn.initializers.ones, axes=("norm",)),
        }


class Block(eqx.Module):
    up: jax.Array
    down: jax.Array
    norm: jax.Array

    def __init__(self, mesh):
        specs = block_specs(mesh)
        self.up, self.down, self.norm = specs["up"], specs["down"], specs["norm"]

    def __call__(self, x):
        return x + jax.nn.relu(x @ self.up) @ self.down * self.norm


class Model(eqx.Module):
    embed: jax.Array
    layers: list[Block]

    def __init__(self, meshes):
        self.embed = meshinit.param(
            (32, 16), lecun(), axes=("vocab", "embed"), mesh=meshes[0], rules=VOCAB_NORM_RULES
        )
        self.layers = [Block(m) for m in meshes]


def dict_model(meshes):
    return {
        "embed": meshinit.param(
            (32, 16), lecun(), axes=("vocab", "embed"), mesh=meshes[0], rules=VOCAB_NORM_RULES
        ),
        "layers": [block_specs(m) for m in meshes],
    }


def by_path(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {meshinit._paths.path_str(kp): v for kp, v in flat if isinstance(v, jax.Array)}


def assert_on(array, mesh, spec, path):
    s = array.sharding
    assert isinstance(s, NamedSharding), f"{path}: got {s}"
    assert s == NamedSharding(mesh, spec), f"{path}: got {s.spec} on {s.mesh}, want {spec}"
    assert s.mesh is mesh, f"{path}: placed on another mesh object"


# --- the optional extra ----------------------------------------------------------------


def run_code(code):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_meshinit_imports_without_equinox_and_the_adapter_names_the_extra():
    result = run_code(
        """
        import sys
        import meshinit
        assert "equinox" not in sys.modules, "importing meshinit imported equinox"
        sys.modules["equinox"] = None  # equinox is not installed
        try:
            meshinit.eqx
        except ImportError as e:
            assert isinstance(e.__cause__, ImportError), "the original error is not chained"
            print("ImportError:", e)
        else:
            raise SystemExit("meshinit.eqx imported without equinox")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "ImportError: meshinit.eqx needs equinox: pip install 'meshinit[eqx]'" in result.stdout


# --- spec-declared modules -------------------------------------------------------------


def test_building_a_spec_declared_module_allocates_nothing(new_arrays):
    meshes = two_meshes()
    with new_arrays() as made:
        model = Model(meshes)
    assert made == []
    assert isinstance(model.layers[1].up, meshinit.ParamSpec)


@pytest.mark.parametrize("context", [False, True])
def test_spec_declared_module_on_two_meshes_materializes_exactly(context):
    full, tail = two_meshes()
    model = Model([full, tail])
    if context:
        with jax.set_mesh(jax.make_mesh((8,), ("data",))):
            out = meshinit.eqx.materialize(model, jax.random.key(0))  # key on the context
    else:
        out = meshinit.eqx.materialize(model, jax.random.key(0))
    assert type(out) is Model and type(out.layers[1]) is Block
    assert_on(out.embed, full, P("tensor", "fsdp"), "embed")
    for i, mesh in enumerate([full, tail]):
        layer = out.layers[i]
        assert_on(layer.up, mesh, P("fsdp", "tensor"), f"layers.{i}.up")
        assert_on(layer.down, mesh, P("tensor", "fsdp"), f"layers.{i}.down")
        assert_on(layer.norm, mesh, P(None), f"layers.{i}.norm")
    assert {d.id for d in out.layers[1].up.devices()} == {4, 5, 6, 7}
    np.testing.assert_array_equal(out.layers[0].norm, np.ones(16, np.float32))
    # The module works: a forward pass of the block on the Auto submesh. (Under
    # Explicit axes, `down`'s matmul would need an out_sharding: both sides contract
    # over "tensor".)
    y = eqx.filter_jit(out.layers[1])(jnp.ones((4, 16)))
    assert y.shape == (4, 16) and bool(jnp.all(jnp.isfinite(y)))


def test_dict_and_eqx_module_with_the_same_paths_get_identical_values():
    meshes = list(two_meshes())
    module = by_path(meshinit.eqx.materialize(Model(meshes), 7))
    tree = by_path(meshinit.init(dict_model(meshes), 7))
    assert (
        sorted(module)
        == sorted(tree)
        == [
            "embed",
            "layers.0.down",
            "layers.0.norm",
            "layers.0.up",
            "layers.1.down",
            "layers.1.norm",
            "layers.1.up",
        ]
    )
    for path in tree:
        assert np.array_equal(module[path], tree[path]), path
    # And the value contract's jitted reference on the planned sharding, bit for bit.
    spec, made = Model(meshes).layers[1].up, module["layers.1.up"]
    same_bits(made, reference(spec, 7, "layers.1.up", made.sharding), "layers.1.up")


def test_module_without_specs_passes_through():
    w = jnp.arange(4.0)
    out = meshinit.eqx.materialize(eqx.nn.Lambda(jax.nn.relu), 0)
    assert isinstance(out, eqx.nn.Lambda) and out.fn is jax.nn.relu

    class Holder(eqx.Module):
        w: jax.Array

    held = meshinit.eqx.materialize(Holder(w), 0)
    assert held.w is w


def test_spec_errors_name_module_paths():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    model = Model([mesh])
    bad = eqx.tree_at(
        lambda m: m.layers[0].up,
        model,
        meshinit.param(
            (16, 64), lecun(), axes=("embed", "mlpp"), mesh=mesh, rules=VOCAB_NORM_RULES
        ),
    )
    with pytest.raises(meshinit.PlanError, match=r"layers\.0\.up: logical axis 'mlpp' has no rule"):
        meshinit.eqx.materialize(bad, 0)


# --- eqx.init: existing constructors ---------------------------------------------------


MLP_PLACEMENTS = [
    (r"layers\.0\.weight", ("tensor", None)),
    (r"layers\.0\.bias", ("tensor",)),
    (r"layers\.1\.weight", (None, "tensor")),
    (r"layers\.\d+\.(weight|bias)", None),
]
MLP_SPECS = {  # on an Auto mesh
    "layers.0.weight": P("tensor", None),
    "layers.0.bias": P("tensor"),
    "layers.1.weight": P(None, "tensor"),
    # a None placement replicates, spelled as jax spells a replicated array: P() on an
    # Auto mesh, one None per dimension on an Explicit one (see replicated_spec)
    "layers.1.bias": P(),
    "layers.2.weight": P(),
    "layers.2.bias": P(),
}


def replicated_spec(mesh, ndim):
    """How jax spells a replicated array on ``mesh``: what a jit gives back."""
    explicit = jax.sharding.AxisType.Explicit in mesh.axis_types
    return P(*([None] * ndim)) if explicit else P()


def assert_same_values(got, want):
    got, want = by_path(got), by_path(want)
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-6, atol=1e-6, err_msg=path)


KEYS = {
    "typed": lambda: jax.random.key(3),
    "seed": lambda: 3,
    "legacy": lambda: jax.random.PRNGKey(3),
}


# Each eqx.init compiles the constructor (about 2 s for this MLP on CPU), so the key kinds
# and axis types are covered pairwise rather than as a full product.
@pytest.mark.parametrize(
    "kind, explicit", [("typed", False), ("typed", True), ("seed", True), ("legacy", False)]
)
def test_init_places_an_existing_constructor_exactly_with_its_own_values(kind, explicit):
    mesh = submesh(range(8), (2, 4), ("fsdp", "tensor"), explicit)
    key = KEYS[kind]()
    typed = []

    def factory(k):
        typed.append(jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key))
        return eqx_mlp(k)

    out = meshinit.eqx.init(factory, key, MLP_PLACEMENTS, mesh=mesh)
    # A seed reaches the constructor as jax.random.key(seed), a legacy key as it is.
    assert typed and all(t == (kind != "legacy") for t in typed), typed
    assert type(out) is eqx.nn.MLP
    assert out.activation is eqx_mlp(jax.random.key(0)).activation  # non-array leaves kept
    placed = by_path(out)
    assert sorted(placed) == sorted(MLP_SPECS)
    for path, spec in MLP_SPECS.items():
        if spec == P():
            spec = replicated_spec(mesh, placed[path].ndim)
        assert_on(placed[path], mesh, spec, path)
    eager = eqx_mlp(jax.random.key(key) if isinstance(key, int) else key)
    assert_same_values(out, eager)


@pytest.mark.parametrize("context", [False, True])
def test_init_on_disjoint_submeshes_with_per_placement_meshes(context):
    first = submesh(range(0, 4), (2, 2), ("fsdp", "tensor"))
    last = submesh(range(4, 8), (2, 2), ("fsdp", "tensor"), explicit=True)
    placements = [
        (r"layers\.2\.weight", ("tensor", "fsdp"), last),
        (r"layers\.2\.bias", ("tensor",), last),
        (r"layers\.\d+\.weight", ("fsdp", "tensor")),
        (r"layers\.\d+\.bias", None),
    ]
    if context:
        with jax.set_mesh(jax.make_mesh((8,), ("data",))):
            key = jax.random.key(1)  # placed on the context mesh
            out = meshinit.eqx.init(eqx_mlp, key, placements, mesh=first)
    else:
        out = meshinit.eqx.init(eqx_mlp, jax.random.key(1), placements, mesh=first)
    placed = by_path(out)
    assert_on(placed["layers.0.weight"], first, P("fsdp", "tensor"), "layers.0.weight")
    assert_on(placed["layers.1.bias"], first, P(), "layers.1.bias")
    assert_on(placed["layers.2.weight"], last, P("tensor", "fsdp"), "layers.2.weight")
    assert_on(placed["layers.2.bias"], last, P("tensor"), "layers.2.bias")
    assert {d.id for d in placed["layers.0.weight"].devices()} == {0, 1, 2, 3}
    assert {d.id for d in placed["layers.2.weight"].devices()} == {4, 5, 6, 7}
    assert_same_values(out, eqx_mlp(jax.random.key(1)))


def test_first_matching_placement_wins():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    specific = (r"weight", ("tensor", "fsdp"))
    general = (r".*", None)
    a = meshinit.eqx.init(eqx_linear, 0, [specific, general], mesh=mesh)
    b = meshinit.eqx.init(eqx_linear, 0, [general, specific], mesh=mesh)
    assert_on(a.weight, mesh, P("tensor", "fsdp"), "weight")
    assert_on(a.bias, mesh, P(None), "bias")  # an Explicit mesh: jax's full-rank spelling
    assert_on(b.weight, mesh, P(None, None), "weight")
    assert np.array_equal(a.weight, b.weight)


def test_logical_axes_rules_and_default_mesh():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    placements = [(r"weight", ("mlp", "embed")), (r"bias", ("mlp",))]
    with meshinit.defaults(mesh=mesh):
        out = meshinit.eqx.init(eqx_linear, 0, placements, rules=VOCAB_NORM_RULES)
    assert_on(out.weight, mesh, P("tensor", "fsdp"), "weight")
    assert_on(out.bias, mesh, P("tensor"), "bias")


def test_abstract_mesh_cannot_be_initialized():
    with pytest.raises(meshinit.PlanError, match=r"layers\.0\.weight: mesh .* is abstract"):
        meshinit.eqx.init(eqx_mlp, 0, [(r".*", None)], mesh=AbstractMesh((8,), ("x",)))


def test_sharding_dependent_keys_are_rejected():
    mesh = jax.make_mesh((8,), ("x",))
    with pytest.raises(ValueError, match="'rbg' generates values that depend on the sharding"):
        meshinit.eqx.init(eqx_mlp, jax.random.key(0, impl="rbg"), [(r".*", None)], mesh=mesh)


def test_the_placeholder_init_is_never_a_silent_value():
    with pytest.raises(TypeError, match=r"call meshinit.eqx.init\(factory, key, placements\)"):
        from meshinit._spec.constructor import from_constructor  # what eqx.init's specs hold

        from_constructor(jax.random.key(0), (2,), jnp.float32)


# --- training right after initialization -----------------------------------------------


def loss_fn(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def test_explicit_mesh_training_step_keeps_every_sharding():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    # Explicit axes type-check every matmul, so use a layout eqx.nn.Linear can run.
    placements = [
        (r"layers\.2\.weight", ("tensor", None)),
        (r"layers\.2\.bias", ("tensor",)),
        (r"layers\.\d+\.weight", ("fsdp", None)),
        (r".*", None),
    ]
    model = meshinit.eqx.init(eqx_mlp, 0, placements, mesh=mesh)
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
        updates, opt_state = optimizer.update(grads, opt_state)
        return loss, eqx.apply_updates(model, updates), opt_state

    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    loss0, new, opt_state = step(model, opt_state, x)
    loss1, _, _ = step(new, opt_state, x)
    assert float(loss1) < float(loss0)
    old, updated = by_path(model), by_path(new)
    for path, array in old.items():
        # Explicit shardings are part of the type: the update keeps them exactly.
        assert updated[path].sharding == array.sharding, path
        assert not np.array_equal(updated[path], array), f"{path} was not trained"


def test_auto_mesh_training_step_keeps_every_sharding():
    mesh = submesh(range(8), (2, 4), ("fsdp", "tensor"))
    model = meshinit.eqx.init(eqx_mlp, 0, MLP_PLACEMENTS, mesh=mesh)
    params, static = eqx.partition(model, eqx.is_array)
    shardings = jax.tree.map(lambda a: a.sharding, params)

    # Under Auto axes, jit may hand back a replicated parameter as P() instead of
    # P(None, None): the same placement, spelled differently. Pinning out_shardings to
    # the parameters' own shardings, as one does to keep a layout, keeps them exactly.
    @jax.jit(out_shardings=(None, shardings))
    def step(params, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(eqx.combine(params, static), x)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    loss0, new = step(params, x)
    loss1, _ = step(new, x)
    assert float(loss1) < float(loss0)
    old, updated = by_path(params), by_path(new)
    for path, array in old.items():
        assert updated[path].sharding == array.sharding, path
        assert not np.array_equal(updated[path], array), f"{path} was not trained"
