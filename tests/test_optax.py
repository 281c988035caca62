"""meshinit.optax: optimizer state on its parameters' exact shardings, on any meshes."""

import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import on_one_device
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
import meshinit.optax
from meshinit import _paths
from meshinit._run import checks as _checks
from meshinit._run import compile as _compile


def mesh(ids, shape, explicit):
    devices = [jax.devices()[i] for i in ids]
    if explicit:
        return jax.make_mesh(shape, ("data", "model"), devices=devices)
    return Mesh(np.array(devices).reshape(shape), ("data", "model"))


def meshes(layout, explicit):
    """Two meshes: disjoint (devices 0-3 and 4-7), or the same (2, 4) mesh twice."""
    if layout == "disjoint":
        return mesh(range(4), (2, 2), explicit), mesh(range(4, 8), (2, 2), explicit)
    shared = mesh(range(8), (2, 4), explicit)
    return shared, shared


def place(value, m, spec):
    return jax.device_put(value, NamedSharding(m, spec))


def make_params(layout, explicit):
    m1, m2 = meshes(layout, explicit)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "embed": {"w": place(rand(16, 8), m1, P("data", "model"))},
        "layers": [
            {"w": place(rand(8, 8), m1, P(None, "model")), "b": place(rand(8), m1, P())},
            {"w": place(rand(8, 8), m2, P("model", None)), "b": place(rand(8), m2, P("data"))},
        ],
        "head": {"w": place(rand(8, 16), m2, P("data", "model"))},
    }


def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda p, _: "decay" if _paths.path_str(p).endswith("w") else "none", params
    )


TRANSFORMS = {
    "adamw": lambda params: optax.adamw(1e-3),
    "sgd_momentum": lambda params: optax.sgd(0.1, momentum=0.9),
    "clip_adam": lambda params: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "multi_transform": lambda params: optax.multi_transform(
        {"decay": optax.adamw(1e-3), "none": optax.sgd(0.1, momentum=0.9)}, labels(params)
    ),
    "lookahead": lambda params: optax.lookahead(
        optax.adam(1e-3), sync_period=5, slow_step_size=0.5
    ),
    # Its state holds a copy of the parameters (z), so values come from the real arrays.
    "schedule_free": lambda params: optax.contrib.schedule_free_adamw(1e-3),
}


def wrap(name, params):
    # lookahead trains fast and slow parameters: its params tree is LookaheadParams
    return optax.LookaheadParams.init_synced(params) if name == "lookahead" else params


def flat_params(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {_paths.path_str(p): x for p, x in flat}


def mirrored(state_path, leaf, params_by_path):
    """The parameter a state leaf mirrors, by the documented rule, or None."""
    same = {p: x for p, x in params_by_path.items() if x.shape == leaf.shape}
    whole = [p for p in same if state_path == p or state_path.endswith("." + p)]
    if whole:
        return same[max(whole, key=len)]

    def tail(p):
        a, b, n = state_path.split("."), p.split("."), 0
        while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
            n += 1
        return n

    best = max(same, key=tail, default=None)  # max keeps the first on ties
    return same[best] if best is not None and tail(best) > 0 else None


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("layout", ["disjoint", "shared"])
@pytest.mark.parametrize("name", TRANSFORMS)
def test_init_places_every_leaf_exactly_with_tx_init_values(name, layout, explicit, count_compiles):
    params = wrap(name, make_params(layout, explicit))
    tx = TRANSFORMS[name](params)
    scalars_mesh = jax.tree.leaves(params)[0].sharding.mesh

    with count_compiles() as first:
        state = meshinit.optax.init(tx, params)
    n_meshes = 2 if layout == "disjoint" else 1
    assert first.count == n_meshes, "one compiled computation per mesh group"

    reference = tx.init(on_one_device(params))
    assert jax.tree.structure(state) == jax.tree.structure(reference)
    by_path = flat_params(params)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    n_mirrors = 0
    for (p, got), want in zip(leaves, jax.tree.leaves(reference), strict=True):
        path = _paths.path_str(p)
        assert got.shape == want.shape and got.dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
        param = mirrored(path, got, by_path)
        if param is None:
            assert got.sharding == NamedSharding(scalars_mesh, P()), path
            assert got.ndim == 0, f"{path}: a non-scalar leaf should mirror a parameter"
        else:
            n_mirrors += 1
            assert got.sharding == param.sharding, path
            if not param.sharding.is_fully_replicated:
                assert not got.sharding.is_fully_replicated, path
    assert n_mirrors >= len(by_path), "every parameter has at least one mirror here"

    with count_compiles() as again:
        state2 = meshinit.optax.init(tx, params)
    assert again.count == 0, "same tx and structure: nothing compiles"
    assert jax.tree.map(lambda a, b: a.sharding == b.sharding, state, state2)


@pytest.mark.parametrize(
    "name",  # the fast tier: one plain, one of two labelled parts, one holding the params
    [
        n
        if n in ("adamw", "multi_transform", "schedule_free")
        else pytest.param(n, marks=pytest.mark.slow)
        for n in TRANSFORMS
    ],
)
def test_abstract_matches_init_and_allocates_nothing(name, new_arrays):
    params = wrap(name, make_params("disjoint", explicit=False))
    tx = TRANSFORMS[name](params)
    structs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )
    with new_arrays() as made:
        target = meshinit.optax.abstract(tx, structs)
        from_arrays = meshinit.optax.abstract(tx, params)
    assert not made, f"abstract allocated {len(made)} arrays"
    state = meshinit.optax.init(tx, params)
    assert jax.tree.structure(target) == jax.tree.structure(state)
    for t, a, s in zip(
        jax.tree.leaves(target), jax.tree.leaves(from_arrays), jax.tree.leaves(state), strict=True
    ):
        assert isinstance(t, jax.ShapeDtypeStruct)
        assert (t.shape, t.dtype, t.sharding) == (s.shape, s.dtype, s.sharding)
        assert (a.shape, a.dtype, a.sharding) == (s.shape, s.dtype, s.sharding)


