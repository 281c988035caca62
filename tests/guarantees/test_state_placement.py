"""Train state beyond its parameters: ZeRO-1 (``shard_over``) and memory kinds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_exact, lecun, on_one_device, submesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit._run import checks as _checks

normal = jax.nn.initializers.normal()


def hsdp_params(axis_type=AxisType.Explicit):
    """Parameters sharded over fsdp and tensor, replicated over data (DDP/HSDP)."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(axis_type,) * 3)
    with meshinit.defaults(mesh=mesh, replicated="data"):
        specs = {
            "embed": meshinit.param((64, 32), lecun(), axes=("tensor", "fsdp")),
            "w": meshinit.param((32, 16), lecun(), axes=("fsdp", None)),
            "norm": meshinit.param((16,), jax.nn.initializers.ones, axes=(None,)),
            "odd": meshinit.param((3, 5), lecun(), axes=(None, None)),  # nothing divides
        }
    return mesh, meshinit.materialize(meshinit.plan(specs), 0)


def assert_same_values(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def per_device(tree, device):
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


# ------------------------------------------------------------------- shard_over


def test_zero1_shards_the_moments_over_data_and_keeps_the_values():
    mesh, params = hsdp_params()
    tx = optax.adam(1e-3)
    before = jax.tree.map(lambda x: x.sharding, params)
    plain = meshinit.optax.init(tx, params)
    state = meshinit.optax.init(tx, params, shard_over="data")
    assert jax.tree.map(lambda x: x.sharding, params) == before  # parameters untouched
    mu = state[0].mu
    # the first dimension the parameter leaves unsharded, divisible by data=2
    assert mu["w"].sharding == NamedSharding(mesh, P("fsdp", "data"))
    assert mu["norm"].sharding == NamedSharding(mesh, P("data"))
    # every dimension sharded: data joins the first that stays divisible, after its axes
    assert mu["embed"].sharding == NamedSharding(mesh, P(("tensor", "data"), "fsdp"))
    # nothing divisible by 2: the parameter's own sharding
    assert mu["odd"].sharding == params["odd"].sharding
    assert state[0].count.sharding == NamedSharding(mesh, P())  # scalars stay replicated
    assert_same_values(state, tx.init(on_one_device(params)))
    device = jax.devices()[0]
    assert per_device(state, device) < per_device(plain, device)


def test_axes_are_appended_to_a_sharded_dimension_only_when_no_unsharded_one_fits():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    spec = meshinit.param((8, 3), lecun(), axes=("fsdp", None), mesh=mesh)
    params = meshinit.materialize(meshinit.plan({"w": spec}), 0)
    state = meshinit.optax.init(optax.sgd(1e-3, momentum=0.9), params, shard_over="data")
    # dimension 1 (3) is unsharded but not divisible: data goes after fsdp on dimension 0
    assert jax.tree.leaves(state)[0].sharding.spec == P(("fsdp", "data"), None)
    both = meshinit.optax.init(optax.sgd(1e-3, momentum=0.9), params, shard_over=("data", "tensor"))
    assert jax.tree.leaves(both)[0].sharding.spec == P(("fsdp", "data", "tensor"), None)


def test_stage_meshes_without_the_axis_keep_their_sharding():
    first = submesh(range(4), (2, 2), ("data", "fsdp"))
    second = submesh(range(4, 8), (4,), ("fsdp",))  # a stage mesh without data
    specs = {
        "s0": meshinit.param((16, 8), lecun(), axes=("fsdp", None), mesh=first),
        "s1": meshinit.param((16, 8), lecun(), axes=("fsdp", None), mesh=second),
    }
    params = meshinit.materialize(meshinit.plan(specs), 0)
    tx = optax.adam(1e-3)
    state = meshinit.optax.init(tx, params, shard_over="data")
    assert state[0].mu["s0"].sharding == NamedSharding(first, P("fsdp", "data"))
    assert state[0].mu["s1"].sharding == params["s1"].sharding
    assert {d.id for d in state[0].nu["s1"].sharding.device_set} == {4, 5, 6, 7}
    assert_same_values(state, tx.init(on_one_device(params)))


def test_axes_that_shard_nothing_or_are_used_already_leave_the_leaf_as_its_parameter():
    mesh = jax.make_mesh((1, 8), ("data", "fsdp"))  # data of size 1 shards nothing
    spec = meshinit.param((16, 8), lecun(), axes=("fsdp", None), mesh=mesh)
    params = meshinit.materialize(meshinit.plan({"w": spec}), 0)
    for axes in ("data", "fsdp", ("data", "fsdp")):
        state = meshinit.optax.init(optax.sgd(0.1, momentum=0.9), params, shard_over=axes)
        assert jax.tree.leaves(state)[0].sharding == params["w"].sharding, axes


def test_abstract_gives_exactly_the_shardings_init_gives():
    mesh, params = hsdp_params()
    tx = optax.adamw(1e-3)
    for options in ({"shard_over": "data"}, {"memory_kind": "pinned_host"}, {}):
        target = meshinit.optax.abstract(tx, params, **options)
        state = meshinit.optax.init(tx, params, **options)
        got = jax.tree.map(lambda x: x.sharding, target)
        assert got == jax.tree.map(lambda x: x.sharding, state), options
    # and from a Plan, before anything exists
    plan_target = meshinit.optax.abstract(
        tx,
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params),
        shard_over="data",
    )
    assert jax.tree.map(lambda x: x.sharding, plan_target) == jax.tree.map(
        lambda x: x.sharding, meshinit.optax.init(tx, params, shard_over="data")
    )


