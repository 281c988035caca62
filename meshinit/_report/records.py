"""The plan as plain data (``Plan.to_dict``, ``Plan.to_json``); the schema is there."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from .._format import describe_mesh
from .report import MeshSource

if TYPE_CHECKING:
    from .._plan.plan import MeshGroup, Plan, PlanEntry

SCHEMA = "meshinit.plan/1"


def _axes(entries) -> list[Any]:
    """PartitionSpec or axes entries as JSON: a name, a list of names, or null."""
    return [None if a is None else a if isinstance(a, str) else list(a) for a in entries]


def mesh_record(index: int, group: MeshGroup, source: MeshSource | None) -> dict[str, Any]:
    mesh = group.mesh
    record = {
        "index": index,
        "description": describe_mesh(mesh),
        "axis_names": list(mesh.axis_names),
        "axis_sizes": [int(n) for n in mesh.axis_sizes],
        "axis_types": [str(t).split(".")[-1] for t in mesh.axis_types],
        "abstract": group.is_abstract,
        "device_ids": None if group.is_abstract else mesh.device_ids.tolist(),
        "params": len(group.entries),
        "nbytes": group.nbytes,
        "device_bytes": group.device_bytes,
        "device_bytes_per_memory_kind": dict(group.bytes_per_memory_kind),
        "replicated_bytes": group.replicated_bytes,
    }
    if source is not None:
        record["mesh_from"] = source(group)
    return record


def param_record(entry: PlanEntry, mesh_index: int) -> dict[str, Any]:
    s = entry.spec
    logical = None
    if s.rules is not None:
        logical = _axes(s.axes) if s.axes is not None else [None] * len(s.shape)
    record = {
        "path": entry.path,
        "shape": list(s.shape),
        "dtype": s.dtype.name,
        "logical_axes": logical,
        "mesh": mesh_index,
        "partition_spec": _axes(entry.sharding.spec),
        "shard_shape": list(entry.shard_shape),
        "nbytes": s.nbytes,
        "device_bytes": entry.device_bytes,
        "replicated_axes": list(entry.replicated_axes),
        "shardable_axes": {a: list(entry.shard_dims(a)) for a in entry.shardable_axes},
        "replicated_on_purpose": [a for a in entry.replicated_axes if a in s.replicated],
        "memory_kind": entry.memory_kind,
    }
    return record


def to_dict(plan: Plan, source: MeshSource | None = None) -> dict[str, Any]:
    """See ``Plan.to_dict``; ``source``, if given, adds ``mesh_from`` to each mesh."""
    group_of = {id(e): i for i, g in enumerate(plan.groups) for e in g.entries}
    return {
        "schema": SCHEMA,
        "meshes": [mesh_record(i, g, source) for i, g in enumerate(plan.groups)],
        "params": [param_record(e, group_of[id(e)]) for e in plan.entries],
        "totals": {
            "params": len(plan.entries),
            "elements": sum(math.prod(e.spec.shape) for e in plan.entries),
            "nbytes": plan.nbytes,
            "meshes": len(plan.groups),
            "device_bytes_per_mesh": [g.device_bytes for g in plan.groups],
            "max_device_bytes": plan.max_device_bytes,
            "max_replicated_bytes": max(plan.replicated_bytes_per_device().values(), default=0),
        },
    }


def to_json(plan: Plan, indent: int | None = 2, source: MeshSource | None = None) -> str:
    """See ``Plan.to_json``: one record a line, so the text greps and diffs well."""
    data = to_dict(plan, source)
    if indent is None:
        return json.dumps(data)
    pad = " " * indent

    def value(v: Any) -> str:
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return "[\n" + ",\n".join(pad * 2 + json.dumps(r) for r in v) + f"\n{pad}]"
        return json.dumps(v)

    fields = [f"{pad}{json.dumps(k)}: {value(v)}" for k, v in data.items()]
    return "{\n" + ",\n".join(fields) + "\n}"