def test_abstract_accepts_a_plan():
    m = mesh(range(8), (2, 4), explicit=False)
    init = jax.nn.initializers.normal()
    plan = meshinit.plan(
        {
            "w": meshinit.param((8, 16), init, axes=("data", "model"), mesh=m),
            "b": meshinit.param((16,), init, axes=("model",), mesh=m),
        }
    )
    target = meshinit.optax.abstract(optax.adamw(1e-3), plan)
    entries = {e.path: e for e in plan.entries}
    assert target[0].mu["w"].sharding == entries["w"].sharding
    assert target[0].nu["b"].sharding == entries["b"].sharding
    assert target[0].count.sharding == NamedSharding(m, P())
    params = meshinit.materialize(plan, 0)
    state = meshinit.optax.init(optax.adamw(1e-3), params)
    assert meshinit.shardings(state) == meshinit.shardings(target)


@pytest.mark.parametrize("layout", ["disjoint", "shared"])
def test_scalars_on_puts_the_scalars_where_asked(layout, count_compiles):
    params = make_params(layout, explicit=False)
    elsewhere = mesh([7, 6, 5, 4, 3, 2, 1, 0], (2, 4), explicit=False)  # no group's mesh
    for target in (meshes(layout, False)[1], elsewhere):
        tx = optax.adam(1e-3)
        state = meshinit.optax.init(tx, params, scalars_on=target)
        assert state[0].count.sharding == NamedSharding(target, P())
        assert state[0].mu["head"]["w"].sharding == params["head"]["w"].sharding
        assert meshinit.optax.abstract(tx, params, scalars_on=target)[0].count.sharding == (
            NamedSharding(target, P())
        )
        assert int(state[0].count) == 0


def test_a_failing_later_group_deletes_what_was_made(new_arrays):
    params = make_params("disjoint", explicit=False)
    tx = optax.adam(1e-3)
    meshinit.clear_cache()
    meshinit.optax.init(tx, params)  # fills the cache
    # the one cache holds the state's layout and each mesh group's step, (key, "step", i)
    steps = [k for k in _compile.executables if k[0][1:2] == ("step",)]
    assert len(steps) == 2, "one step per mesh of the disjoint layout"

    def broken(*args):
        raise RuntimeError("device lost")

    _compile.executables[max(steps, key=lambda k: k[0][2])] = broken
    try:
        with new_arrays() as made:
            with pytest.raises(RuntimeError, match="device lost") as info:
                meshinit.optax.init(tx, params)
    finally:
        meshinit.clear_cache()  # every adam(1e-3) shares the entry: drop the broken one
    assert not made, f"{len(made)} state arrays survived a failed init"
    second = params["head"]["w"].sharding.mesh
    assert info.value.__notes__ == [
        f"meshinit.optax: while making the state leaves on the mesh {second}",
        "meshinit.optax: deleted the 7 state arrays it had made",  # count, mu and nu on m1
    ]


