"""Fan-out's reshard where spanning axes were moved (:class:`~.staging.Stage`'s
``moved``): every piece of the planned array sent straight from a device of the process
that read it, each piece crossing to a process once.

Where a mesh axis that spans processes splits columns (a ``(2, 3)`` mesh of 3
processes x 2 devices, one process in both rows), fan-out reads whole rows onto a
staging sharding and moves the pieces back. As XLA's collectives (an all-to-all within
the moved axes' groups, then the all-gather of the added ones), a piece went first to
its column's device in the reader's row, then to the other row's holder: where the
reader's process holds that one too, the piece crossed to another process and back
(1.06-1.07x the bytes due on (2, 3)); XLA's one-step lowering gathered every share
whole (1.42x).

Here the route is planned from the shardings alone (:func:`sends`, the same on every
process), and runs as one ``shard_map`` of collective permutes (:func:`program`):

- a device's piece that a device of its own process read is copied within the process;
- another is sent once to one device of its process, straight from the reader, and that
  device hands it on to the process's other devices that hold it.

So the bytes crossing between processes are the bytes due, each distinct planned block's
unread part once per process (:func:`crossing`; the all-gather bound's where nothing is
moved). Values are moved, never computed: the bits are the file's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..._caches import memo
from ..layout.host import resolved
from . import staging as _staging
from .staging import Stage

Region = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Send:
    """One piece of ``shape`` from device ``src`` to device ``dst`` (indices into the
    mesh's devices, row-major), from ``at`` in the source's staging block (or, where
    ``forward``, its planned block: a piece handed on within a process) to ``to`` in
    the destination's planned block. ``src == dst``: a copy within the device."""

    src: int
    dst: int
    at: tuple[int, ...]
    to: tuple[int, ...]
    shape: tuple[int, ...]
    forward: bool = False


def routes(stage: Stage | None, sharding: NamedSharding, shape: tuple[int, ...]) -> bool:
    """Whether the reshard of ``stage`` onto ``sharding`` takes this route: where axes
    were moved, and every sharded dimension divides evenly (``shard_map``'s blocks)."""
    if stage is None or not stage.moved:
        return False
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for n, axes in zip(shape, spec, strict=True):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        if n % math.prod(mesh.shape[a] for a in names):
            return False
    return True


def _region(index: Sequence[slice]) -> Region:
    return tuple((s.start, s.stop) for s in index)


def _overlap(a: Region, b: Region) -> Region | None:
    out = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


@memo(256)
def sends(stage: Stage, sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[Send, ...]:
    """The route of ``stage``'s staging array onto ``sharding`` (the planned array of
    ``shape``): for each device's planned block, each part from the staging block that
    holds it, in the order every process computes alike. A part that no device of the
    destination's process read crosses once per process: to its first device that
    holds it, from the reader's device that has sent least so far; its other devices
    get it forwarded from there."""
    devices = list(stage.sharding.mesh.devices.flat)
    number = {d: i for i, d in enumerate(devices)}
    proc = [_staging.process_of(d) for d in devices]
    staged: dict[Region, list[int]] = {}  # a staging block's real part -> its devices
    for device, index in stage.sharding.devices_indices_map(stage.shape).items():
        real = _region(stage.real(resolved(index, stage.shape))[0])
        if all(lo < hi for lo, hi in real):
            staged.setdefault(real, []).append(number[device])
    for held in staged.values():
        held.sort()
    planned = {
        number[d]: _region(resolved(i, shape))
        for d, i in sharding.devices_indices_map(shape).items()
    }
    out: list[Send] = []
    sent = [0] * len(devices)
    delivered: dict[tuple[int, Region], int] = {}  # (process, part) -> its first device

    def start(part: Region, of: Region) -> tuple[int, ...]:
        return tuple(p[0] - o[0] for p, o in zip(part, of, strict=True))

    for dst in range(len(devices)):
        want = planned[dst]
        for real, held in sorted(staged.items()):
            part = _overlap(real, want)
            if part is None:
                continue
            size = tuple(hi - lo for lo, hi in part)
            local = [d for d in held if proc[d] == proc[dst]]
            first = delivered.get((proc[dst], part))
            if dst in held or local or first is None:
                src = dst if dst in held else local[0] if local else min(held, key=sent.__getitem__)
                sent[src] += math.prod(size) if proc[src] != proc[dst] else 0
                delivered.setdefault((proc[dst], part), dst)
                out.append(Send(src, dst, start(part, real), start(part, want), size))
            else:  # it crossed to this process already: handed on from there
                at = start(part, planned[first])
                out.append(Send(first, dst, at, start(part, want), size, forward=True))
    return tuple(out)


def crossing(route: Sequence[Send], mesh: Any) -> int:
    """The elements ``route`` sends from one process to another."""
    proc = [_staging.process_of(d) for d in mesh.devices.flat]
    return sum(math.prod(s.shape) for s in route if proc[s.src] != proc[s.dst])


def rounds(route: Sequence[Send]) -> list[list[Send]]:
    """``route`` in rounds of collective permutes: in each, sends of one shape and
    kind, each device the source of one at most and the destination of one at most;
    the forwards after the others (they hand on what those brought)."""
    out: list[list[Send]] = []
    for s in route:
        fits = (
            r
            for r in out
            if (r[0].forward, r[0].shape) == (s.forward, s.shape)
            and all(s.src != t.src and s.dst != t.dst for t in r)
        )
        found = next(fits, None)
        if found is None:
            out.append([s])
        else:
            found.append(s)
    return sorted(out, key=lambda r: r[0].forward)  # stable: the forwards last


def program(stage: Stage, sharding: NamedSharding, shape: tuple[int, ...]) -> Any:
    """The reshard of a staging array (on ``stage.sharding``) onto ``sharding`` by
    :func:`sends`' route: a function of the staging array, to be jitted with
    ``out_shardings=sharding``. The values are moved as they are (the caller casts
    bf16's and float8's bits to unsigned integers around it: :func:`~.reshard.carrier`)."""
    mesh = stage.sharding.mesh
    names = tuple(mesh.axis_names)
    block = sharding.shard_shape(shape)
    count = mesh.devices.size
    route = sends(stage, sharding, shape)
    # a device that receives nothing in a round writes its piece past its block's
    # rows (cut off at the end): no select of what it held there
    spare = max((s.shape[0] for s in route), default=0)
    steps = []
    for step in rounds(route):
        at = np.zeros((count, len(shape)), np.int32)
        to = np.zeros((count, len(shape)), np.int32)
        to[:, 0] = block[0]
        kept = np.zeros(count, bool)  # a copy within the device
        for s in step:
            at[s.src], to[s.dst], kept[s.dst] = s.at, s.to, s.src == s.dst
        pairs = [(s.src, s.dst) for s in step if s.src != s.dst]
        steps.append((step[0].forward, step[0].shape, at, to, kept, pairs))

    def body(x: jax.Array) -> jax.Array:
        me = jax.lax.axis_index(names)
        out = jax.numpy.zeros((block[0] + spare, *block[1:]), x.dtype)
        for forward, size, at, to, kept, pairs in steps:
            source = out if forward else x
            piece = jax.lax.dynamic_slice(source, list(jax.numpy.asarray(at)[me]), size)
            moved = jax.lax.ppermute(piece, names, pairs) if pairs else piece
            if kept.any():
                moved = jax.numpy.where(jax.numpy.asarray(kept)[me], piece, moved)
            out = jax.lax.dynamic_update_slice(out, moved, list(jax.numpy.asarray(to)[me]))
        return out[: block[0]]

    return jax.shard_map(
        body, mesh=mesh, in_specs=stage.sharding.spec, out_specs=sharding.spec, check_vma=False
    )