def test_a_shard_over_axis_in_no_mesh_is_named():
    _, params = hsdp_params()
    with pytest.raises(ValueError, match="'dta', which no mesh of the parameters has"):
        meshinit.optax.init(optax.adam(1e-3), params, shard_over=("dta",))
    with pytest.raises(ValueError, match="'dta'"):
        meshinit.optax.abstract(optax.adam(1e-3), params, shard_over="dta")
    with pytest.raises(TypeError, match="shard_over must be a mesh axis name"):
        meshinit.optax.init(optax.adam(1e-3), params, shard_over=3)


def test_a_training_step_keeps_the_state_shardings():
    # Auto axes: XLA moves the updates between the moments' and the parameters'
    # shardings (on Explicit axes a step says so itself, with jax.sharding.reshard).
    _, params = hsdp_params(AxisType.Auto)
    tx = optax.adam(1e-2)
    state = meshinit.optax.init(tx, params, shard_over="data")
    out = (meshinit.shardings(params), meshinit.shardings(state))

    @jax.jit
    def step(params, state):
        grads = jax.tree.map(jnp.ones_like, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step.__wrapped__, out_shardings=out)
    before = jax.tree.map(np.asarray, state)
    new_params, new_state = step(params, state)
    assert meshinit.shardings(new_state) == meshinit.shardings(state)
    assert meshinit.shardings(new_params) == meshinit.shardings(params)
    assert not np.array_equal(np.asarray(new_state[0].mu["w"]), before[0].mu["w"])  # it ran


def test_nnx_optimizer_passes_shard_over_and_memory_kind_through():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))

    class Model(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "fsdp"))
            self.w = nnx.Param(init(rngs.params(), (16, 8)))

    with jax.set_mesh(mesh):
        model = meshinit.nnx.init(lambda: Model(nnx.Rngs(0)))
    opt = meshinit.nnx.optimizer(model, optax.adam(1e-3), shard_over="data")
    mu = opt.opt_state[0].mu["w"]
    assert mu.get_value().sharding == NamedSharding(mesh, P("data", "fsdp"))
    assert mu.get_metadata()["out_sharding"] == ("data", "fsdp")  # says its own placement
    assert model.w.get_value().sharding == NamedSharding(mesh, P(None, "fsdp"))
    offloaded = meshinit.nnx.optimizer(model, optax.adam(1e-3), memory_kind="pinned_host")
    nu = offloaded.opt_state[0].nu["w"]
    assert nu.get_value().sharding.memory_kind == "pinned_host"
    assert nu.get_metadata()["memory_kind"] == "pinned_host"
    assert offloaded.step.get_value().sharding.memory_kind == "device"


# ------------------------------------------------------------------ memory kinds


