"""meshinit.nnx.optimizer: an nnx.Optimizer whose state sits exactly where its params do."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import on_one_device
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
import meshinit.nnx


def make_meshes(layout, explicit):
    """Two meshes: over the same 8 devices, or on disjoint halves (devices 0-3, 4-7)."""
    devices = jax.devices()

    def mesh(shape, names, devs):
        if explicit:
            return jax.make_mesh(shape, names, devices=devs)
        return Mesh(np.array(devs).reshape(shape), names)

    if layout == "shared":
        return mesh((2, 4), ("fsdp", "tensor"), devices), mesh((8,), ("data",), devices)
    return mesh((2, 2), ("fsdp", "tensor"), devices[:4]), mesh((4,), ("data",), devices[4:])


class Stage(nnx.Module):
    def __init__(self, mesh, w_sharding, rngs):
        init = jax.nn.initializers.normal(1.0)
        self.w = nnx.Param(init(rngs.params(), (16, 8)), out_sharding=w_sharding, mesh=mesh)
        self.b = nnx.Param(init(rngs.params(), (8,)), out_sharding=(None,), mesh=mesh)
        # Not a Param: no optimizer state unless wrt asks for it.
        self.seen = nnx.BatchStat(jnp.zeros((8,)), out_sharding=(None,), mesh=mesh)


class Model(nnx.Module):
    """stage0 on the first mesh, stage1 on the second."""

    def __init__(self, layout, explicit, rngs):
        m1, m2 = make_meshes(layout, explicit)
        self.stage0 = Stage(m1, ("fsdp", "tensor"), rngs)
        self.stage1 = Stage(m2, ("data",), rngs)


def build(layout, explicit):
    return Model(layout, explicit, nnx.Rngs(0))


def snapshot(model):
    """Every array of the model, with its sharding and a host copy of its value."""
    return [(x, x.sharding, np.asarray(x)) for x in jax.tree.leaves(nnx.state(model))]


def assert_untouched(model, before):
    after = jax.tree.leaves(nnx.state(model))
    assert len(after) == len(before)
    for x, (was, sharding, value) in zip(after, before, strict=True):
        assert x is was, "the model's arrays are the same objects"
        assert x.sharding == sharding, "the model's arrays were not resharded"
        np.testing.assert_array_equal(np.asarray(x), value)


def flat(state):
    """{path tuple: array} of an nnx state."""
    return {p: v.get_value() for p, v in nnx.to_flat_state(state)}


def opt_state_leaves(opt):
    """{path tuple inside opt_state: array}."""
    return {p[1:]: x for p, x in flat(nnx.state(opt)).items() if p[0] == "opt_state"}


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("layout", ["shared", "disjoint"])
def test_state_is_placed_like_the_params_with_tx_init_values(layout, explicit, count_compiles):
    model = build(layout, explicit)
    before = snapshot(model)
    tx = optax.adamw(1e-3)
    params = flat(nnx.state(model, nnx.Param))
    first_mesh = params[("stage0", "b")].sharding.mesh  # first Param in nnx state order
    assert first_mesh is jax.tree.leaves(nnx.state(model, nnx.Param))[0].sharding.mesh

    with count_compiles() as first:
        opt = meshinit.nnx.optimizer(model, tx)
    assert first.count == 2, "one computation per mesh (the two meshes are different)"
    assert isinstance(opt, nnx.Optimizer) and opt.tx is tx and opt.wrt is nnx.Param
    assert_untouched(model, before)

    replicated = NamedSharding(first_mesh, P())
    assert opt.step.get_value().sharding == replicated
    assert opt.step.get_value().dtype == jnp.uint32 and int(opt.step.get_value()) == 0
    mirrors = 0
    for path, leaf in opt_state_leaves(opt).items():
        param = params.get(tuple(path[-2:]))
        if param is not None and leaf.shape == param.shape:
            assert leaf.sharding == param.sharding, path
            mirrors += 1
        else:
            assert leaf.ndim == 0 and leaf.sharding == replicated, path
    assert mirrors == 2 * len(params) == 8, "mu and nu for each Param, BatchStats left out"

    reference = tx.init(on_one_device(nnx.as_pure(nnx.state(model, nnx.Param))))
    got = nnx.as_pure(opt.opt_state)
    assert jax.tree.structure(got) == jax.tree.structure(reference)
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True):
        assert g.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))

    # An ordinary nnx.Optimizer: the same Variable types and metadata as flax's own.
    plain = nnx.Optimizer(model, tx, wrt=nnx.Param)
    assert jax.tree.structure(nnx.state(opt)) == jax.tree.structure(nnx.state(plain))

    with count_compiles() as again:
        meshinit.nnx.optimizer(model, tx)
    assert again.count == 0, "same tx and params: nothing compiles"


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("layout", ["shared", "disjoint"])
def test_plain_flax_misplaces_the_counts_and_fails_under_jit_on_disjoint_meshes(layout, explicit):
    """What meshinit.nnx.optimizer fixes; shows flax 0.12's own behavior."""
    model = build(layout, explicit)
    tx = optax.adamw(1e-3)
    plain = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # Step counts land on one default device, not on any of the params' meshes.
    # jax 0.12.1 deprecates the name SingleDeviceSharding: its type, from its maker
    one = type(jax.sharding.make_single_device_sharding(jax.devices()[0]))
    assert isinstance(plain.step.get_value().sharding, one)
    assert isinstance(plain.opt_state[0].count.get_value().sharding, one)
    if layout == "disjoint":
        with pytest.raises(ValueError, match="incompatible devices"):
            nnx.jit(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param))(model)
    fixed = meshinit.nnx.optimizer(model, tx)
    assert isinstance(fixed.step.get_value().sharding, NamedSharding)


