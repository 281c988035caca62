"""Fan-out: a stored block that devices of several processes hold is fetched once for the
whole job, split among those processes, and filled on every holder by a compiled
collective.

Under ``jax.distributed`` each process reads the blocks its own devices hold
(:mod:`.read`). Where a parameter's sharding repeats across processes (data-parallel
replicas, a replicated norm, tensor parallelism within a host replicated across
hosts), each of them would fetch the same bytes. Here such a parameter is read
instead onto a *staging* sharding: its own ``PartitionSpec`` with the mesh axes that
replicate it across processes added to one dimension (:class:`Stage`). Each process
then reads only its staging blocks, a 1/R share of each block it holds, and one
jitted reshard from the staging sharding to the planned one (an all-gather; XLA
moves only data, so the values are the bytes read) fills every replica.

The dimension split is the one along which the stored bytes run contiguously (the
stored tensor's outer dimension, through the layout's transposes and joins:
:func:`outer_axes`), so each share is a few long byte runs of the file; where the
planned block's length along it is not a multiple of the share count, the staging
array is padded with zeros at the end of each block, and the reshard cuts them off.
A parameter with no such dimension (a scalar) is read as before, by each holder.

Every choice here is made from what every process knows alike (the plan, the
files' headers), so the staging shardings and the order of the collectives agree on
every process. The reshards run in about 16 batches, each within ``budget`` bytes per
process (:func:`batches`), as the read places their parameters, so they overlap the
fetches that follow; before each batch every process agrees that all read their
shares (:func:`meshinit._run.agree.checkpoint`), so a failed fetch on one process
makes every process raise instead of waiting in a collective. One reshard runs at a
time (:func:`reshard`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import _caches
from ..._plan.entries import PlanEntry
from ..._run import agree as _agree
from ..._run import compile as _compile
from ..layout import blocks as _blocks
from ..layout.host import resolved

BYTES_FROM_PEERS = "/meshinit/safetensors/bytes_from_peers"
"""The ``jax.monitoring`` scalar each process records once per load: the bytes of its
devices' shards that the fan-out's collectives brought from other processes' reads."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """How one parameter is read with fan-out: onto ``sharding`` (the planned spec with
    ``added`` mesh axes on ``axis``, on the mesh's all-Auto twin), an array of
    ``shape``: along ``axis`` each of the planned sharding's ``shards`` blocks of
    ``rows`` rows is padded to ``padded`` rows (a multiple of the added axes' size)."""

    sharding: NamedSharding
    shape: tuple[int, ...]
    axis: int
    shards: int
    rows: int
    padded: int
    added: tuple[str, ...]

    def real(self, index: tuple[slice, ...]) -> tuple[tuple[slice, ...], int]:
        """The planned array's part of the staging block at ``index`` (bounds
        resolved), and the rows of padding after it along :attr:`axis`."""
        d, s = self.axis, index[self.axis]
        block = s.start // self.padded
        low = block * self.padded
        start = block * self.rows + min(s.start - low, self.rows)
        stop = block * self.rows + min(s.stop - low, self.rows)
        real = (*index[:d], slice(start, stop), *index[d + 1 :])
        return real, (s.stop - s.start) - (stop - start)


def _process(device: Any) -> int:
    return int(device.process_index)


def _axes(spec: Any) -> tuple[str, ...]:
    if spec is None:
        return ()
    return (spec,) if isinstance(spec, str) else tuple(spec)


@_caches.memo(64)
def spanning(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's axes along which a step can change the process (in mesh order)."""
    procs = np.vectorize(lambda d: _process(d), otypes=[int])(mesh.devices)
    return tuple(
        name
        for i, name in enumerate(mesh.axis_names)
        if procs.shape[i] > 1 and bool((np.diff(procs, axis=i) != 0).any())
    )


def processes() -> int:
    """The job's process count (a function: tests stand in for a job of several)."""
    return jax.process_count()


def staged(jobs: list[Any], fan_out: bool | None) -> list[Any]:
    """``jobs`` (:class:`~meshinit._checkpoint.read.loop.Job`), each with the stage it is read onto
    where fan-out applies: unless ``fan_out`` is False, under more than one process."""
    if fan_out is False or processes() == 1:
        return jobs
    # a dequantized parameter (its own Parts: .dequant) is read by each holder
    return [j if j.parts else dataclasses.replace(j, stage=stage(j.entry, j.node)) for j in jobs]


def shared(entry: PlanEntry) -> bool:
    """Whether a block of the entry is held by devices of more than one process."""
    owners: dict[tuple[Any, ...], set[int]] = {}
    shape = entry.spec.shape
    for device, index in entry.sharding.devices_indices_map(shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        found = owners.setdefault(key, set())
        found.add(_process(device))
        if len(found) > 1:
            return True
    return False


def outer_axes(node: _blocks.Node) -> list[int]:
    """The result axes of ``node`` a split along which gives each share long runs of
    its stored bytes: a stored tensor's outermost axis (whole rows per share); of a
    stack, the stacked axis (whole tensors), then its parts' outermost axis (one run
    of each part). Empty where the parts disagree, or for a constant."""
    if isinstance(node, _blocks.Const):
        return []
    if isinstance(node, _blocks.Padded):
        return outer_axes(node.part)
    if isinstance(node, _blocks.Leaf):
        view = [node.order.index(a) for a, n in enumerate(node.shape) if n > 1]
        return [_merged_axis(view[0], node.groups)] if view else []
    found = {tuple(outer_axes(p)[-1:]) for p in node.parts}
    inner = list(found.pop()) if len(found) == 1 else []
    if node.stacked:
        inner = [a + (a >= node.axis) for a in inner]
        inner = ([node.axis] if node.shape[node.axis] > 1 else []) + inner
    merged = dict.fromkeys(_merged_axis(a, node.groups) for a in inner)
    return [m if node.order is None else node.order.index(m) for m in merged]


def _merged_axis(axis: int, groups: tuple[int, ...] | None) -> int:
    """The axis of a merged shape (``groups``: how many axes each merges) holding
    ``axis`` of the unmerged one."""
    if groups is None:
        return axis
    return int(np.searchsorted(np.cumsum(groups), axis, side="right"))


def stage(entry: PlanEntry, node: _blocks.Node) -> Stage | None:
    """The staging of ``entry`` (read from ``node``), or None where it is read as
    planned: no block is held by two processes, or no axis to split."""
    sharding, shape = entry.sharding, entry.spec.shape
    if not shape or not _blocks.leaves(node) or not shared(entry):
        return None  # a scalar, or a constant (a Fill reads nothing), or no replica
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)  # the load refuses abstract meshes before it reads
    spec = [_axes(a) for a in sharding.spec] + [()] * (len(shape) - len(sharding.spec))
    used = {a for axes in spec for a in axes}
    added = tuple(a for a in spanning(mesh) if a not in used)
    if not added:
        return None
    k = math.prod(mesh.shape[a] for a in added)

    def rows_of(a: int) -> int:
        return shape[a] // math.prod(mesh.shape[x] for x in spec[a])

    # of the axes of long runs, one the shares divide, else one with a row for each
    # share (its blocks padded: shares differ by a row), else the first
    axes = outer_axes(node) or [max(range(len(shape)), key=lambda a: (shape[a], -a))]
    even = [a for a in axes if rows_of(a) % k == 0] + [a for a in axes if rows_of(a) >= k]
    axis = (even or axes)[0]
    shards = math.prod(mesh.shape[a] for a in spec[axis])
    rows = shape[axis] // shards
    padded = -(-rows // k) * k
    spec[axis] = spec[axis] + added
    twin = _compile.auto_twin(mesh)  # Auto axes: the reshard may slice where jax's
    # Explicit types would refuse a cut of a sharded dimension that does not divide
    staging = NamedSharding(
        twin, P(*(a if a else None for a in spec)), memory_kind=sharding.memory_kind
    )
    staged = (*shape[:axis], shards * padded, *shape[axis + 1 :])
    made = Stage(staging, staged, axis, shards, rows, padded, added)
    # a merged axis (out_shape) can refuse a block that cuts inside a row: read such a
    # parameter as planned (every planned block was checked before the load)
    shares = {}
    for index in staging.devices_indices_map(staged).values():
        real = made.real(resolved(index, staged))[0]
        shares[tuple((x.start, x.stop) for x in real)] = real  # slices hash from 3.12 only
    if _blocks.check(node, list(shares.values())) is not None:
        return None
    return made


BATCHES = 16
"""About how many batches a load's reshards run in: each batch's reshards run while the
next batch's shares are fetched, so the load ends 1/BATCHES of its reshards after its
last fetch; each batch costs one agreement of every process (a few milliseconds)."""

SMALLEST = 4 << 20
"""The smallest batch, in bytes per process: each batch's agreement also moves bytes
between the processes (at 1 MiB, 5.2% beyond the all-gather's on a 2.8 MiB load)."""


def batches(entries: Sequence[PlanEntry], budget: int) -> list[int]:
    """For each staged entry in order, the batch it is resharded in: consecutive entries
    whose planned and staging bytes on the busiest process stay within ``budget`` and
    about 1/:data:`BATCHES` of the load's (at least :data:`SMALLEST`; at least one
    entry each). The same on every process: computed from the plan alone."""
    costs = [2 * _busiest(entry) for entry in entries]
    limit = min(budget, max(sum(costs) // BATCHES, SMALLEST))
    out, batch, size = [], 0, 0
    for cost in costs:
        if size and size + cost > limit:
            batch, size = batch + 1, 0
        size += cost
        out.append(batch)
    return out


def _busiest(entry: PlanEntry) -> int:
    per: dict[int, int] = {}
    shape = entry.spec.shape
    block = np.dtype(entry.spec.dtype).itemsize * math.prod(entry.sharding.shard_shape(shape))
    for device in entry.sharding.device_set:
        per[_process(device)] = per.get(_process(device), 0) + block
    return max(per.values(), default=0)


_reshards = _caches.lru("fan-out reshards", 256)


def program(entry: PlanEntry, stage: Stage, staged: jax.Array) -> Any:
    """The compiled reshard of ``staged`` (on ``stage.sharding``) to the entry's planned
    sharding, the padding cut off: one program per signature, compiled here, before
    its batch's agreement, so that what can fail on one process alone fails before
    any process enters the batch's collectives. None where this process holds none of
    the entry (it takes no part)."""
    sharding, shape = entry.sharding, entry.spec.shape
    if not any(_process(d) == jax.process_index() for d in sharding.device_set):
        return None
    twin = NamedSharding(stage.sharding.mesh, sharding.spec, memory_kind=sharding.memory_kind)
    key = (stage, twin, shape, str(staged.dtype))
    compiled = _reshards.get(key)
    if compiled is None:
        with jax.set_mesh(stage.sharding.mesh):  # type: ignore[arg-type]  # over a user's
            jitted = jax.jit(_cut(stage, shape), out_shardings=twin)
            compiled = jitted.lower(staged).compile()
        _reshards.put(key, compiled)
    return compiled


def enter(compiled: Any, staged: jax.Array) -> jax.Array:
    """Starts a reshard: from here its collective runs (on every process that holds
    the entry), and its output is not ready until every one of them has joined."""
    return compiled(staged)


def finish(made: jax.Array, entry: PlanEntry) -> jax.Array:
    """A finished reshard's output as the entry's array, on its planned sharding: the
    same devices, indices and bytes, on the planned (Explicit) mesh: no copy."""
    if made.sharding == entry.sharding:
        return made
    shards = [s.data for s in made.addressable_shards]
    return jax.make_array_from_single_device_arrays(entry.spec.shape, entry.sharding, shards)


def absent(entry: PlanEntry) -> jax.Array:
    """The entry's array on a process that holds none of it: no shard."""
    shape, dtype = entry.spec.shape, entry.spec.dtype
    return jax.make_array_from_single_device_arrays(shape, entry.sharding, [], dtype=dtype)


def _cut(stage: Stage, shape: tuple[int, ...]) -> Any:
    d, s, rows, padded = stage.axis, stage.shards, stage.rows, stage.padded

    def cut(x: jax.Array) -> jax.Array:
        if padded == rows:
            return x
        y = x.reshape(shape[:d] + (s, padded) + shape[d + 1 :])
        return jax.lax.slice_in_dim(y, 0, rows, axis=d + 1).reshape(shape)

    return cut


def from_peers(entry: PlanEntry, stage: Stage) -> int:
    """The bytes of this process's planned shards of ``entry`` that no device of this
    process read: what the reshard brings from other processes."""
    me = jax.process_index()
    itemsize = np.dtype(entry.spec.dtype).itemsize
    mine = set()  # the planned array's parts that this process's staging blocks hold
    for device, index in stage.sharding.devices_indices_map(stage.shape).items():
        if _process(device) == me:
            real, _ = stage.real(resolved(index, stage.shape))
            mine.add(tuple((s.start, s.stop) for s in real))
    total = 0
    for held in entry.sharding.addressable_devices_indices_map(entry.spec.shape).values():
        want = tuple((s.start, s.stop) for s in resolved(held, entry.spec.shape))
        have = sum(_overlap(want, m) for m in mine)
        total += (math.prod(b - a for a, b in want) - have) * itemsize
    return total


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    return math.prod(max(0, min(x[1], y[1]) - max(x[0], y[0])) for x, y in zip(a, b, strict=True))


def facts(jobs: Sequence[Any], fan_out: bool | None, budget: int) -> dict[str, str]:
    """What shapes a load's collectives, as every process must have it alike: compared
    before the first collective (:func:`meshinit._run.agree.checkpoint`)."""
    staged = [(job.entry, job.stage) for job in jobs if job.stage is not None]
    return {
        "fan_out": repr(fan_out is not False),  # None does what True does
        "max_inflight_bytes": str(budget),
        "the paths read": _agree.digest([job.entry.path for job in jobs]),
        "the staging decisions": _agree.digest([(entry.path, stage) for entry, stage in staged]),
        "the batches of reshards": _agree.digest(batches([entry for entry, _ in staged], budget)),
    }


class Resharder:
    """The staged arrays of a load, resharded batch by batch (:func:`batches`) as the
    read places them.

    A batch is fenced: its programs are compiled first, then every process agrees
    (:func:`~meshinit._run.agree.checkpoint`, naming the batch and its signatures), and
    from there each runs the batch whole. A failure after a collective started (an
    error or Ctrl-C while its output is finished) is raised once the batch's last
    collective has run, so no peer is left waiting in one that this process never
    enters; the peers meet it at the next agreement. A process that cannot start a
    collective that its peers are in, or whose collective fails, says so at once
    (:func:`~meshinit._run.agree.left_collectives`), and the job's collectives are
    not used again."""

    def __init__(self, staged: Sequence[tuple[PlanEntry, Stage]], budget: int, what: str):
        found = batches([entry for entry, _ in staged], budget)
        # the last entry of each batch: its reshard waits for the batch's reads
        self._ends = {
            entry.path
            for k, (entry, _) in enumerate(staged)
            if k + 1 == len(staged) or found[k] != found[k + 1]
        }
        self._pending: list[tuple[PlanEntry, Stage, jax.Array]] = []
        self._what = what
        self._batch = 0
        self.from_peers = 0

    def add(self, entry: PlanEntry, stage: Stage | None, made: jax.Array) -> dict[str, jax.Array]:
        """The arrays ready once ``made`` (the entry's array, or its staging array) is:
        none until its batch is whole."""
        if stage is None:
            return {entry.path: made}
        self._pending.append((entry, stage, made))
        return self._flush() if entry.path in self._ends else {}

    def _flush(self) -> dict[str, jax.Array]:
        programs = [program(entry, stage, staged) for entry, stage, staged in self._pending]
        signatures = [(e.path, s, str(x.dtype)) for e, s, x in self._pending]
        at = f"batch {self._batch} ({_agree.digest(signatures)})"
        self._batch += 1
        _agree.checkpoint(self._what, at)
        out: dict[str, jax.Array] = {}
        failed: BaseException | None = None
        try:
            with _agree.uninterrupted():
                for compiled in programs:
                    entry, stage, staged = self._pending.pop(0)
                    if compiled is None:
                        staged.delete()
                        out[entry.path] = absent(entry)
                        continue
                    try:
                        made = enter(compiled, staged)
                    except BaseException as e:  # its peers are in it: they must stop
                        _agree.left_collectives(e)
                        staged.delete()
                        raise
                    _agree.settle(made, f"{at}, {entry.path}")  # raises if it broke
                    try:
                        staged.delete()
                        out[entry.path] = finish(made, entry)
                        self.from_peers += from_peers(entry, stage)
                    except BaseException as e:  # after its collective: run the rest
                        failed = failed or e
                        if not made.is_deleted():
                            made.delete()
            if failed is not None:
                raise failed
        except BaseException:
            for made in out.values():
                made.delete()
            raise
        return out

    def close(self) -> None:
        """Deletes the staging arrays not yet resharded (the load failed)."""
        for _, _, staged in self._pending:
            if not staged.is_deleted():
                staged.delete()
        self._pending.clear()
