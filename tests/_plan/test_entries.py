"""``PlanEntry`` and ``MeshGroup``: each parameter's block, bytes per device, and the
mesh axes that replicate it although they could shard it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lecun
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


def test_plan_on_abstract_mesh_has_sizes_without_devices():
    m = AbstractMesh((16, 16, 8), ("data", "fsdp", "tensor"))
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    with meshinit.defaults(mesh=m, rules=rules, dtype=jnp.bfloat16):
        tree = {
            "up": meshinit.param((16384, 53248), lecun(), axes=("embed", "mlp")),
            "norm": meshinit.param((16384,), jax.nn.initializers.ones, axes=("embed",)),
        }
    p = meshinit.plan(tree)
    up, norm = p.entries[1], p.entries[0]
    assert up.sharding == NamedSharding(m, P("fsdp", "tensor"))
    assert up.shard_shape == (1024, 6656) and up.device_bytes == 1024 * 6656 * 2
    assert norm.device_bytes == 16384 * 2 // 16
    assert p.nbytes == (16384 * 53248 + 16384) * 2
    assert p.groups[0].device_bytes == up.device_bytes + norm.device_bytes


M = AbstractMesh((2, 4, 1), ("data", "tensor", "pipe"))


def entry(shape, axes, mesh=M):
    return meshinit.plan(meshinit.param(shape, ones, axes=axes, mesh=mesh)).entries[0]


@pytest.mark.parametrize(
    "shape, axes, replicated, dims",
    [
        # data could shard the replicated dimension 0, or join tensor on dimension 1
        ((8, 8), (None, "tensor"), ("data",), {"data": (0, 1)}),
        ((6, 4), (None, "tensor"), ("data",), {"data": (0,)}),
        ((3, 8), (None, "tensor"), ("data",), {"data": (1,)}),
        ((16,), ("tensor",), ("data",), {"data": (0,)}),
        ((8, 8), None, ("data", "tensor"), {"data": (0, 1), "tensor": (0, 1)}),
        ((2, 12), None, ("data", "tensor"), {"data": (0, 1), "tensor": (1,)}),
    ],
)
def test_a_replicated_axis_that_could_shard_is_flagged(shape, axes, replicated, dims):
    e = entry(shape, axes)
    assert e.replicated_axes == replicated  # pipe has size 1: never counted
    assert {a: e.shard_dims(a) for a in replicated} == dims
    assert e.shardable_axes == tuple(dims)
    group = meshinit.plan({"w": meshinit.param(shape, ones, axes=axes, mesh=M)}).groups[0]
    assert group.shardable_entries == group.entries
    assert group.replicated_bytes == group.device_bytes == e.device_bytes


@pytest.mark.parametrize(
    "shape, axes, replicated",
    [
        ((8, 8), ("data", "tensor"), ()),  # every axis of size > 1 already shards it
        ((8,), (("data", "tensor"),), ()),
        ((3, 4), (None, "tensor"), ("data",)),  # 3 % 2 and 4 % (4 * 2): no room
        ((12,), ("tensor",), ("data",)),  # 12 % (4 * 2) != 0
        ((), None, ("data", "tensor")),  # a scalar has no dimension to shard
        ((0, 8), None, ("data", "tensor")),  # no elements: nothing to save
        ((3, 5), None, ("data", "tensor")),
    ],
)
def test_replication_nothing_could_shard_is_not_flagged(shape, axes, replicated):
    e = entry(shape, axes)
    assert e.replicated_axes == replicated
    assert e.shardable_axes == ()
    assert all(e.shard_dims(a) == () for a in ("data", "tensor", "pipe", "nope"))
    plan = meshinit.plan({"w": meshinit.param(shape, ones, axes=axes, mesh=M)})
    assert plan.groups[0].shardable_entries == ()
    assert plan.groups[0].replicated_bytes == 0
    assert set(plan.replicated_bytes_per_device().values()) == {0}
    assert "!" not in str(plan)


AXES = ("a", "b", "c")


@st.composite
def sharded_params(draw):
    sizes = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=3, max_size=3))
    mesh = AbstractMesh(tuple(sizes), AXES)
    ndim = draw(st.integers(0, 3))
    order = draw(st.permutations(AXES))
    cut = sorted(draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim)))
    # each dimension takes a run of the shuffled axes (possibly empty, or several)
    bounds = [0, *cut, 3][: ndim + 1] if ndim else [0]
    axes = []
    for d in range(ndim):
        names = tuple(order[bounds[d] : bounds[d + 1]])
        axes.append(None if not names else names[0] if len(names) == 1 else names)
    shape = []
    for entry_ in axes:
        names = () if entry_ is None else (entry_,) if isinstance(entry_, str) else entry_
        ways = int(np.prod([dict(zip(AXES, sizes, strict=True))[a] for a in names]))
        shape.append(ways * draw(st.integers(1, 6)))
    return mesh, tuple(shape), tuple(axes)


@settings(max_examples=150, deadline=None)
@given(sharded_params())
def test_shard_dims_are_exactly_the_shardings_the_planner_accepts(case):
    """Extending dimension d with axis a plans, and halves the bytes, iff d is in shard_dims(a)."""
    mesh, shape, axes = case
    e = entry(shape, axes, mesh)
    used = {a for x in axes if x is not None for a in ((x,) if isinstance(x, str) else x)}
    assert e.replicated_axes == tuple(a for a, n in mesh.shape.items() if n > 1 and a not in used)
    for axis in e.replicated_axes:
        for d in range(len(shape)):
            old = axes[d]
            names = () if old is None else (old,) if isinstance(old, str) else old
            extended = (*axes[:d], (*names, axis), *axes[d + 1 :])
            spec = meshinit.param(shape, ones, axes=extended, mesh=mesh)
            if d in e.shard_dims(axis):
                wider = meshinit.plan(spec).entries[0]
                assert wider.device_bytes * mesh.shape[axis] == e.device_bytes
            else:
                with pytest.raises(meshinit.PlanError, match="not divisible"):
                    meshinit.plan(spec)
    assert e.shardable_axes == tuple(a for a in e.replicated_axes if e.shard_dims(a))


def hsdp_specs(**marks):
    """An HSDP layout: sharded over fsdp, replicated over data (on purpose, or not)."""
    mesh = AbstractMesh((2, 4), ("data", "fsdp"))
    init = jax.nn.initializers.zeros
    with meshinit.defaults(mesh=mesh, **marks):
        return {
            "w": meshinit.param((16, 8), init, axes=("fsdp", None)),
            "norm": meshinit.param((16,), init, axes=(None,)),
        }


def test_replication_marked_as_intended_quiets_the_hints_only_for_those_axes():
    loud, quiet = meshinit.plan(hsdp_specs()), meshinit.plan(hsdp_specs(replicated="data"))
    assert {e.path: e.shardable_axes for e in loud.entries} == {
        "w": ("data",),
        "norm": ("data", "fsdp"),
    }
    assert {e.path: e.shardable_axes for e in quiet.entries} == {"w": (), "norm": ("fsdp",)}
    # placement and the facts are unchanged; only the hints move
    assert [e.sharding for e in quiet.entries] == [e.sharding for e in loud.entries]
    assert [e.replicated_axes for e in quiet.entries] == [e.replicated_axes for e in loud.entries]
    (group,) = quiet.groups
    assert [e.path for e in group.shardable_entries] == ["norm"]
    assert "data=2 could shard" in loud.summary() and "data=2 could shard" not in quiet.summary()
    assert "fsdp=4 could shard" in quiet.summary()
    record = {p["path"]: p for p in quiet.to_dict()["params"]}
    assert record["w"]["replicated_on_purpose"] == ["data"]
    assert record["w"]["shardable_axes"] == {}


def test_a_stage_mesh_without_the_marked_axis_is_fine():
    init = jax.nn.initializers.zeros
    with meshinit.defaults(replicated="data"):
        specs = {
            "a": meshinit.param((16,), init, mesh=AbstractMesh((2, 2), ("data", "fsdp"))),
            "b": meshinit.param((16,), init, mesh=AbstractMesh((4,), ("tensor",))),
        }
    plan = meshinit.plan(specs)
    assert [e.shardable_axes for e in plan.entries] == [("fsdp",), ("tensor",)]