@pytest.mark.parametrize("explicit", [False, True])
def test_works_under_a_context_mesh_over_other_devices(explicit):
    """flax's own constructor fails here under an Auto context mesh."""
    model = build("disjoint", explicit)
    before = snapshot(model)
    tx = optax.adamw(1e-3)
    context = make_meshes("shared", explicit)[1]
    if not explicit:
        with jax.set_mesh(context), pytest.raises(ValueError, match="incompatible devices"):
            nnx.Optimizer(model, tx, wrt=nnx.Param)
    with jax.set_mesh(context):
        opt = meshinit.nnx.optimizer(model, tx)
    assert_untouched(model, before)
    w1 = model.stage1.w.get_value()
    assert opt.opt_state[0].mu["stage1"]["w"].get_value().sharding == w1.sharding
    assert opt.step.get_value().sharding.mesh is model.stage0.w.get_value().sharding.mesh


def grads_like(model, value):
    """Gradients for the model's Params, with exactly the Params' shardings."""
    return jax.tree.map(
        lambda x: jax.device_put(np.full(x.shape, value, x.dtype), x.sharding),
        nnx.state(model, nnx.Param),
    )


def assert_state_placed(state, shardings):
    """Each array on its sharding: the same mesh, an equivalent spec (P(None,) is P())."""
    arrays = jax.tree.leaves(state)
    assert len(arrays) == len(shardings)
    for x, want in zip(arrays, shardings, strict=True):
        assert x.sharding.mesh == want.mesh, (x.sharding, want)
        assert x.sharding.is_equivalent_to(want, x.ndim), (x.sharding, want)


def assert_step_matches_optax(opt, model, before_params, grads, tx):
    """params and state after one update equal optax's on one device."""
    ref_params = on_one_device(before_params)
    ref_state = tx.init(ref_params)
    updates, ref_state = tx.update(on_one_device(nnx.as_pure(grads)), ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    got = nnx.as_pure(nnx.state(model, nnx.Param))
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6)
    for g, want in zip(
        jax.tree.leaves(nnx.as_pure(opt.opt_state)), jax.tree.leaves(ref_state), strict=True
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_one_update_across_auto_meshes_over_the_same_devices(jit):
    model = build("shared", explicit=False)
    tx = optax.adamw(1e-3)
    opt = meshinit.nnx.optimizer(model, tx)
    shardings = [x.sharding for x in jax.tree.leaves(nnx.state(model))]
    state_shardings = [x.sharding for x in jax.tree.leaves(nnx.state(opt))]
    before = nnx.as_pure(nnx.state(model, nnx.Param))
    grads = grads_like(model, 0.1)

    if jit:
        nnx.jit(lambda opt, model, grads: opt.update(model, grads))(opt, model, grads)
    else:
        opt.update(model, grads)

    assert_state_placed(nnx.state(model), shardings)  # params keep their shardings
    assert_state_placed(nnx.state(opt), state_shardings)
    assert int(opt.step.get_value()) == 1
    assert_step_matches_optax(opt, model, before, grads, tx)


@pytest.mark.parametrize(
    ("layout", "explicit"), [("disjoint", False), ("disjoint", True), ("shared", True)]
)
def test_one_update_across_meshes_fails_so_each_stage_gets_its_own(layout, explicit):
    """One update spans every param: impossible across disjoint or Explicit meshes."""
    model = build(layout, explicit)
    tx = optax.adamw(1e-3)
    opt = meshinit.nnx.optimizer(model, tx)
    with pytest.raises(
        ValueError, match="incompatible devices|Mesh for all inputs should be equal"
    ):
        opt.update(model, grads_like(model, 0.1))

    # Per stage: each optimizer, and each update, lives on one mesh.
    for stage in (model.stage0, model.stage1):
        shardings = [x.sharding for x in jax.tree.leaves(nnx.state(stage))]
        stage_opt = meshinit.nnx.optimizer(stage, tx)
        mesh = stage.w.get_value().sharding.mesh
        assert stage_opt.step.get_value().sharding == NamedSharding(mesh, P())
        before = nnx.as_pure(nnx.state(stage, nnx.Param))
        grads = grads_like(stage, 0.1)
        nnx.jit(lambda opt, stage, grads: opt.update(stage, grads))(stage_opt, stage, grads)
        assert_state_placed(nnx.state(stage), shardings)
        assert_step_matches_optax(stage_opt, stage, before, grads, tx)


def test_wrt_filters_the_variables_it_optimizes():
    model = build("disjoint", explicit=False)
    opt = meshinit.nnx.optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.BatchStat)
    traces = opt_state_leaves(opt)
    assert {p[-2:] for p in traces} == {("stage0", "seen"), ("stage1", "seen")}
    for path, leaf in traces.items():
        param = getattr(getattr(model, path[-2]), path[-1]).get_value()
        assert leaf.sharding == param.sharding, path


