"""Meshes and byte counts as text: the one formatter every module shares.

At the bottom of the package: it imports nothing of meshinit, so runtime modules
(compiling, checking, progress) and the reports over a Plan all format alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

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


# Repeated layers collapsed into one row: the compact table's and every message's.


def _is_index(part: str) -> bool:
    # "07" stays a name: printing it back as 7 would show a path that does not exist.
    return part.isascii() and part.isdigit() and (part == "0" or not part.startswith("0"))


def index_ranges(values: frozenset[int] | set[int]) -> str:
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


Box = tuple[frozenset[int], ...]


def _boxes(points: list[tuple[tuple[int, ...], int]]) -> list[tuple[Box, list[int]]]:
    """Index tuples as products of index sets whose union is exactly them, each with the
    positions of the points it holds (a point may repeat: a problem said twice).

    One box when the tuples form a full product, as the layers of one stack do. Else
    split on the first index and merge the values whose rest splits the same way, so
    that ``stages.0.layers.{0..3}`` and ``stages.1.layers.{4..7}`` stay two rows
    rather than claiming ``stages.{0,1}.layers.{0..7}``. Linear in the points: each
    point is handed down once per index, never tested against every box.
    """
    positions = [k for _, k in points]
    if not points[0][0]:
        return [((), positions)]
    sets = [frozenset(p[i] for p, _ in points) for i in range(len(points[0][0]))]
    if math.prod(map(len, sets)) == len({p for p, _ in points}):
        return [(tuple(sets), positions)]
    rests: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    for p, k in points:
        rests.setdefault(p[0], []).append((p[1:], k))
    merged: dict[tuple[Box, ...], tuple[list[int], list[list[int]]]] = {}
    for first, rest in rests.items():
        below = _boxes(rest)
        firsts, held = merged.setdefault(tuple(b for b, _ in below), ([], [[] for _ in below]))
        firsts.append(first)
        for into, (_, ks) in zip(held, below, strict=True):
            into.extend(ks)
    return [
        ((frozenset(firsts), *box), sorted(ks))
        for boxes, (firsts, held) in merged.items()
        for box, ks in zip(boxes, held, strict=True)
    ]


def collapse_paths(paths: Sequence[str], keys: Sequence[Any]) -> list[tuple[str, list[int]]]:
    """Paths that differ only in integer components and share a key, as one row each.

    Args:
      paths: dot-joined paths; one repeated with the same key is one path.
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
        for box, chosen in _boxes(members):
            sets = iter(box)
            path = ".".join(index_ranges(next(sets)) if p is None else p for p in template)
            rows.append((path or "<root>", chosen))
    rows.sort(key=lambda r: r[1][0])
    return rows
