"""Training after init: the functional train step keeps every parameter and state leaf
on its own mesh, and the limits of one jit over several meshes (docs/train_state.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import on_one_device
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
import meshinit.optax

LECUN = jax.nn.initializers.lecun_normal()
D_IN, D_HIDDEN, D_OUT, BATCH = 16, 32, 8, 4


def shared_meshes(axis_type):
    """A (2, 4) ("fsdp", "tensor") mesh and an (8,) ("data",) mesh over the same devices."""
    return (
        jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(axis_type,) * 2),
        jax.make_mesh((8,), ("data",), axis_types=(axis_type,)),
    )


def disjoint_meshes(axis_type):
    """Two stages: a (2, 2) mesh over devices 0-3 and a (4,) mesh over devices 4-7."""
    devices = jax.devices()
    return (
        jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[:4], axis_types=(axis_type,) * 2),
        jax.make_mesh((4,), ("data",), devices=devices[4:], axis_types=(axis_type,)),
    )


def model_specs(first, second):
    return {
        "stage0": {
            "w": meshinit.param((D_IN, D_HIDDEN), LECUN, mesh=first, axes=("fsdp", "tensor")),
            "b": meshinit.param((D_HIDDEN,), jax.nn.initializers.zeros, mesh=first),
        },
        "stage1": {
            "w": meshinit.param((D_HIDDEN, D_OUT), LECUN, mesh=second, axes=("data", None)),
        },
    }


def forward0(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def loss1(p, h, y):
    return jnp.mean((h @ p["w"] - y) ** 2)


def loss(params, x, y):
    return loss1(params["stage1"], forward0(params["stage0"], x), y)


TX = optax.adamw(1e-2, weight_decay=0.1)


def train_step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = rng.standard_normal((BATCH, D_OUT)).astype(np.float32)
    return x, y


def sharded_step(params, opt_state):
    """``train_step`` under one jit whose out_shardings keep every leaf where it is."""
    return jax.jit(
        train_step,
        out_shardings=(meshinit.shardings(params), meshinit.shardings(opt_state), None),
    )


def reference_step(params):
    """The same step, params and state on one device."""
    params = on_one_device(params)
    return jax.jit(train_step)(params, TX.init(params), *batch())


def wrong_shardings(before, after):
    """The paths whose leaf does not carry exactly its original sharding."""
    flat_before = jax.tree_util.tree_flatten_with_path(before)[0]
    flat_after = jax.tree_util.tree_flatten_with_path(after)[0]
    assert [p for p, _ in flat_before] == [p for p, _ in flat_after]
    return [
        f"{jax.tree_util.keystr(p)}: {b.sharding} -> {a.sharding}"
        for (p, b), (_, a) in zip(flat_before, flat_after, strict=True)
        if a.sharding != b.sharding
    ]


def assert_close(got, want):
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree.leaves(want)
    for (path, g), w in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


# ------------------------------------------------------------ one jit, shared devices


def test_one_jit_step_on_auto_meshes_over_shared_devices_keeps_every_sharding():
    params = meshinit.materialize(meshinit.plan(model_specs(*shared_meshes(AxisType.Auto))), 0)
    opt_state = meshinit.optax.init(TX, params)
    step = sharded_step(params, opt_state)

    # The batch goes in placed, as docs/train_state.md advises.
    placed = jax.device_put(batch(), NamedSharding(params["stage0"]["w"].sharding.mesh, P("fsdp")))
    new_params, new_state, value = step(params, opt_state, *placed)

    assert not wrong_shardings(params, new_params)
    assert not wrong_shardings(opt_state, new_state)
    # The step computed what it computes on one device.
    want_params, want_state, want_value = reference_step(params)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    assert_close(new_params, want_params)
    assert_close(new_state, want_state)
    # and it moved the parameters
    assert not np.allclose(new_params["stage1"]["w"], params["stage1"]["w"])


def test_one_jit_step_without_out_shardings_moves_parameters_off_their_mesh():
    # Why the recipe passes out_shardings: without them every output resolves onto one
    # mesh, so some parameter leaves its own.
    params = meshinit.materialize(meshinit.plan(model_specs(*shared_meshes(AxisType.Auto))), 0)
    opt_state = meshinit.optax.init(TX, params)

    new_params, new_state, _ = jax.jit(train_step)(params, opt_state, *batch())

    moved = wrong_shardings(params, new_params) + wrong_shardings(opt_state, new_state)
    assert moved, "expected jit without out_shardings to put every output on one mesh"


def test_one_jit_step_on_explicit_meshes_is_rejected_even_over_shared_devices():
    params = meshinit.materialize(meshinit.plan(model_specs(*shared_meshes(AxisType.Explicit))), 0)
    opt_state = meshinit.optax.init(TX, params)
    step = sharded_step(params, opt_state)
    with pytest.raises(ValueError, match="Mesh for all inputs should be equal"):
        step(params, opt_state, *batch())


# ------------------------------------------------------------ disjoint meshes


@pytest.mark.parametrize(
    "axis_type, message",
    [
        (AxisType.Auto, "Received incompatible devices for jitted computation"),
        (AxisType.Explicit, "Mesh for all inputs should be equal"),
    ],
)
def test_one_jit_step_over_disjoint_meshes_fails(axis_type, message):
    params = meshinit.materialize(meshinit.plan(model_specs(*disjoint_meshes(axis_type))), 0)
    opt_state = meshinit.optax.init(TX, params)  # init works on disjoint meshes
    step = sharded_step(params, opt_state)
    with pytest.raises(ValueError, match=message):
        step(params, opt_state, *batch())


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_per_stage_steps_over_disjoint_meshes_keep_shardings_and_values(axis_type):
    mesh0, mesh1 = disjoint_meshes(axis_type)
    params = meshinit.materialize(meshinit.plan(model_specs(mesh0, mesh1)), 0)
    stages = ("stage0", "stage1")
    # One optimizer state per stage, each on its stage's mesh (step count included).
    states = {s: meshinit.optax.init(TX, params[s]) for s in stages}
    x, y = batch()

    # Forward and backward, one jit per stage; activations and their cotangents cross
    # between the stages with device_put.
    h = jax.jit(forward0)(params["stage0"], jax.device_put(x, NamedSharding(mesh0, P())))
    value, (grads1, grad_h) = jax.jit(jax.value_and_grad(loss1, argnums=(0, 1)))(
        params["stage1"], jax.device_put(h, NamedSharding(mesh1, P())), y
    )

    def backward0(p, x, cotangent):
        return jax.vjp(lambda p: forward0(p, x), p)[1](cotangent)[0]

    # The cotangent goes back with the activation's own sharding (Explicit meshes
    # check that it matches the output's type, "@tensor" included).
    grads0 = jax.jit(backward0)(params["stage0"], x, jax.device_put(grad_h, h.sharding))
    grads = {"stage0": grads0, "stage1": grads1}

    def update(grads, opt_state, params):
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    new_params, new_states = {}, {}
    for s in stages:
        stage_update = jax.jit(
            update, out_shardings=(meshinit.shardings(params[s]), meshinit.shardings(states[s]))
        )
        new_params[s], new_states[s] = stage_update(grads[s], states[s], params[s])

    assert not wrong_shardings(params, new_params)
    assert not wrong_shardings(states, new_states)
    assert {d.id for d in new_states["stage1"][0].count.devices()} == {4, 5, 6, 7}
    # Same values as the one-jit step on one device (adamw updates each leaf on its own,
    # so a state per stage is the same as one state for the whole tree).
    want_params, want_state, want_value = reference_step(params)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    assert_close(new_params, want_params)
    want_mu = want_state[0].mu
    for s in stages:
        assert_close(new_states[s][0].mu, want_mu[s])
        assert_close(new_states[s][0].nu, want_state[0].nu[s])
