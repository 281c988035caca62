"""The plan's record: the ``meshinit.plan/1`` dict of ``Plan.to_dict`` (its schema is
there), and the record every report renders, built here from the plan.

:mod:`meshinit._report` draws tables, HTML, JSON text and heatmaps from the record
alone: it never sees a :class:`~meshinit._plan.plan.Plan`. What the views show beyond
the schema (:func:`record`) is added beside the schema's fields, never in
:func:`to_dict`, whose output is the published format.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .._format import describe_mesh
from .._spec.rules import rule_notes, shard_options
from .entries import MeshGroup, PlanEntry, shardable


class Planned(Protocol):
    """What a record reads of a plan: its entries, its groups and its byte counts
    (:class:`meshinit._plan.plan.Plan` has them; this module never imports it, so the
    plan and its record are no circle of files)."""

    @property
    def entries(self) -> tuple[PlanEntry, ...]: ...

    @property
    def groups(self) -> tuple[MeshGroup, ...]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def max_device_bytes(self) -> int: ...

    def bytes_per_device(self, memory_kind: str | None = None) -> dict[Any, int]: ...

    def replicated_bytes_per_device(self) -> dict[Any, int]: ...


SCHEMA = "meshinit.plan/1"

MeshSource = Callable[[MeshGroup], str]
"""Says where a group's mesh came from, e.g. ``"--abstract-mesh"`` or ``"spec"``."""

Options = tuple[tuple[str, tuple[int, ...]], ...]
"""``(replicated axis, dimensions it could shard)`` pairs: ``_spec.rules.shard_options``."""


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


def param_record(
    entry: PlanEntry, mesh_index: int, options: Options, shard_shape: tuple[int, ...]
) -> dict[str, Any]:
    """One parameter's record; ``options`` is its ``_spec.rules.shard_options``, and
    ``shard_shape`` its :attr:`PlanEntry.shard_shape`."""
    s = entry.spec
    logical = None
    if s.rules is not None:
        logical = _axes(s.axes) if s.axes is not None else [None] * len(s.shape)
    replicated = [a for a, _ in options]
    dims = dict(options)
    record = {
        "path": entry.path,
        "shape": list(s.shape),
        "dtype": s.dtype.name,
        "logical_axes": logical,
        "mesh": mesh_index,
        "partition_spec": _axes(entry.sharding.spec),
        "shard_shape": list(shard_shape),
        "nbytes": s.nbytes,
        "device_bytes": math.prod(shard_shape) * s.dtype.itemsize,  # PlanEntry.device_bytes
        "replicated_axes": replicated,
        "shardable_axes": {a: list(dims[a]) for a in shardable(options, s.replicated)},
        "replicated_on_purpose": [a for a in replicated if a in s.replicated],
        "memory_kind": entry.memory_kind,
    }
    return record


def _params(plan: Planned) -> list[dict[str, Any]]:
    """Every parameter's record, in plan order."""
    group_of = {id(e): i for i, g in enumerate(plan.groups) for e in g.entries}
    # A deep model repeats a handful of (shape, sharding): each worked out once.
    seen: dict[tuple[Any, ...], tuple[Options, tuple[int, ...]]] = {}
    out = []
    for e in plan.entries:
        key = (e.spec.shape, e.sharding)
        found = seen.get(key)
        if found is None:
            shape, spec, mesh = e.spec.shape, e.sharding.spec, e.mesh
            found = seen[key] = (shard_options(shape, spec, mesh), e.shard_shape)
        out.append(param_record(e, group_of[id(e)], *found))
    return out


def to_dict(plan: Planned, source: MeshSource | None = None) -> dict[str, Any]:
    """See ``Plan.to_dict``; ``source``, if given, adds ``mesh_from`` to each mesh."""
    return {
        "schema": SCHEMA,
        "meshes": [mesh_record(i, g, source) for i, g in enumerate(plan.groups)],
        "params": _params(plan),
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


def _device_keys(group: MeshGroup) -> Iterable[Any]:
    """The keys of ``Plan.bytes_per_device`` for a group's devices, row-major."""
    if group.is_abstract:
        return [(group.mesh, i) for i in range(group.mesh.size)]
    return group.mesh.devices.flat


def record(plan: Planned, source: MeshSource | None = None) -> dict[str, Any]:
    """:func:`to_dict`, with what the tables and the heatmap show beyond the schema.

    Each param also has ``sharding`` (its ``NamedSharding``: the PartitionSpec as jax
    prints it, and what repeated layers must share to collapse into one row),
    ``has_rules`` and ``logical_names`` (the spec's own axes where it has rules, else
    the names a framework's metadata gave before its rules made them mesh axes, else
    None), and ``rule_notes`` (why its rules place some of its logical names as they
    do: :func:`rule_notes`). Each mesh also has ``bytes_per_device``: the bytes each of
    its devices holds from every mesh (``Plan.bytes_per_device``), row-major. The totals also have
    ``max_device_memory_bytes``: the most bytes in device memory on one device.
    """
    data = to_dict(plan, source)
    for p, e in zip(data["params"], plan.entries, strict=True):
        s = e.spec
        p["sharding"] = e.sharding
        p["has_rules"] = s.rules is not None
        p["logical_names"] = s.logical_names
        # a framework's names resolved before planning keep their notes in the metadata
        noted = rule_notes(s.axes, s.rules) if s.rules is not None else None
        p["rule_notes"] = dict(s.metadata.get("rule_notes", {})) if noted is None else noted
    per_device = plan.bytes_per_device()
    for m, g in zip(data["meshes"], plan.groups, strict=True):
        m["bytes_per_device"] = [per_device[k] for k in _device_keys(g)]
    in_device = plan.bytes_per_device(memory_kind="device").values()
    data["totals"]["max_device_memory_bytes"] = max(in_device, default=0)
    return data
