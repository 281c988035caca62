"""Partial init (``existing``), bounded calls, the memory check and atomic failure."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RULES, Boom, assert_exact, lecun, two_stage_specs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit._run import checks as _checks
from meshinit._run import strategies as _strategies


def flat(tree):
    return {
        meshinit._paths.path_str(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


# ---------------------------------------------------------------------------- existing


def test_partial_init_places_given_arrays_and_generates_the_rest_as_a_full_init():
    plan = meshinit.plan(two_stage_specs())
    full = flat(meshinit.materialize(plan, 5))
    other_mesh = jax.make_mesh((8,), ("data",))
    restored_up = jax.device_put(jnp.full((32, 64), 3.0), NamedSharding(other_mesh, P("data")))
    host_head = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    out = meshinit.materialize(
        plan, 5, existing={"stage0.up": restored_up, "stage1.head": host_head}
    )
    assert_exact(plan, out)
    got = flat(out)
    np.testing.assert_array_equal(np.asarray(got["stage0.up"]), 3.0)
    np.testing.assert_array_equal(np.asarray(got["stage1.head"]), host_head)
    for path in ("stage0.embed", "stage0.scale", "stage1.down"):  # generated: full-init values
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(full[path]))
    assert not restored_up.is_deleted()  # moved by copy; the caller's array is untouched


def test_an_already_placed_existing_array_is_returned_as_is(count_compiles):
    plan = meshinit.plan(two_stage_specs())
    first = flat(meshinit.materialize(plan, 0))
    existing = {p: a for p, a in first.items()}
    with count_compiles() as c:
        out = flat(meshinit.materialize(plan, 1, existing=existing))
    assert all(out[p] is existing[p] for p in existing)  # nothing generated, nothing copied
    assert c.count == 0


def test_existing_problems_are_all_reported_at_once_naming_each_path():
    plan = meshinit.plan(two_stage_specs())
    with pytest.raises(meshinit.PlanError) as info:
        meshinit.materialize(
            plan,
            0,
            existing={
                "stage0.upp": np.zeros((32, 64), np.float32),
                "stage1.down": np.zeros((32, 64), np.float32),
                "stage1.head": np.zeros((32, 64), np.float16),
                "stage0.scale": [1.0] * 32,
            },
        )
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "stage0.upp: not a planned parameter" in msg and "did you mean 'stage0.up'" in msg
    assert "stage1.down: existing array has shape (32, 64), planned (64, 32)" in msg
    assert "stage1.head: existing array has dtype float16, planned float32" in msg
    assert "stage0.scale: existing value must be a jax.Array or numpy array" in msg
    assert len(info.value.problems) == 4


# ---------------------------------------------------------------------- bounded calls


def test_max_bytes_per_call_splits_calls_and_keeps_values(count_compiles):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=mesh, rules=RULES):
        specs = {
            f"l{i}": {
                "up": meshinit.param((32, 64), lecun(), axes=("embed", "mlp")),
                "down": meshinit.param((64, 32), lecun(), axes=("mlp", "embed")),
                "gate": meshinit.param(
                    (32, 64), jax.nn.initializers.normal(), axes=("embed", "mlp")
                ),
            }
            for i in range(3)
        }
    plan = meshinit.plan(specs)
    group = plan.groups[0]
    one = group.entries[0].device_bytes  # every param here: 32*64/8 floats per device
    unbounded = _strategies.Rounds()._buckets(group)
    bounded = _strategies.Rounds(max_bytes_per_call=2 * one)._buckets(group)
    assert [len(b) for b in unbounded] == [3]
    assert sorted(len(b) for b in bounded) == [1, 2]
    for bucket in bounded:
        assert sum(group.entries[group.batches[i][0]].device_bytes for i in bucket) <= 2 * one
    base = flat(meshinit.materialize(plan, 2))
    meshinit.clear_cache()
    with count_compiles() as c:
        out = meshinit.materialize(plan, 2, max_bytes_per_call=2 * one)
    assert c.count == 2  # one executable per bounded bucket
    assert_exact(plan, out)
    for path, value in flat(out).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(base[path]))


def test_a_parameter_larger_than_the_bound_is_refused_before_allocating():
    plan = meshinit.plan(two_stage_specs())
    with pytest.raises(meshinit.PlanError) as info:
        meshinit.materialize(plan, 0, max_bytes_per_call=600)
    msg = str(info.value)
    assert "stage0.embed: makes 2.0 KiB per device in one call" in msg
    assert "max_bytes_per_call=600" in msg
    assert "stage0.scale" not in msg  # 64 B: fits
    with pytest.raises(ValueError, match="positive"):
        meshinit.materialize(plan, 0, max_bytes_per_call=0)


# ---------------------------------------------------------------------- memory check


def test_memory_check_names_the_largest_parameters_on_the_worst_device(monkeypatch, new_arrays):
    plan = meshinit.plan(two_stage_specs())
    tight = {d.id: 3000 for d in jax.devices()[:4]}  # stage 0 needs 2.0 + 2.0 KiB + 64 B
    tight[jax.devices()[5].id] = 100_000

    def stats(device):
        if device.id not in tight:
            return None  # like CPU: nothing reported, nothing checked
        return {"bytes_limit": tight[device.id], "bytes_in_use": 200}

    monkeypatch.setattr(_checks, "memory_stats", stats)
    with new_arrays() as made, pytest.raises(meshinit.PlanError) as info:
        meshinit.materialize(plan, 0)
    msg = str(info.value)
    assert "do not fit in the memory planned for them" in msg
    assert "needs 4.1 KiB for its parameters but has 2.7 KiB free" in msg
    assert "stage0.embed: 2.0 KiB on this device" in msg
    assert "stage0.up: 2.0 KiB on this device" in msg
    assert "stage1" not in msg
    assert made == []  # refused before allocating anything
    tight.update({d.id: 100_000 for d in jax.devices()[:4]})
    assert_exact(plan, meshinit.materialize(plan, 0))


# ---------------------------------------------------------------------- atomic failure


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_a_failure_in_the_second_group_deletes_everything_made_but_not_existing(fail_group, error):
    plan = meshinit.plan(two_stage_specs())
    given = flat(meshinit.materialize(plan, 0))["stage0.scale"]  # already exactly placed
    moved = np.ones((64, 32), np.float32)  # a host value: placed by a copy meshinit makes
    made = fail_group(plan, error)
    with pytest.raises(error) as info:
        meshinit.materialize(plan, 1, existing={"stage0.scale": given, "stage1.down": moved})
    assert len(made) == 2  # group 0 ran: stage0.embed and stage0.up
    assert all(a.is_deleted() for a in made)
    assert not given.is_deleted()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    # stage1.down was given, so group 1 was making only stage1.head
    assert "mesh group 1" in notes and "making stage1.head" in notes
    assert "deleted the 3 arrays" in notes  # 2 generated + the copy of the host value