def test_unplaced_params_are_refused_with_their_paths():
    with pytest.raises(TypeError, match=r"b: ndarray"):
        meshinit.optax.init(optax.adam(1e-3), {"b": np.ones(3)})


def test_importing_meshinit_does_not_import_optax():
    code = (
        "import meshinit, sys; assert 'optax' not in sys.modules; "
        "meshinit.optax; assert 'optax' in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_shardings_of_arrays_structs_and_state():
    params = make_params("disjoint", explicit=True)
    got = meshinit.shardings(params)
    assert got["layers"][1]["b"] == params["layers"][1]["b"].sharding
    structs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )
    assert meshinit.shardings(structs) == got
    state = meshinit.optax.init(optax.sgd(0.1, momentum=0.9), params)
    assert meshinit.shardings(state)[0].trace["embed"]["w"] == got["embed"]["w"]


def test_shardings_refuses_leaves_without_one():
    with pytest.raises(meshinit.PlanError, match=r"a\.b: a ndarray with no sharding"):
        meshinit.shardings({"a": {"b": np.ones(2)}})


def test_shardings_of_an_nnx_module():
    nnx = pytest.importorskip("flax.nnx")
    m = mesh(range(8), (2, 4), explicit=False)

    class Linear(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(place(np.ones((8, 8), np.float32), m, P(None, "model")))

    got = meshinit.shardings(Linear())
    assert got["w"].get_value() == NamedSharding(m, P(None, "model"))


def custom(init_fn):
    return optax.GradientTransformation(init_fn, lambda u, s, p=None: (u, s))


def test_a_leaf_that_reads_another_meshs_parameter_is_refused():
    def init_fn(params):
        # mirrors embed.w (mesh 1) but also reads head.w (mesh 2)
        return {"w": params["embed"]["w"] + params["head"]["w"].sum()}

    tx = custom(init_fn)
    with pytest.raises(ValueError, match=r"w: placed on Mesh\(.*\) but reads head\.w"):
        meshinit.optax.init(tx, make_params("disjoint", explicit=False))
    # On one mesh the same transform is fine, and computed from the real values.
    params = make_params("shared", explicit=False)
    state = meshinit.optax.init(tx, params)
    np.testing.assert_allclose(
        np.asarray(state["w"]), np.asarray(init_fn(on_one_device(params))["w"]), rtol=1e-6
    )
    assert state["w"].sharding == params["embed"]["w"].sharding


def test_a_jitted_init_over_the_whole_tree_reads_each_parameter_apart(count_compiles):
    tx = custom(jax.jit(lambda params: {"copy": jax.tree.map(lambda x: 2 * x, params)}))
    params = make_params("disjoint", explicit=True)
    state = meshinit.optax.init(tx, params)
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(state["copy"])[0], jax.tree.leaves(params), strict=True
    ):
        assert got.sharding == want.sharding, _paths.path_str(path)
        np.testing.assert_array_equal(np.asarray(got), 2 * np.asarray(want))


def scaled_ones(read_scale):
    """A transformation whose init reads its scale from outside, at trace time."""
    return custom(lambda params: jax.tree.map(lambda x: read_scale() * jnp.ones_like(x), params))


class Config:  # hashed by identity: no value fingerprint, so the traced program tells
    scale = 1.0


@pytest.mark.parametrize("holder", ["dict", "object"])
def test_an_init_reading_state_changed_between_calls_gets_fresh_state(holder):
    # The same tx twice, its init reading cfg["scale"] (a dict, by its contents) or
    # cfg.scale (an object only its traced program describes): the second state must
    # reflect the new value, not reuse the program compiled for the old one.
    cfg = {"scale": 1.0} if holder == "dict" else Config()
    read = (lambda: cfg["scale"]) if holder == "dict" else (lambda: cfg.scale)
    tx = scaled_ones(read)
    params = make_params("disjoint", explicit=False)
    first = meshinit.optax.init(tx, params)
    if holder == "dict":
        cfg["scale"] = 3.0
    else:
        cfg.scale = 3.0
    second = meshinit.optax.init(tx, params)
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(first)[0], jax.tree.leaves(second), strict=True
    ):
        assert np.all(np.asarray(a) == 1.0), _paths.path_str(path)
        assert np.all(np.asarray(b) == 3.0), f"{_paths.path_str(path)}: stale state"


