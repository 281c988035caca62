"""``Plan``'s byte accounting: the bytes each device holds, meshes over shared devices
added up, abstract meshes counted per position."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh

import meshinit

ones = jax.nn.initializers.ones


def make_mesh(shape, names, devices, explicit):
    if explicit:
        return jax.make_mesh(shape, names, devices=devices)
    return Mesh(np.array(devices).reshape(shape), names)


def specs_on(m1, m2):
    """Parameters on two meshes: sharded, partly and fully replicated, two dtypes."""
    return {
        "a": meshinit.param((16, 32), ones, axes=(m1.axis_names[0], m1.axis_names[1]), mesh=m1),
        "b": meshinit.param((8, 24), ones, axes=(None, m1.axis_names[1]), mesh=m1),
        "c": meshinit.param((6,), ones, mesh=m1, dtype=jnp.bfloat16),
        "d": meshinit.param((64, 8), ones, axes=(m2.axis_names[0], None), mesh=m2),
        "e": meshinit.param((40,), ones, mesh=m2, dtype=jnp.bfloat16),
    }


def measured_bytes(arrays) -> dict:
    """Bytes each device really holds: the sum of its addressable shards."""
    out: dict = collections.Counter()
    for array in jax.tree.leaves(arrays):
        for shard in array.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return dict(out)


def two_layouts(explicit):
    devices = jax.devices()
    return {
        "shared": (
            make_mesh((2, 4), ("x", "y"), devices, explicit),
            make_mesh((8,), ("z",), devices, explicit),
        ),
        "disjoint": (
            make_mesh((2, 2), ("x", "y"), devices[:4], explicit),
            make_mesh((4,), ("z",), devices[4:], explicit),
        ),
        "overlapping": (
            make_mesh((2, 4), ("x", "y"), devices, explicit),
            make_mesh((2,), ("z",), devices[2:4], explicit),
        ),
    }


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("layout", ["shared", "disjoint", "overlapping"])
def test_device_bytes_equal_the_shards_each_device_holds_after_materialize(explicit, layout):
    m1, m2 = two_layouts(explicit)[layout]
    plan = meshinit.plan(specs_on(m1, m2))
    assert len(plan.groups) == 2
    arrays = meshinit.materialize(plan, 0)
    got = plan.bytes_per_device()
    assert got == measured_bytes(arrays)
    assert set(got) == set(m1.devices.flat) | set(m2.devices.flat)
    assert plan.max_device_bytes == max(measured_bytes(arrays).values())


def test_meshes_over_the_same_devices_add_up_and_disjoint_ones_do_not():
    layouts = two_layouts(explicit=True)
    shared = meshinit.plan(specs_on(*layouts["shared"]))
    g1, g2 = (g.device_bytes for g in shared.groups)
    # a: 8*8*4, b: 8*6*4, c: 6*2 on each device of (2, 4); d: 8*8*4, e: 40*2 on (8,)
    assert (g1, g2) == (256 + 192 + 12, 256 + 80)
    assert set(shared.bytes_per_device().values()) == {g1 + g2}
    assert shared.max_device_bytes == g1 + g2

    disjoint = meshinit.plan(specs_on(*layouts["disjoint"]))
    h1, h2 = (g.device_bytes for g in disjoint.groups)
    per_device = disjoint.bytes_per_device()
    devices = jax.devices()
    assert [per_device[d] for d in devices] == [h1] * 4 + [h2] * 4
    assert disjoint.max_device_bytes == max(h1, h2)


def test_an_empty_plan_holds_nothing():
    plan = meshinit.plan({"not a spec": 1.0})
    assert plan.bytes_per_device() == {} and plan.replicated_bytes_per_device() == {}
    assert plan.max_device_bytes == 0
    assert "most on one device 0 B" in str(plan)


@pytest.mark.parametrize("layout", ["shared", "disjoint"])
def test_abstract_meshes_give_the_concrete_numbers_per_position(layout):
    m1, m2 = two_layouts(explicit=True)[layout]
    a1 = AbstractMesh(m1.axis_sizes, m1.axis_names, m1.axis_types)
    a2 = AbstractMesh(m2.axis_sizes, m2.axis_names, m2.axis_types)
    concrete = meshinit.plan(specs_on(m1, m2))
    abstract = meshinit.plan(specs_on(a1, a2))
    assert [g.device_bytes for g in abstract.groups] == [g.device_bytes for g in concrete.groups]
    per_device = abstract.bytes_per_device()
    # Abstract meshes never share devices: one key per position of each mesh.
    assert len(per_device) == a1.size + a2.size
    for group, concrete_group in zip(abstract.groups, concrete.groups, strict=True):
        for i in range(group.mesh.size):
            assert per_device[(group.mesh, i)] == concrete_group.device_bytes
    if layout == "disjoint":
        assert abstract.max_device_bytes == concrete.max_device_bytes
    else:  # concrete meshes on the same devices add up; abstract ones cannot know that
        assert abstract.max_device_bytes == max(g.device_bytes for g in abstract.groups)
        assert concrete.max_device_bytes == sum(g.device_bytes for g in abstract.groups)


def test_2048_device_abstract_mesh_has_one_entry_per_device():
    mesh = AbstractMesh((16, 16, 8), ("data", "fsdp", "tensor"))
    plan = meshinit.plan(
        [meshinit.param((1024, 512), ones, axes=("fsdp", "tensor"), mesh=mesh, dtype=jnp.bfloat16)]
    )
    per_device = plan.bytes_per_device()
    assert list(per_device) == [(mesh, i) for i in range(2048)]
    assert set(per_device.values()) == {64 * 64 * 2}
    assert plan.replicated_bytes_per_device() == per_device  # data=16 could shard dimension 0


# --------------------------------------------------- replication marked as intended


def test_the_adapters_read_the_replication_mark_from_defaults():
    from flax import nnx

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))

    class Layer(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))
            self.w = nnx.Param(init(rngs.params(), (16, 8)))

    with jax.set_mesh(mesh):
        loud = meshinit.nnx.plan(lambda: Layer(nnx.Rngs(0)))
        with meshinit.defaults(replicated=("data",)):
            quiet = meshinit.nnx.plan(lambda: Layer(nnx.Rngs(0)))
    assert loud.entries[0].shardable_axes == ("data",)
    assert quiet.entries[0].shardable_axes == ()