def test_parameters_and_state_in_pinned_host_have_the_values_of_device_memory():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

    def specs():
        with meshinit.defaults(mesh=mesh):
            return {
                "w": meshinit.param((32, 16), lecun(), axes=("fsdp", "tensor")),
                "b": meshinit.param((16,), jax.nn.initializers.normal(), axes=("tensor",)),
                "norm": meshinit.param((16,), normal, memory_kind="device", axes=(None,)),
            }

    device_plan = meshinit.plan(specs())
    with meshinit.defaults(memory_kind="pinned_host"):
        host_specs = specs()
    host_plan = meshinit.plan(host_specs)
    entries = {e.path: e for e in host_plan.entries}
    assert entries["w"].sharding == NamedSharding(
        mesh, P("fsdp", "tensor"), memory_kind="pinned_host"
    )
    assert entries["norm"].memory_kind == "device"  # its own kind wins over defaults
    host = meshinit.materialize(host_plan, 7)
    assert_exact(host_plan, host)
    assert host["w"].sharding.memory_kind == "pinned_host"
    assert_same_values(host, meshinit.materialize(device_plan, 7))
    # optimizer state offloaded, parameters where they are
    tx = optax.adam(1e-3)
    params = meshinit.materialize(device_plan, 7)
    state = meshinit.optax.init(tx, params, memory_kind="pinned_host")
    assert state[0].mu["w"].sharding == NamedSharding(
        mesh, P("fsdp", "tensor"), memory_kind="pinned_host"
    )
    assert state[0].count.sharding.memory_kind == "device"
    assert params["w"].sharding.memory_kind == "device"
    assert_same_values(state, tx.init(on_one_device(params)))


def test_the_adapters_carry_memory_kinds():
    import equinox as eqx

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

    class Model(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.w = nnx.Param(
                init(rngs.params(), (16, 8)), out_sharding=("fsdp", None), mesh=mesh,
                memory_kind="pinned_host",
            )  # fmt: skip
            self.b = nnx.Param(jnp.zeros((8,)), out_sharding=(None,), mesh=mesh)

    model = meshinit.nnx.init(lambda: Model(nnx.Rngs(0)))
    assert model.w.get_value().sharding.memory_kind == "pinned_host"
    assert model.w.get_metadata()["memory_kind"] == "pinned_host"
    assert model.b.get_value().sharding.memory_kind == "device"
    eager = Model(nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(model.w.get_value()), np.asarray(eager.w.get_value()))

    placements = [(r".*weight", ("fsdp", None), None, "pinned_host"), (r".*bias", None)]
    mlp = meshinit.eqx.init(lambda k: eqx.nn.Linear(8, 16, key=k), 0, placements, mesh=mesh)
    assert mlp.weight.sharding == NamedSharding(mesh, P("fsdp", None), memory_kind="pinned_host")
    assert mlp.bias.sharding.memory_kind == "device"


def test_a_memory_kind_the_devices_do_not_offer_is_named_with_the_kinds_that_exist():
    mesh = jax.make_mesh((8,), ("x",))
    specs = {
        "a": meshinit.param((8,), normal, mesh=mesh, memory_kind="hbm"),
        "b": meshinit.param((8,), normal, mesh=mesh, memory_kind="pinned_host"),
    }
    with pytest.raises(meshinit.PlanError) as err:
        meshinit.plan(specs)
    (problem,) = err.value.problems
    assert problem.path == "a"
    assert "'hbm' is not offered" in problem.message and "'pinned_host'" in problem.message
    _, params = hsdp_params()
    with pytest.raises(meshinit.PlanError, match="'hbm' is not offered"):
        meshinit.optax.init(optax.adam(1e-3), params, memory_kind="hbm")
    with pytest.raises(TypeError, match="memory_kind must be"):
        meshinit.param((8,), normal, mesh=mesh, memory_kind=1)


def test_the_plan_reports_memory_kinds():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=mesh):
        specs = {
            "w": meshinit.param(
                (32, 16), lecun(), axes=("fsdp", "tensor"), memory_kind="pinned_host"
            ),
            "b": meshinit.param((16,), normal, axes=("tensor",)),
        }
    plan = meshinit.plan(specs)
    table = str(plan)
    header = next(line for line in table.splitlines() if "PartitionSpec" in line)
    assert "memory" in header.split()
    row = next(line for line in table.splitlines() if line.startswith("  w "))
    assert "pinned_host" in row.split()
    assert "per device by memory kind: 16 B in device, 256 B in pinned_host" in table
    assert "most on one device 272 B (in device memory: 16 B)" in table
    assert "pinned_host" in plan.compact()
    record = plan.to_dict()
    assert [p["memory_kind"] for p in record["params"]] == ["device", "pinned_host"]  # b, w
    assert record["meshes"][0]["device_bytes_per_memory_kind"] == {"device": 16, "pinned_host": 256}
    device = jax.devices()[0]
    assert plan.bytes_per_device(memory_kind="device")[device] == 16
    assert plan.bytes_per_device(memory_kind="pinned_host")[device] == 256
    assert plan.bytes_per_device()[device] == 272
    # a plan without memory kinds prints as before: no memory column
    plain = meshinit.plan({"b": meshinit.param((16,), normal, axes=("tensor",), mesh=mesh)})
    assert "memory" not in str(plain)


