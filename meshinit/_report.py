"""Human-readable plan tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jax.sharding import AbstractMesh

if TYPE_CHECKING:
    from ._plan import MeshGroup, Plan


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def describe_mesh(mesh) -> str:
    """``Mesh(fsdp=2, tensor=4; Explicit; devices 0-7)``."""
    axes = ", ".join(f"{n}={s}" for n, s in mesh.shape.items())
    types = {str(t).split(".")[-1] for t in getattr(mesh, "axis_types", ())}
    kind = "AbstractMesh" if isinstance(mesh, AbstractMesh) else "Mesh"
    parts = [axes, "/".join(sorted(types))] if types else [axes]
    if kind == "Mesh":
        ids = sorted(d.id for d in mesh.devices.flat)
        contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
        parts.append(
            f"devices {ids[0]}-{ids[-1]}"
            if contiguous and len(ids) > 1
            else "devices " + ",".join(map(str, ids))
        )
    return f"{kind}({'; '.join(parts)})"


def _fmt_axes(axes) -> str:
    if axes is None:
        return "replicated"
    return (
        "("
        + ", ".join(
            "None" if a is None else (a if isinstance(a, str) else "(" + ",".join(a) + ")")
            for a in axes
        )
        + ")"
    )


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
    shown: list[str] = []
    for i, path in enumerate(paths[:limit]):
        rest = len(paths) - i - 1
        line = head + ", ".join([*shown, path]) + (f", +{rest} more" if rest else "")
        if shown and len(line) > width:
            break
        shown.append(path)
    rest = len(paths) - len(shown)
    return head + ", ".join(shown) + (f", +{rest} more" if rest else "")


def group_summary(group: MeshGroup) -> list[str]:
    """A group's totals: params, bytes in all and per device, and replicated bytes."""
    n = len(group.entries)
    lines = [
        f"  {n} param{'s' if n != 1 else ''}, {human_bytes(group.nbytes)} in all, "
        f"{human_bytes(group.device_bytes)} per device"
    ]
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
            lines.append(_path_list(head, [e.path or "<root>" for e in entries]))
    return lines


def group_table(index: int, group: MeshGroup) -> list[str]:
    head = ["path", "shape", "dtype", "logical axes", "mesh axes", "PartitionSpec", "per device"]
    flagged = {id(e) for e in group.shardable_entries}
    if flagged:
        head.append("")
    rows = [head]
    for e in group.entries:
        s = e.spec
        row = [
            e.path or "<root>",
            str(s.shape),
            s.dtype.name,
            _fmt_axes(s.axes) if s.rules is not None else "-",
            _fmt_mesh_axes(e.sharding.spec, group.mesh.shape),
            str(e.sharding.spec).removeprefix("PartitionSpec"),
            human_bytes(e.device_bytes),
        ]
        if flagged:
            row.append("!" if id(e) in flagged else "")
        rows.append(row)
    return [
        f"mesh {index}: {describe_mesh(group.mesh)}",
        *_columns(rows, right={6}),
        *group_summary(group),
    ]


def _totals(plan: Plan) -> list[str]:
    n, k = len(plan.entries), len(plan.groups)
    lines = [
        f"total: {n} param{'s' if n != 1 else ''}, {human_bytes(plan.nbytes)}, "
        f"{k} mesh{'es' if k != 1 else ''}, most on one device "
        f"{human_bytes(plan.max_device_bytes)}"
    ]
    if k > 1:
        replicated = max(plan.replicated_bytes().values(), default=0)
        if replicated:
            lines.append(
                f"! replicated across an axis that could shard them: up to "
                f"{human_bytes(replicated)} on one device"
            )
    return lines


def table(plan: Plan) -> str:
    """The plan as a table: one block per mesh, every full path, totals per mesh.

    A ``!`` marks a parameter replicated across a mesh axis that could shard it; the
    block's footer names the axes, the bytes per device, and the first such paths.
    """
    lines: list[str] = []
    for i, g in enumerate(plan.groups):
        lines += group_table(i, g) + [""]
    return "\n".join(lines + _totals(plan))


def summary(plan: Plan) -> str:
    """:func:`table` without the per-parameter rows: each mesh's totals, then the plan's."""
    lines: list[str] = []
    for i, g in enumerate(plan.groups):
        lines += [f"mesh {i}: {describe_mesh(g.mesh)}", *group_summary(g), ""]
    return "\n".join(lines + _totals(plan))