def test_the_same_hyperparameters_compile_nothing_the_second_time(count_compiles):
    # The same adamw(1e-3), and a fresh one: what tx.init computes is the same, so the
    # second and third calls reuse the first call's programs.
    params = make_params("disjoint", explicit=False)
    tx = optax.adamw(1e-3)
    meshinit.clear_cache()
    with count_compiles() as first:
        want = meshinit.optax.init(tx, params)
    with count_compiles() as again:
        meshinit.optax.init(tx, params)
    with count_compiles() as fresh:
        got = meshinit.optax.init(optax.adamw(1e-3), params)
    assert first.count == 2, "one program per mesh"
    assert again.count == 0 and fresh.count == 0, (again.count, fresh.count)
    assert meshinit.shardings(got) == meshinit.shardings(want)
    # A deep chain has no closure fingerprint (too nested); its traced program has one.
    multi = lambda: TRANSFORMS["multi_transform"](params)  # noqa: E731
    meshinit.optax.init(multi(), params)
    with count_compiles() as deep:
        meshinit.optax.init(multi(), params)
    assert deep.count == 0, "a fresh multi_transform with the same hyperparameters"


def test_without_optax_the_adapter_says_how_to_install_it():
    code = (
        "import sys; sys.modules['optax'] = None\n"
        "import meshinit\n"
        "try:\n    meshinit.optax\nexcept ImportError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "meshinit.optax needs optax: pip install 'meshinit[optax]'" in r.stdout, (
        r.stdout + r.stderr
    )


def test_a_single_array_and_an_empty_state():
    m = mesh(range(8), (2, 4), explicit=False)
    w = place(np.arange(32, dtype=np.float32).reshape(4, 8), m, P("data", "model"))
    state = meshinit.optax.init(optax.adam(1e-3), w)
    assert state[0].mu.sharding == w.sharding and state[0].nu.sharding == w.sharding
    assert state[0].count.sharding == NamedSharding(m, P())
    assert meshinit.optax.init(optax.identity(), {"w": w}) == optax.EmptyState()


def test_abstract_is_an_orbax_restore_target_on_disjoint_meshes(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = make_params("disjoint", explicit=False)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = meshinit.optax.init(tx, params)
    # not the initial zeros, so the restore shows real values (leaf by leaf: one update
    # step cannot mix disjoint meshes)
    state = jax.tree.map(lambda x: x + 1, state)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "opt", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "opt", meshinit.optax.abstract(tx, params))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(state), strict=True
    ):
        assert got.sharding == want.sharding, _paths.path_str(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name", ["adamw", "schedule_free"])
def test_init_ignores_an_active_context_mesh(name):
    params = make_params("disjoint", explicit=True)
    tx = TRANSFORMS[name](params)
    with jax.set_mesh(jax.make_mesh((4, 2), ("x", "y"))):
        state = meshinit.optax.init(tx, params)
    assert meshinit.shardings(state) == meshinit.shardings(meshinit.optax.abstract(tx, params))
    for got, want in zip(
        jax.tree.leaves(state), jax.tree.leaves(tx.init(on_one_device(params))), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_init_logs_nothing_and_draws_no_bar(caplog, capfd):
    params = make_params("shared", explicit=False)
    meshinit.clear_cache()  # compiles too: no DEBUG line for those either
    with caplog.at_level(logging.DEBUG, logger="meshinit"):
        meshinit.optax.init(optax.adam(1e-3), params)
    assert caplog.records == []
    assert capfd.readouterr().err == ""


def test_a_state_that_cannot_fit_is_refused_before_anything_is_made(monkeypatch, new_arrays):
    # The run loop's memory check, shared with the spec path and the engine: the state
    # alone needs more than the devices have free, so allocating it would fail anyway.
    params = make_params("shared", explicit=False)
    monkeypatch.setattr(_checks, "memory_stats", lambda d: {"bytes_limit": 64, "bytes_in_use": 0})
    with new_arrays() as made:
        with pytest.raises(meshinit.PlanError, match="do not fit in the memory planned for them"):
            meshinit.optax.init(optax.adam(1e-3), params)
    assert not made
