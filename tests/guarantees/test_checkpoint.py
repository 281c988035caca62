"""Checkpoints: a materialized tree saved with orbax restores into ``plan.abstract()``.

The restore target carries the planned shardings, so orbax reads each array straight
onto its planned mesh, whatever layout the checkpoint was written from.
"""

import threading
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, Mesh

import meshinit

STACKED_RULES = (("layers", None), ("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"))
NAMES = ("fsdp", "tensor")


def mesh(ids, shape, explicit):
    devices = [jax.devices()[i] for i in ids]
    if explicit:
        return jax.make_mesh(shape, NAMES, axis_types=(AxisType.Explicit,) * 2, devices=devices)
    return Mesh(np.array(devices).reshape(shape), NAMES)


def layout(name, explicit):
    """(head mesh, body mesh) over the same 8 devices."""
    if name == "2x4":
        m = mesh(range(8), (2, 4), explicit)
        return m, m
    if name == "4x2":
        m = mesh(range(8), (4, 2), explicit)
        return m, m
    assert name == "two meshes"  # disjoint submeshes, as for pipeline stages
    return mesh(range(4), (2, 2), explicit), mesh(range(4, 8), (2, 2), explicit)


def specs(head, body):
    lecun = jax.nn.initializers.lecun_normal()
    normal = jax.nn.initializers.normal(1.0)

    def p(shape, init, axes, m, **kw):
        return meshinit.param(shape, init, axes=axes, mesh=m, rules=STACKED_RULES, **kw)

    return {
        "embed": p((64, 32), lecun, ("vocab", "embed"), head),
        "norm": p((32,), normal, None, head),  # replicated
        "blocks": {
            "up": meshinit.stacked(3, p((32, 64), lecun, ("embed", "mlp"), body)),
            "bias": p((64,), normal, ("mlp",), body, dtype="bfloat16"),
        },
    }


def by_path(plan, tree):
    leaves = jax.tree_util.tree_leaves(tree)
    assert len(leaves) == len(plan.entries)
    return {e.path: leaves[e.leaf_index] for e in plan.entries}


@pytest.mark.parametrize(
    "src_explicit, dst_explicit",
    [(False, False), (True, True), (False, True), (True, False)],
    ids=["auto", "explicit", "auto-to-explicit", "explicit-to-auto"],
)
@pytest.mark.parametrize("src, dst", [("2x4", "4x2"), ("2x4", "two meshes"), ("two meshes", "4x2")])
def test_restore_into_another_layout_lands_on_the_planned_shardings(
    tmp_path, src, dst, src_explicit, dst_explicit
):
    source = meshinit.plan(specs(*layout(src, src_explicit)))
    target = meshinit.plan(specs(*layout(dst, dst_explicit)))
    # Otherwise the test would not show that the restore re-lays the arrays out.
    assert all(
        s.sharding != t.sharding
        for s, t in zip(source.entries, target.entries, strict=True)
        if s.spec.axes is not None
    )
    saved = meshinit.materialize(source, jax.random.key(0))

    threads_before = set(threading.enumerate())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "ckpt", saved)
            checkpointer.wait_until_finished()
            restored = checkpointer.restore(tmp_path / "ckpt", target.abstract())
    assert [str(w.message) for w in caught] == []
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(saved)

    saved_by_path = by_path(source, saved)
    for path, array in by_path(target, restored).items():
        entry = next(e for e in target.entries if e.path == path)
        assert isinstance(array, jax.Array), (path, type(array))
        assert array.sharding == entry.sharding, (path, array.sharding, entry.sharding)
        assert array.sharding.mesh.shape == entry.sharding.mesh.shape, path
        assert array.sharding.mesh.axis_types == entry.sharding.mesh.axis_types, path
        assert array.sharding.spec == entry.sharding.spec, path
        assert array.shape == entry.spec.shape and array.dtype == entry.spec.dtype, path
        assert np.array_equal(np.asarray(array), np.asarray(saved_by_path[path])), path

    # orbax closes its event loops without joining their executors ("asyncio_N"
    # threads); those exit on their own a moment later. Nothing may stay behind.
    for t in set(threading.enumerate()) - threads_before:
        t.join(timeout=10)
    lingering = [t.name for t in set(threading.enumerate()) - threads_before]
    assert lingering == []


def test_abstract_target_matches_what_the_checkpoint_stored(tmp_path):
    plan = meshinit.plan(specs(*layout("2x4", explicit=False)))
    saved = meshinit.materialize(plan, jax.random.key(1))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", saved)
        checkpointer.wait_until_finished()
        metadata = checkpointer.metadata(tmp_path / "ckpt")
    abstract = by_path(plan, plan.abstract())
    assert all(type(a) is jax.ShapeDtypeStruct for a in abstract.values())
    stored = by_path(plan, metadata.item_metadata.tree)
    for path, a in abstract.items():
        assert (stored[path].shape, stored[path].dtype) == (a.shape, a.dtype), path


def test_restore_a_backbone_then_generate_only_the_new_head(tmp_path):
    head_mesh, body_mesh = layout("4x2", explicit=False)
    full_specs = specs(head_mesh, body_mesh)
    full_specs["head"] = meshinit.param(
        (32, 64),
        jax.nn.initializers.lecun_normal(),
        axes=("embed", "vocab"),
        mesh=head_mesh,
        rules=STACKED_RULES,
    )
    backbone = {k: v for k, v in full_specs.items() if k != "head"}
    old = meshinit.plan(specs(*layout("2x4", explicit=True)))  # saved from another layout
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", meshinit.materialize(old, 3))
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ckpt", meshinit.plan(backbone).abstract())
    existing = dict(zip((e.path for e in old.entries), jax.tree.leaves(restored), strict=True))

    plan = meshinit.plan(full_specs)
    out = meshinit.materialize(plan, 3, existing=existing)
    got = by_path(plan, out)
    for e in plan.entries:
        assert got[e.path].sharding == e.sharding, e.path
    for path, array in existing.items():
        assert got[path] is array  # restored onto the planned sharding: used as is
    np.testing.assert_array_equal(  # the new head: what a full init gives it
        np.asarray(got["head"]), np.asarray(by_path(plan, meshinit.materialize(plan, 3))["head"])
    )
