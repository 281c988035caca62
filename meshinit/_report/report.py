"""Human-readable plan tables, drawn from the plan's record.

Every function here renders the record of ``meshinit._plan.record.record``: the
``meshinit.plan/1`` dict with what the views show beyond it. A mesh is its record, a
parameter its record (``record["params"][i]``); no ``Plan`` is ever read here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._errors import printable
from .._format import axes_text, collapse_paths, human_bytes, some

Record = dict[str, Any]
"""A plan's, a mesh's or a parameter's record."""


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


def per_mesh(record: Record) -> list[list[Record]]:
    """The records of each mesh's parameters, in the plan's order, one list per mesh."""
    params: list[list[Record]] = [[] for _ in record["meshes"]]
    for p in record["params"]:
        params[p["mesh"]].append(p)
    return params


def _flagged(params: Sequence[Record]) -> list[Record]:
    """The parameters replicated across a mesh axis that could shard them."""
    return [p for p in params if p["shardable_axes"]]


def group_summary(
    mesh: Record,
    params: Sequence[Record],
    paths: Callable[[Sequence[Record]], list[str]] | None = None,
) -> list[str]:
    """A mesh's totals: params, bytes in all and per device, and replicated bytes.

    ``params`` are the mesh's parameters; ``paths`` names the flagged ones (default:
    their full paths).
    """
    n = mesh["params"]
    lines = [
        f"  {n} param{'s' if n != 1 else ''}, {human_bytes(mesh['nbytes'])} in all, "
        f"{human_bytes(mesh['device_bytes'])} per device"
    ]
    if _has_memory_kinds(params):
        kinds = mesh["device_bytes_per_memory_kind"].items()
        per_kind = ", ".join(f"{human_bytes(b)} in {k}" for k, b in kinds)
        lines.append(f"  per device by memory kind: {per_kind}")
    lines += _noted(params)
    flagged = _flagged(params)
    if not flagged:
        return lines
    k = len(flagged)
    lines.append(
        f"  ! {k} param{'s' if k != 1 else ''} replicated across an axis that could shard "
        f"{'them' if k != 1 else 'it'}: {human_bytes(mesh['replicated_bytes'])} per device"
    )
    for axis, size in zip(mesh["axis_names"], mesh["axis_sizes"], strict=True):
        chosen = [p for p in flagged if axis in p["shardable_axes"]]
        if chosen:
            per_device = human_bytes(sum(p["device_bytes"] for p in chosen))
            head = f"    {axis}={size} could shard {len(chosen)} ({per_device} per device): "
            named = paths(chosen) if paths else [p["path"] or "<root>" for p in chosen]
            lines.append(_path_list(head, [printable(p) for p in named]))
    return lines


def _noted(params: Sequence[Record]) -> list[str]:
    """A line per logical name whose rule carries a note (``rule_notes``), with how many
    of the mesh's parameters use it."""
    counts: dict[tuple[str, str], int] = {}
    for p in params:
        for name, note in p.get("rule_notes", {}).items():
            counts[name, note] = counts.get((name, note), 0) + 1
    return [
        f"  logical axis {name!r} {note} ({n} param{'s' if n != 1 else ''})"
        for (name, note), n in sorted(counts.items())
    ]


def _has_memory_kinds(params: Sequence[Record]) -> bool:
    """Whether a spec of the mesh asked for a memory kind other than device memory:
    then the tables get a ``memory`` column and the totals a line per kind."""
    return any(p["memory_kind"] != "device" for p in params)


def _mesh_line(mesh: Record) -> str:
    """The mesh's heading, with where it came from if the record says."""
    line = f"mesh {mesh['index']}: {mesh['description']}"
    return f"{line}  (mesh from {mesh['mesh_from']})" if "mesh_from" in mesh else line


def _logical(p: Record, *, tight: bool) -> str:
    """The logical axes of a parameter: its spec's own (with rules), or the names a
    framework's metadata gave before its rules made them mesh axes (flax nnx), else
    ``-``."""
    named = p["logical_names"]
    if p["has_rules"]:
        return axes_text(named, tight=tight)
    return "-" if named is None else axes_text(named, tight=tight)


def _row(p: Record, mesh: Record) -> list[str]:
    """One parameter's cells: path, shape, dtype, logical axes, mesh axes, spec, bytes."""
    spec = p["sharding"].spec
    return [
        printable(p["path"]) or "<root>",
        str(tuple(p["shape"])),
        p["dtype"],
        _logical(p, tight=False),
        _fmt_mesh_axes(spec, dict(zip(mesh["axis_names"], mesh["axis_sizes"], strict=True))),
        str(spec).removeprefix("PartitionSpec"),
        human_bytes(p["device_bytes"]),
    ]


def _marked(
    head: list[str], rows: list[tuple[list[str], Record]], params: Sequence[Record], memory_at: int
) -> tuple[list[list[str]], bool]:
    """``head``, then each row (beside the param it shows): the memory column inserted at
    ``memory_at`` where any of ``params`` has a memory kind, and a last column marking
    ("!") a param whose replicated axes could shard it, where any could. Also whether
    the memory column is there."""
    kinds, flagged = _has_memory_kinds(params), bool(_flagged(params))
    out = []
    for row, p in [(head, None), *rows]:
        if kinds:
            row.insert(memory_at, "memory" if p is None else p["memory_kind"])
        if flagged:
            row.append("!" if p is not None and p["shardable_axes"] else "")
        out.append(row)
    return out, kinds


