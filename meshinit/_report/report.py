"""Human-readable plan tables."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import printable
from .._format import axes_text, describe_mesh, human_bytes, some

if TYPE_CHECKING:
    from .._plan.plan import MeshGroup, Plan, PlanEntry
    from .._spec.spec import ParamSpec

MeshSource = Callable[["MeshGroup"], str]
"""Says where a group's mesh came from, e.g. ``"--abstract-mesh"`` or ``"spec"``."""


def _fmt_mesh_axes(spec, mesh_shape) -> str:
    """The mesh axes that shard a parameter, with their sizes: ``fsdp=2,tensor=4``."""
    used = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    return ",".join(f"{a}={mesh_shape[a]}" for a in used) or "replicated"


def _columns(rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def _path_list(head: str, paths: Sequence[str], limit: int = 3, width: int = 100) -> str:
    """``head``, then up to ``limit`` paths that fit in ``width`` columns, then a count."""
    n = 1
    while n < min(limit, len(paths)) and len(head + some(paths, n + 1)) <= width:
        n += 1
    return head + some(paths, n)


def group_summary(
    group: MeshGroup, paths: Callable[[Sequence[PlanEntry]], list[str]] | None = None
) -> list[str]:
    """A group's totals: params, bytes in all and per device, and replicated bytes.

    ``paths`` names the flagged entries (default: their full paths).
    """
    n = len(group.entries)
    lines = [
        f"  {n} param{'s' if n != 1 else ''}, {human_bytes(group.nbytes)} in all, "
        f"{human_bytes(group.device_bytes)} per device"
    ]
    if _has_memory_kinds(group):
        kinds = group.bytes_per_memory_kind.items()
        per_kind = ", ".join(f"{human_bytes(b)} in {k}" for k, b in kinds)
        lines.append(f"  per device by memory kind: {per_kind}")
    flagged = group.shardable_entries
    if not flagged:
        return lines
    k = len(flagged)
    lines.append(
        f"  ! {k} param{'s' if k != 1 else ''} replicated across an axis that could shard "
        f"{'them' if k != 1 else 'it'}: {human_bytes(group.replicated_bytes)} per device"
    )
    for axis, size in group.mesh.shape.items():
        entries = [e for e in flagged if axis in e.shardable_axes]
        if entries:
            per_device = human_bytes(sum(e.device_bytes for e in entries))
            head = f"    {axis}={size} could shard {len(entries)} ({per_device} per device): "
            named = paths(entries) if paths else [e.path or "<root>" for e in entries]
            lines.append(_path_list(head, [printable(p) for p in named]))
    return lines


def _has_memory_kinds(group: MeshGroup) -> bool:
    """Whether a spec of the group asked for a memory kind other than device memory:
    then the tables get a ``memory`` column and the totals a line per kind."""
    return any(e.memory_kind != "device" for e in group.entries)


def _mesh_line(index: int, group: MeshGroup, source: MeshSource | None) -> str:
    """The group's heading, with where its mesh came from if ``source`` says."""
    line = f"mesh {index}: {describe_mesh(group.mesh)}"
    return f"{line}  (mesh from {source(group)})" if source else line


def _logical(spec: ParamSpec, *, tight: bool) -> str:
    """The logical axes of a spec: its own (with rules), or the names a framework's
    metadata gave before its rules made them mesh axes (flax nnx), else ``-``."""
    if spec.rules is not None:
        return axes_text(spec.axes, tight=tight)
    named = spec.metadata.get("logical")
    return "-" if named is None else axes_text(named, tight=tight)


def _row(e: PlanEntry, mesh) -> list[str]:
    """One parameter's cells: path, shape, dtype, logical axes, mesh axes, spec, bytes."""
    s = e.spec
    return [
        printable(e.path) or "<root>",
        str(s.shape),
        s.dtype.name,
        _logical(s, tight=False),
        _fmt_mesh_axes(e.sharding.spec, mesh.shape),
        str(e.sharding.spec).removeprefix("PartitionSpec"),
        human_bytes(e.device_bytes),
    ]


def group_table(index: int, group: MeshGroup, source: MeshSource | None = None) -> list[str]:
    head = ["path", "shape", "dtype", "logical axes", "mesh axes", "PartitionSpec", "per device"]
    kinds = _has_memory_kinds(group)
    if kinds:
        head.insert(6, "memory")
    flagged = {id(e) for e in group.shardable_entries}
    if flagged:
        head.append("")
    rows = [head]
    for e in group.entries:
        row = _row(e, group.mesh)
        if kinds:
            row.insert(6, e.memory_kind)
        if flagged:
            row.append("!" if id(e) in flagged else "")
        rows.append(row)
    return [
        _mesh_line(index, group, source),
        *_columns(rows, right={7 if kinds else 6}),
        *group_summary(group),
    ]


def _totals(plan: Plan) -> list[str]:
    n, k = len(plan.entries), len(plan.groups)
    lines = [
        f"total: {n} param{'s' if n != 1 else ''}, {human_bytes(plan.nbytes)}, "
        f"{k} mesh{'es' if k != 1 else ''}, most on one device "
        f"{human_bytes(plan.max_device_bytes)}"
    ]
    if any(_has_memory_kinds(g) for g in plan.groups):
        in_device = max(plan.bytes_per_device(memory_kind="device").values(), default=0)
        lines[0] += f" (in device memory: {human_bytes(in_device)})"
    if k > 1:
        replicated = max(plan.replicated_bytes_per_device().values(), default=0)
        if replicated:
            lines.append(
                f"! replicated across an axis that could shard them: up to "
                f"{human_bytes(replicated)} on one device"
            )
    return lines


def table(plan: Plan, source: MeshSource | None = None) -> str:
    """The plan as a table: one block per mesh, every full path, totals per mesh.

    A ``!`` marks a parameter replicated across a mesh axis that could shard it; the
    block's footer names the axes, the bytes per device, and the first such paths.
    ``source``, if given, says in each mesh's heading where the mesh came from.
    """
    lines: list[str] = []
    for i, g in enumerate(plan.groups):
        lines += group_table(i, g, source) + [""]
    return "\n".join(lines + _totals(plan))


def summary(plan: Plan) -> str:
    """:func:`table` without the per-parameter rows: each mesh's totals, then the plan's."""
    lines: list[str] = []
    for i, g in enumerate(plan.groups):
        lines += [f"mesh {i}: {describe_mesh(g.mesh)}", *group_summary(g), ""]
    return "\n".join(lines + _totals(plan))


# Compact view: repeated layers collapsed into one row.


def _is_index(part: str) -> bool:
    # "07" stays a name: printing it back as 7 would show a path that does not exist.
    return part.isascii() and part.isdigit() and (part == "0" or not part.startswith("0"))


def _ranges(values: frozenset[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"{0..2,5}"``; a single value stands alone."""
    if len(values) == 1:
        return str(next(iter(values)))
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    parts = [f"{r[0]}..{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs]
    return "{" + ",".join(parts) + "}"


def _boxes(points: list[tuple[int, ...]]) -> list[tuple[frozenset[int], ...]]:
    """Distinct index tuples as products of index sets whose union is exactly them.

    One box when the tuples form a full product, as the layers of one stack do. Else
    split on the first index and merge the values whose rest splits the same way, so
    that ``stages.0.layers.{0..3}`` and ``stages.1.layers.{4..7}`` stay two rows
    rather than claiming ``stages.{0,1}.layers.{0..7}``.
    """
    if not points[0]:
        return [()]
    sets = [frozenset(p[i] for p in points) for i in range(len(points[0]))]
    if math.prod(map(len, sets)) == len(points):
        return [tuple(sets)]
    rests: dict[int, list[tuple[int, ...]]] = {}
    for p in points:
        rests.setdefault(p[0], []).append(p[1:])
    merged: dict[tuple[tuple[frozenset[int], ...], ...], list[int]] = {}
    for first, rest in rests.items():
        merged.setdefault(tuple(_boxes(rest)), []).append(first)
    return [(frozenset(firsts), *box) for boxes, firsts in merged.items() for box in boxes]


def collapse_paths(paths: Sequence[str], keys: Sequence[Any]) -> list[tuple[str, list[int]]]:
    """Paths that differ only in integer components and share a key, as one row each.

    Args:
      paths: dot-joined paths, distinct among those with the same key.
      keys: one hashable per path; only paths with equal keys collapse.

    Returns:
      ``("layers.{0..125}.mlp.up", positions)`` pairs, ``positions`` indexing
      ``paths``, in the order of each row's first position. Every row is exact: its
      paths are the product of its index sets.
    """
    keyed: dict[Any, list[tuple[tuple[int, ...], int]]] = {}
    for position, (path, key) in enumerate(zip(paths, keys, strict=True)):
        parts = path.split(".") if path else []
        template = tuple(None if _is_index(p) else p for p in parts)
        index = tuple(int(p) for p in parts if _is_index(p))
        keyed.setdefault((template, key), []).append((index, position))
    rows: list[tuple[str, list[int]]] = []
    for (template, _), members in keyed.items():
        for box in _boxes([index for index, _ in members]):
            chosen = [
                k for index, k in members if all(v in b for v, b in zip(index, box, strict=True))
            ]
            sets = iter(box)
            path = ".".join(_ranges(next(sets)) if p is None else p for p in template)
            rows.append((path or "<root>", chosen))
    rows.sort(key=lambda r: r[1][0])
    return rows


def collapse(entries: Sequence[PlanEntry]) -> list[tuple[str, list[PlanEntry]]]:
    """Entries whose paths differ only in integer components, as one row each.

    Entries collapse when they also share shape, dtype, logical axes and sharding.
    Returns ``("layers.{0..125}.mlp.up", entries)`` pairs in the
    order of each row's first entry.
    """
    keys = [
        (
            e.spec.shape,
            e.spec.dtype,
            e.spec.axes if e.spec.rules is not None else "-",
            e.sharding,
        )
        for e in entries
    ]
    rows = collapse_paths([e.path for e in entries], keys)
    return [(path, [entries[k] for k in positions]) for path, positions in rows]


def _short_dtype(dtype) -> str:
    """``bfloat16`` -> ``bf16``, ``float32`` -> ``f32``: jax's names in array types."""
    name = dtype.name
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i")):
        if name.startswith(long):
            return short + name[len(long) :]
    return name.replace("complex", "c")


COMPACT_HEADER = "a row stands for the n parameters its path pattern names; per device sums all n"


def group_compact(index: int, group: MeshGroup, source: MeshSource | None = None) -> list[str]:
    """:func:`group_table` with the rows of :func:`collapse`.

    ``n`` counts a row's parameters; ``per device`` is the bytes all ``n`` take on each
    device, so the column sums to the group's per-device total.
    """
    flagged = {id(e) for e in group.shardable_entries}
    kinds = _has_memory_kinds(group)
    head = ["path", "n", "array", "logical", "PartitionSpec", "per device"]
    if kinds:
        head.insert(5, "memory")
    if flagged:
        head.append("")
    rows = [head]
    for path, es in collapse(group.entries):
        e, s = es[0], es[0].spec
        logical = _logical(s, tight=True)
        row = [
            printable(path),
            str(len(es)),
            f"{_short_dtype(s.dtype)}[{','.join(map(str, s.shape))}]",
            logical,
            axes_text(e.sharding.spec, tight=True),
            human_bytes(e.device_bytes * len(es)),
        ]
        if kinds:
            row.insert(5, e.memory_kind)
        if flagged:
            row.append("!" if id(e) in flagged else "")
        rows.append(row)
    return [
        _mesh_line(index, group, source),
        *_columns(rows, right={1, 6 if kinds else 5}),
        *group_summary(group, lambda es: [p for p, _ in collapse(es)]),
    ]


def compact(plan: Plan, source: MeshSource | None = None) -> str:
    """:func:`table` with repeated layers collapsed (see :func:`collapse`), under a
    header line that says what a collapsed row's ``n`` and ``per device`` mean."""
    lines: list[str] = [COMPACT_HEADER, ""] if plan.groups else []
    for i, g in enumerate(plan.groups):
        lines += group_compact(i, g, source) + [""]
    return "\n".join(lines + _totals(plan))


def html(plan: Plan) -> str:
    """The plan as HTML for notebooks: one table per mesh group, then the totals.

    Every cell is escaped. A group with more than 64 rows starts folded.
    """
    import html as html_

    def cells(tag: str, row: Sequence[str], right: set[int]) -> str:
        return "".join(
            f'<{tag} style="text-align:right">{html_.escape(c)}</{tag}>'
            if i in right
            else f"<{tag}>{html_.escape(c)}</{tag}>"
            for i, c in enumerate(row)
        )

    head = ["path", "shape", "dtype", "logical axes", "mesh axes", "PartitionSpec", "per device"]
    out = ['<div class="meshinit-plan">']
    for i, g in enumerate(plan.groups):
        summary = group_summary(g)
        out.append(
            f"<details{' open' if len(g.entries) <= 64 else ''}><summary><b>mesh {i}</b>: "
            f"{html_.escape(describe_mesh(g.mesh))}: {html_.escape(summary[0].strip())}"
            "</summary>"
        )
        flagged = {id(e) for e in g.shardable_entries}
        out.append(f"<table><thead><tr>{cells('th', [*head, ''], {6})}</tr></thead><tbody>")
        for e in g.entries:
            row = [*_row(e, g.mesh), "!" if id(e) in flagged else ""]
            out.append(f"<tr>{cells('td', row, {6})}</tr>")
        out.append("</tbody></table>")
        out += [f"<p>{html_.escape(line.strip())}</p>" for line in summary[1:]]
        out.append("</details>")
    out += [f"<p><b>{html_.escape(line)}</b></p>" for line in _totals(plan)]
    out.append("</div>")
    return "\n".join(out)
