"""The plan's record: the ``meshinit.plan/1`` dict of ``Plan.to_dict``, and what the
reports read beside it."""

import json

import jax
from jax.sharding import AbstractMesh

import meshinit
from meshinit._plan.record import record

ones = jax.nn.initializers.ones


def test_to_dict_describes_every_param_and_the_totals():
    devices = jax.devices()
    main_mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=devices)
    stage = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[4:])
    tree = {
        "a": meshinit.param((16, 32), ones, axes=("fsdp", "tensor"), mesh=main_mesh),
        "b": meshinit.param((8, 24), ones, axes=(None, "tensor"), mesh=main_mesh),
        "c": meshinit.param((8, 8), ones, mesh=stage, dtype="bfloat16"),
        "d": meshinit.param(
            (4, 8), ones, axes=("embed", None), mesh=stage, rules=(("embed", "fsdp"),)
        ),
    }
    plan = meshinit.plan(tree)
    d = plan.to_dict()
    assert d["schema"] == "meshinit.plan/1"
    m0, m1 = d["meshes"]
    assert m0["axis_names"] == ["fsdp", "tensor"] and m0["axis_sizes"] == [2, 4]
    assert m0["axis_types"] == ["Explicit", "Explicit"] and m0["abstract"] is False
    assert m0["device_ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m1["device_ids"] == [[4, 5], [6, 7]]
    assert [m["device_bytes"] for m in d["meshes"]] == [g.device_bytes for g in plan.groups]
    assert [m["replicated_bytes"] for m in d["meshes"]] == [g.replicated_bytes for g in plan.groups]
    a, b, c, dd = d["params"]
    assert [p["path"] for p in d["params"]] == ["a", "b", "c", "d"]
    assert a["partition_spec"] == ["fsdp", "tensor"] and a["shard_shape"] == [8, 8]
    assert a["device_bytes"] == 8 * 8 * 4 and a["nbytes"] == 16 * 32 * 4
    assert a["logical_axes"] is None  # its axes name mesh axes
    assert b["replicated_axes"] == ["fsdp"] and b["shardable_axes"] == {"fsdp": [0, 1]}
    assert c["dtype"] == "bfloat16" and c["mesh"] == 1 and c["partition_spec"] == [None, None]
    assert c["shardable_axes"] == {"fsdp": [0, 1], "tensor": [0, 1]}
    assert dd["logical_axes"] == ["embed", None] and dd["partition_spec"] == ["fsdp", None]
    totals = d["totals"]
    assert totals["params"] == 4 and totals["elements"] == 16 * 32 + 8 * 24 + 64 + 32
    assert totals["nbytes"] == plan.nbytes and totals["meshes"] == 2
    assert totals["device_bytes_per_mesh"] == [g.device_bytes for g in plan.groups]
    assert totals["max_device_bytes"] == plan.max_device_bytes
    # devices 4-7 hold both meshes' shards: the most is their sum
    assert totals["max_device_bytes"] == sum(g.device_bytes for g in plan.groups)
    assert totals["max_replicated_bytes"] == max(plan.replicated_bytes_per_device().values())
    assert json.loads(plan.to_json()) == d
    assert json.loads(plan.to_json(indent=None)) == d and "\n" not in plan.to_json(indent=None)


def test_the_record_adds_what_the_views_show_and_to_dict_leaves_it_out():
    m = AbstractMesh((2, 4), ("fsdp", "tensor"))
    init = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {
            "w": meshinit.param(
                (8, 8), init, axes=("embed", None), mesh=m, rules=(("embed", "fsdp"),)
            ),
            "b": meshinit.param((8,), init, mesh=m, memory_kind="pinned_host"),
        }
    )
    public = plan.to_dict()
    full = record(plan, source=lambda group: "spec")
    b, w = full["params"]
    assert w["has_rules"] and w["logical_names"] == ("embed", None)
    assert not b["has_rules"] and b["logical_names"] is None
    assert w["sharding"] == plan.entries[1].sharding
    (mesh,) = full["meshes"]
    assert mesh["mesh_from"] == "spec"
    assert mesh["bytes_per_device"] == [plan.bytes_per_device()[(m, i)] for i in range(8)]
    assert (
        full["totals"]["max_device_memory_bytes"] == 128
    )  # w: a 4x8 float32 block; b: on the host
    # beside those, the record is the published dict, field for field
    assert w["rule_notes"] == b["rule_notes"] == {}  # a plain table notes nothing
    for extra in ("sharding", "has_rules", "logical_names", "rule_notes"):
        for p in full["params"]:
            del p[extra]
    del mesh["mesh_from"], mesh["bytes_per_device"], full["totals"]["max_device_memory_bytes"]
    assert full == public
    assert "bytes_per_device" not in json.dumps(public)