def group_table(mesh: Record, params: Sequence[Record]) -> list[str]:
    """One mesh's block of :func:`table`: heading, a row per parameter, totals."""
    head = ["path", "shape", "dtype", "logical axes", "mesh axes", "PartitionSpec", "per device"]
    rows, kinds = _marked(head, [(_row(p, mesh), p) for p in params], params, memory_at=6)
    return [
        _mesh_line(mesh),
        *_columns(rows, right={7 if kinds else 6}),
        *group_summary(mesh, params),
    ]


def _totals(record: Record) -> list[str]:
    totals = record["totals"]
    n, k = totals["params"], totals["meshes"]
    lines = [
        f"total: {n} param{'s' if n != 1 else ''}, {human_bytes(totals['nbytes'])}, "
        f"{k} mesh{'es' if k != 1 else ''}, most on one device "
        f"{human_bytes(totals['max_device_bytes'])}"
    ]
    if _has_memory_kinds(record["params"]):
        in_device = totals["max_device_memory_bytes"]
        lines[0] += f" (in device memory: {human_bytes(in_device)})"
    if k > 1:
        replicated = totals["max_replicated_bytes"]
        if replicated:
            lines.append(
                f"! replicated across an axis that could shard them: up to "
                f"{human_bytes(replicated)} on one device"
            )
    return lines


def table(record: Record) -> str:
    """The plan as a table: one block per mesh, every full path, totals per mesh.

    A ``!`` marks a parameter replicated across a mesh axis that could shard it; the
    block's footer names the axes, the bytes per device, and the first such paths.
    A mesh whose record has ``mesh_from`` says in its heading where it came from.
    """
    lines: list[str] = []
    for mesh, params in zip(record["meshes"], per_mesh(record), strict=True):
        lines += group_table(mesh, params) + [""]
    return "\n".join(lines + _totals(record))


def summary(record: Record) -> str:
    """:func:`table` without the per-parameter rows: each mesh's totals, then the plan's."""
    lines: list[str] = []
    for mesh, params in zip(record["meshes"], per_mesh(record), strict=True):
        heading = f"mesh {mesh['index']}: {mesh['description']}"
        lines += [heading, *group_summary(mesh, params), ""]
    return "\n".join(lines + _totals(record))


# Compact view: repeated layers collapsed into one row.


def collapse(params: Sequence[Record]) -> list[tuple[str, list[Record]]]:
    """Parameters whose paths differ only in integer components, as one row each.

    Parameters collapse when they also share shape, dtype, logical axes and sharding.
    Returns ``("layers.{0..125}.mlp.up", params)`` pairs in the
    order of each row's first parameter.
    """
    keys = [
        (
            tuple(p["shape"]),
            p["dtype"],
            p["logical_names"] if p["has_rules"] else "-",
            p["sharding"],
        )
        for p in params
    ]
    rows = collapse_paths([p["path"] for p in params], keys)
    return [(path, [params[k] for k in positions]) for path, positions in rows]


def _short_dtype(name: str) -> str:
    """``bfloat16`` -> ``bf16``, ``float32`` -> ``f32``: jax's names in array types."""
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i")):
        if name.startswith(long):
            return short + name[len(long) :]
    return name.replace("complex", "c")


COMPACT_HEADER = "a row stands for the n parameters its path pattern names; per device sums all n"


def group_compact(mesh: Record, params: Sequence[Record]) -> list[str]:
    """:func:`group_table` with the rows of :func:`collapse`.

    ``n`` counts a row's parameters; ``per device`` is the bytes all ``n`` take on each
    device, so the column sums to the mesh's per-device total.
    """
    head = ["path", "n", "array", "logical", "PartitionSpec", "per device"]
    one = [
        (
            [
                printable(path),
                str(len(ps)),
                f"{_short_dtype(ps[0]['dtype'])}[{','.join(map(str, ps[0]['shape']))}]",
                _logical(ps[0], tight=True),
                axes_text(ps[0]["sharding"].spec, tight=True),
                human_bytes(ps[0]["device_bytes"] * len(ps)),
            ],
            ps[0],
        )
        for path, ps in collapse(params)
    ]
    rows, kinds = _marked(head, one, params, memory_at=5)
    return [
        _mesh_line(mesh),
        *_columns(rows, right={1, 6 if kinds else 5}),
        *group_summary(mesh, params, lambda ps: [path for path, _ in collapse(ps)]),
    ]


def compact(record: Record) -> str:
    """:func:`table` with repeated layers collapsed (see :func:`collapse`), under a
    header line that says what a collapsed row's ``n`` and ``per device`` mean."""
    lines: list[str] = [COMPACT_HEADER, ""] if record["meshes"] else []
    for mesh, params in zip(record["meshes"], per_mesh(record), strict=True):
        lines += group_compact(mesh, params) + [""]
    return "\n".join(lines + _totals(record))


def html(record: Record) -> str:
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
    for mesh, params in zip(record["meshes"], per_mesh(record), strict=True):
        summary = group_summary(mesh, params)
        out.append(
            f"<details{' open' if len(params) <= 64 else ''}><summary>"
            f"<b>mesh {mesh['index']}</b>: {html_.escape(mesh['description'])}: "
            f"{html_.escape(summary[0].strip())}</summary>"
        )
        out.append(f"<table><thead><tr>{cells('th', [*head, ''], {6})}</tr></thead><tbody>")
        for p in params:
            row = [*_row(p, mesh), "!" if p["shardable_axes"] else ""]
            out.append(f"<tr>{cells('td', row, {6})}</tr>")
        out.append("</tbody></table>")
        out += [f"<p>{html_.escape(line.strip())}</p>" for line in summary[1:]]
        out.append("</details>")
    out += [f"<p><b>{html_.escape(line)}</b></p>" for line in _totals(record)]
    out.append("</div>")
    return "\n".join(out)
