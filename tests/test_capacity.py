"""Capacity planning: per-device bytes, replicated bytes, and how the table shows them."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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


def test_uneven_shardings_are_rejected_so_every_device_of_a_mesh_holds_the_same():
    with pytest.raises(meshinit.PlanError, match="dimension 0 of size 6 is not divisible"):
        meshinit.plan(meshinit.param((6,), ones, axes=("tensor",), mesh=M))


def llama_like(mesh, layers=3):
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    lecun = jax.nn.initializers.lecun_normal()
    with meshinit.defaults(mesh=mesh, rules=rules, dtype=jnp.bfloat16):
        return {
            "embed": meshinit.param((4096, 256), lecun, axes=("vocab", "embed")),
            "layers": [
                {
                    "mlp": {
                        "a_rather_long_name_for_the_up_projection": meshinit.param(
                            (256, 1024), lecun, axes=("embed", "mlp")
                        ),
                        "odd": meshinit.param((3, 5), lecun, axes=(None, None)),
                    },
                    "norm": meshinit.param((256,), ones, axes=("embed",)),
                }
                for _ in range(layers)
            ],
        }


def test_table_marks_params_that_an_unused_axis_could_shard_and_totals_them():
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    plan = meshinit.plan(llama_like(mesh))
    text = str(plan)
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("  layers.")}
    assert rows["layers.0.norm"].endswith("!")  # (256,) on fsdp: data and tensor could shard
    assert not rows["layers.0.mlp.odd"].endswith("!")  # (3, 5): nothing divides
    # every param but the 3 odd ones is replicated across data, which could shard it
    flagged = plan.groups[0].shardable_entries
    assert len(flagged) == 1 + 2 * 3
    nbytes = plan.groups[0].replicated_bytes
    assert nbytes == sum(e.device_bytes for e in flagged)
    # bf16: embed and up on fsdp and tensor (4 ways), the norms on fsdp (2 ways)
    assert nbytes == (4096 * 256 + 3 * 256 * 1024) * 2 // 4 + 3 * 256 * 2 // 2
    human = meshinit._format.human_bytes
    lines = text.splitlines()
    assert (
        f"  ! 7 params replicated across an axis that could shard them: {human(nbytes)} per device"
        in lines
    )
    # the second path would pass 100 columns: one path, then a count
    assert f"    data=2 could shard 7 ({human(nbytes)} per device): embed and 6 more" in lines
    assert (
        "    tensor=2 could shard 3 (768 B per device): layers.0.norm, layers.1.norm, layers.2.norm"
        in lines
    )
    assert "fsdp=2 could" not in text  # fsdp shards every parameter that it could
    footer = lines[-6:]  # the rows are as wide as the paths; the totals fit in 100 columns
    assert footer[0] == "  10 params, 3.5 MiB in all, 896.8 KiB per device"
    assert all(len(line) <= 100 for line in footer)


def test_summary_has_the_totals_without_the_rows():
    devices = jax.devices()
    m1 = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=devices)
    m2 = jax.make_mesh((8,), ("fsdp",), devices=devices)
    tree = {"one": llama_like(m1, layers=40), "two": llama_like(m2, layers=1)}
    plan = meshinit.plan(tree)
    summary = plan.summary()
    assert "PartitionSpec" not in summary and "layers.0.mlp.odd" not in summary
    g1, g2 = plan.groups
    assert f"  121 params, {meshinit._format.human_bytes(g1.nbytes)} in all" in summary
    assert summary.count("mesh 0: Mesh(data=2, fsdp=2, tensor=2; Explicit; devices 0-7)") == 1
    assert "mesh 1: Mesh(fsdp=8; Explicit; devices 0-7)" in summary
    # both meshes use all 8 devices: the totals add up, replicated bytes too
    most = meshinit._format.human_bytes(g1.device_bytes + g2.device_bytes)
    assert f"total: 125 params, {meshinit._format.human_bytes(plan.nbytes)}, 2 meshes, " in summary
    assert summary.splitlines()[-2].endswith(f"most on one device {most}")
    repl = meshinit._format.human_bytes(g1.replicated_bytes + g2.replicated_bytes)
    assert summary.splitlines()[-1] == (
        f"! replicated across an axis that could shard them: up to {repl} on one device"
    )
    assert set(summary.splitlines()) <= set(str(plan).splitlines())
    assert all(len(line) <= 100 for line in summary.splitlines())


def test_the_per_device_byte_counts_have_their_own_names_and_the_old_ones_warn():
    import warnings

    m = AbstractMesh((2, 4), ("data", "tensor"))
    p = meshinit.plan(
        meshinit.param((8, 8), jax.nn.initializers.zeros, axes=(None, "tensor"), mesh=m)
    )
    assert p.bytes_per_device()[(m, 0)] == 64 and p.replicated_bytes_per_device()[(m, 0)] == 64
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert p.device_bytes() == p.bytes_per_device()
        assert p.replicated_bytes() == p.replicated_bytes_per_device()
        assert p.entries[0].abstract == p.entries[0].struct == p.abstract()
    assert [issubclass(w.category, DeprecationWarning) for w in caught] == [True, True, True]


# --------------------------------------------------- replication marked as intended


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


def test_a_param_can_mark_its_own_replication_and_stacking_keeps_it():
    mesh = AbstractMesh((2, 4), ("data", "fsdp"))
    spec = meshinit.param(
        (16, 8), jax.nn.initializers.zeros, axes=("fsdp", None), mesh=mesh, replicated=["data"]
    )
    assert spec.replicated == ("data",)
    stacked = meshinit.stacked(4, spec, axis=None)
    assert stacked.replicated == ("data",)
    assert meshinit.plan({"s": stacked}).entries[0].shardable_axes == ()


def test_bad_replication_marks_are_named_all_at_once():
    mesh = AbstractMesh((2, 4), ("data", "fsdp"))
    init = jax.nn.initializers.zeros
    specs = {
        "typo": meshinit.param((16,), init, mesh=mesh, replicated="dta"),
        "sharded": meshinit.param((16,), init, axes=("fsdp",), mesh=mesh, replicated="fsdp"),
        "also": meshinit.param((16,), init, mesh=mesh, replicated=("data", "tensr")),
    }
    with pytest.raises(meshinit.PlanError) as err:
        meshinit.plan(specs)
    got = {p.path: p.message for p in err.value.problems}
    assert "'dta', which no mesh of the plan has (they have: data, fsdp)" in got["typo"]
    assert sorted(got) == ["also", "typo"]  # sharded over a marked axis: not replicated, fine
    assert "'tensr'" in got["also"]
    with meshinit.defaults(mesh=mesh, replicated="dta"):  # a model-wide typo: said once
        many = [meshinit.param((16,), init) for _ in range(5)]
    with pytest.raises(meshinit.PlanError) as err:
        meshinit.plan(many)
    (problem,) = err.value.problems
    assert problem.path == "0" and "(so do 4 more parameters)" in problem.message
    with pytest.raises(TypeError, match="replicated must be a mesh axis name"):
        meshinit.param((16,), init, mesh=mesh, replicated=3)


def test_a_stage_mesh_without_the_marked_axis_is_fine():
    init = jax.nn.initializers.zeros
    with meshinit.defaults(replicated="data"):
        specs = {
            "a": meshinit.param((16,), init, mesh=AbstractMesh((2, 2), ("data", "fsdp"))),
            "b": meshinit.param((16,), init, mesh=AbstractMesh((4,), ("tensor",))),
        }
    plan = meshinit.plan(specs)
    assert [e.shardable_axes for e in plan.entries] == [("fsdp",), ("tensor",)]


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
