"""What every encoding shares, so that none imports another: how a decoding program is
compiled once when several threads reach it (:func:`alone`), the per-device arguments
of a program that decodes each device's own block (:func:`by_device`,
:func:`per_device`), and a refusal of repeated layers as one (:func:`collapsed`).
"""

from __future__ import annotations

import re
import threading
from typing import Any

import jax
import numpy as np

from ..._format import index_ranges, some
from ..layout import host as _host

_ALONE: dict[int, threading.Lock] = {}
_ALONE_GUARD = threading.Lock()


def alone(program: Any) -> threading.Lock:
    """A lock of ``program``'s own: its first call compiles it, and a second thread's
    call of the same program waits for that compile rather than compiling it again."""
    with _ALONE_GUARD:
        return _ALONE.setdefault(id(program), threading.Lock())


def by_device(held: dict[Any, Any], entry: Any, stage: Any) -> dict[Any, Any]:
    """Each of this process's devices of the entry with what was kept for its block
    (``held``, by the block's bounds): the rows of a per-device argument."""
    blocks = {}
    for index, devices in _host.holders(entry, stage).values():
        for device in devices:
            blocks[device] = held[tuple((s.start, s.stop) for s in index)]
    return blocks


def per_device(values: list[tuple[Any, np.ndarray]], n: int, sharding: Any) -> jax.Array:
    """A global array of ``n`` rows, one per device of the mesh, from each addressable
    device's own row."""
    shape = (n, *values[0][1].shape)
    rows = [jax.device_put(v[None], d) for d, v in values]
    return jax.make_array_from_single_device_arrays(shape, sharding, rows)


_INT = re.compile(r"(?<![^.])(0|[1-9][0-9]*)(?![^.])")  # a dot-separated integer component


def collapsed(
    rows: list[tuple[str, str, Any, str]],
) -> list[tuple[str, str, Any, str]]:
    """``(path, tensor, key, file)`` rows, those that differ only in the integer
    components of the path and the tensor's name (and the file) as one row each,
    ``layers.{0..60}.mlp.up``, where exactly the product of the integers shown is
    there; else each row as it is. Components that vary alike (the layer number of a
    path and of its tensor) vary together."""
    groups: dict[Any, list[tuple[str, str, Any, str]]] = {}
    for row in rows:
        path, tensor, key, _ = row
        groups.setdefault((_INT.sub("#", path), _INT.sub("#", tensor), key), []).append(row)
    out = []
    for (_, _, key), members in groups.items():
        points = [
            tuple(int(x) for x in (*_INT.findall(path), *_INT.findall(tensor)))
            for path, tensor, _, _ in members
        ]
        columns = list(zip(*points, strict=True)) if points[0] else []
        distinct = list(dict.fromkeys(columns))
        product = 1
        for column in distinct:
            product *= len(set(column))
        files = list(dict.fromkeys(f for *_, f in members))
        if len(members) == 1 or product != len(set(points)) or len(set(points)) != len(points):
            out += [(p, t, k, f) for p, t, k, f in members]
            continue
        shown = [index_ranges(set(column)) for column in columns]
        path, tensor = _filled(members[0][0], shown), _filled(members[0][1], shown)
        where = files[0] if len(files) == 1 else f"{len(files)} files ({some(files, 2)})"
        out.append((path, tensor, key, where))
    return out


def _filled(name: str, shown: list[str]) -> str:
    """``name`` with its integer components replaced by the next of ``shown`` (taken)."""
    parts = _INT.split(name)
    for k in range(1, len(parts), 2):
        parts[k] = shown.pop(0)
    return "".join(parts)