def test_errors_name_the_problem():
    model = build("shared", explicit=False)
    with pytest.raises(ValueError, match="no array leaves"):
        meshinit.nnx.optimizer(model, optax.adamw(1e-3), wrt=nnx.Cache)

    class OnOneDevice(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4,)))

    with pytest.raises(TypeError, match="NamedSharding"):
        meshinit.nnx.optimizer(OnOneDevice(), optax.adamw(1e-3))


TRANSFORMS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "lion": lambda: optax.lion(1e-4),
    # Its state holds a copy of the params (z): values come from the real arrays.
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-3),
}


@pytest.mark.parametrize("name", TRANSFORMS)
def test_other_transforms_match_flax_exactly_except_placement(name):
    """Same tree, Variable types, metadata and values as flax's; each leaf placed exactly."""
    model = build("disjoint", explicit=True)
    tx = TRANSFORMS[name]()
    opt = meshinit.nnx.optimizer(model, tx)
    plain = nnx.Optimizer(model, tx, wrt=nnx.Param)  # works eagerly; counts on device 0
    assert jax.tree.structure(nnx.state(opt)) == jax.tree.structure(nnx.state(plain))
    params = flat(nnx.state(model, nnx.Param))
    replicated = NamedSharding(model.stage0.w.get_value().sharding.mesh, P())
    want = flat(nnx.state(plain))
    for path, leaf in flat(nnx.state(opt)).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want[path]), err_msg=path)
        param = params.get(tuple(path[-2:]))
        if param is not None and leaf.shape == param.shape:
            assert leaf.sharding == param.sharding, path
        else:
            assert leaf.ndim == 0 and leaf.sharding == replicated, path


def test_a_transformation_reading_a_changed_dict_gets_fresh_state():
    # The step count travels with tx.init into meshinit.optax, which must still see
    # what tx.init reads: the second optimizer's state reflects the new scale.
    cfg = {"scale": 1.0}
    tx = optax.GradientTransformation(
        lambda params: jax.tree.map(lambda x: cfg["scale"] * jnp.ones_like(x), params),
        lambda updates, state, params=None: (updates, state),
    )
    model = build("disjoint", explicit=False)
    first = [np.asarray(x) for x in jax.tree.leaves(meshinit.nnx.optimizer(model, tx).opt_state)]
    cfg["scale"] = 3.0
    second = [np.asarray(x) for x in jax.tree.leaves(meshinit.nnx.optimizer(model, tx).opt_state)]
    assert len(first) == len(second) == 4  # w and b of both stages
    assert all(np.all(x == 1.0) for x in first), first
    assert all(np.all(x == 3.0) for x in second), "stale state from the first optimizer"


def test_a_model_from_meshinit_nnx_init():
    """The documented path: meshinit.nnx.init places the model, optimizer its state."""
    model = meshinit.nnx.init(lambda: build("disjoint", explicit=False))
    before = snapshot(model)
    opt = meshinit.nnx.optimizer(model, optax.adamw(1e-3))
    assert_untouched(model, before)
    for stage in ("stage0", "stage1"):
        w = getattr(model, stage).w.get_value()
        assert opt.opt_state[0].nu[stage]["w"].get_value().sharding == w.sharding
