"""Meshes and byte counts as text: the one formatter every module shares.

At the bottom of the package: it imports nothing of meshinit, so runtime modules
(compiling, checking, progress) and the reports over a Plan all format alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import AbstractMesh


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


def axes_text(entries, *, tight: bool = False) -> str:
    """Axes or a PartitionSpec as text, the one spelling of every table and message.

    ``(embed, None, (fsdp,data))``; with ``tight``, no spaces or outer parentheses:
    ``embed,None,(fsdp,data)``. ``None`` (and, tight, all-None entries) reads
    ``replicated``.
    """
    if entries is None or (tight and all(a is None for a in entries)):
        return "replicated"
    one = [
        "None" if a is None else a if isinstance(a, str) else "(" + ",".join(a) + ")"
        for a in entries
    ]
    return ",".join(one) if tight else "(" + ", ".join(one) + ")"


def some(items: Sequence[str], n: int = 3) -> str:
    """The first ``n`` of ``items`` and a count of the rest: ``"a, b, c and 4 more"``."""
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")
