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


def group_table(index: int, group: MeshGroup) -> list[str]:
    head = ["path", "shape", "dtype", "logical axes", "mesh axes", "PartitionSpec", "per device"]
    rows = [head]
    for e in group.entries:
        s = e.spec
        rows.append(
            [
                e.path or "<root>",
                str(s.shape),
                s.dtype.name,
                _fmt_axes(s.axes) if s.rules is not None else "-",
                _fmt_mesh_axes(e.sharding.spec, group.mesh.shape),
                str(e.sharding.spec).removeprefix("PartitionSpec"),
                human_bytes(e.device_bytes),
            ]
        )
    n = len(group.entries)
    lines = [
        f"mesh {index}: {describe_mesh(group.mesh)}",
        *_columns(rows, right={6}),
        f"  {n} param{'s' if n != 1 else ''}, {human_bytes(group.nbytes)} in all, "
        f"{human_bytes(group.device_bytes)} per device",
    ]
    return lines


def _max_device_bytes(plan: Plan) -> int:
    """The most bytes any one device holds; meshes that share devices add up."""
    per_device: dict[object, int] = {}
    for i, g in enumerate(plan.groups):
        devices = g.mesh.devices.flat if not g.is_abstract else ((i, None),)
        for d in devices:
            per_device[d] = per_device.get(d, 0) + g.device_bytes
    return max(per_device.values(), default=0)


def table(plan: Plan) -> str:
    """The plan as a table: one block per mesh, every full path, totals per mesh."""
    lines: list[str] = []
    for i, g in enumerate(plan.groups):
        lines += group_table(i, g) + [""]
    per_device = _max_device_bytes(plan)
    lines.append(
        f"total: {len(plan.entries)} params, {human_bytes(plan.nbytes)}, "
        f"{len(plan.groups)} mesh{'es' if len(plan.groups) != 1 else ''}, "
        f"most on one device {human_bytes(per_device)}"
    )
    return "\n".join(lines)