def test_the_memory_precheck_counts_device_and_host_memory_apart(monkeypatch):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=mesh):
        specs = {
            "big": meshinit.param(
                (512, 512), lecun(), axes=("fsdp", "tensor"), memory_kind="pinned_host"
            ),
            "small": meshinit.param((16,), normal, axes=("tensor",)),
        }
    plan = meshinit.plan(specs)
    # each device reports 1 KiB free: enough for `small`, not for `big` (128 KiB a device)
    monkeypatch.setattr(_checks, "memory_stats", lambda d: {"bytes_limit": 1024, "bytes_in_use": 0})
    assert_exact(plan, meshinit.materialize(plan, 0))  # big lives in host memory
    monkeypatch.setattr(_checks, "host_available", lambda: 64 * 1024)
    with pytest.raises(meshinit.PlanError, match="of host memory") as err:
        meshinit.materialize(plan, 0)
    assert [p.path for p in err.value.problems] == ["", "big"]


def test_offloaded_parameters_are_made_shard_by_shard_into_host_memory():
    import re

    from meshinit._run import strategies as _strategies

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    spec = meshinit.param(
        (512, 1024), lecun(), axes=("fsdp", "tensor"), mesh=mesh, memory_kind="pinned_host"
    )
    group = meshinit.plan({"w": spec}).groups[0]
    (exe,) = _strategies.Rounds().executables(group, "threefry2x32")
    # the compiled call itself puts its output in host memory: no device_put afterwards
    assert [s.memory_kind for s in exe.output_shardings] == ["pinned_host"]
    shapes = re.findall(r"\bf32\[([\d,]*)\]", exe.as_text())
    largest = max(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)
    assert largest <= 512 * 1024 // 8  # per-device programs see only their shard


@pytest.mark.parametrize("options", [{"shard_over": "data"}, {"memory_kind": "pinned_host"}])
def test_orbax_restores_zero1_and_offloaded_state_onto_the_abstract_target(tmp_path, options):
    ocp = pytest.importorskip("orbax.checkpoint")
    _, params = hsdp_params()
    tx = optax.adam(1e-3)
    state = jax.tree.map(lambda x: x + 1, meshinit.optax.init(tx, params, **options))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "opt", state)
        checkpointer.wait_until_finished()
        target = meshinit.optax.abstract(tx, params, **options)
        restored = checkpointer.restore(tmp_path / "opt", target)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_linen_reads_the_memory_kind_from_defaults():
    import flax.linen as nn

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    dense = nn.Dense(
        8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("fsdp", "tensor"))
    )
    x = np.ones((2, 16), np.float32)
    with meshinit.defaults(memory_kind="pinned_host"):
        variables = meshinit.linen.init(
            dense, jax.random.key(0), x, mesh=mesh, default="replicated"
        )
    kernel = variables["params"]["kernel"].value
    assert kernel.sharding == NamedSharding(mesh, P("fsdp", "tensor"), memory_kind="pinned_host")
    eager = dense.init(jax.random.key(0), x)["params"]["kernel"].value
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(eager))
