"""The reads planned (fan-out's half that decides): which parameters are read onto a
staging sharding, each process fetching a share of a block that devices of several
processes hold, and in which batches their reshards run.

Under ``jax.distributed`` each process reads the blocks its own devices hold
(:mod:`.loop`). Where a parameter's sharding repeats across processes (data-parallel
replicas, a replicated norm, tensor parallelism within a host replicated across
hosts), each of them would fetch the same bytes. Here such a parameter is planned to be
read instead onto a *staging* sharding: its own ``PartitionSpec`` with the mesh axes that
replicate it across processes added to one dimension (:class:`Stage`). Each process
then reads only its staging blocks, a 1/R share of each block it holds, and one
jitted reshard from the staging sharding to the planned one (:mod:`.reshard`: an
all-gather; XLA moves only data, so the values are the bytes read) fills every replica.

The dimension split is the one along which the stored bytes run contiguously (the
stored tensor's outer dimension, through the layout's transposes and joins:
:func:`outer_axes`), so each share is a few long byte runs of the file; where the
planned block's length along it is not a multiple of the share count, the staging
array is padded with zeros at the end of each block, and the reshard cuts them off.
A parameter with no such dimension (a scalar) is read as before, by each holder.

Where a mesh axis that spans processes splits another dimension (on a ``(2, 3)`` mesh
of 3 processes x 2 devices, ``tensor`` crosses processes and one process sits in both
rows), each process's block is a piece of every stored row, beside other processes'
pieces: the fetch would read through the gaps (the whole rows, up to 2x here) or spend
a request a row. Such axes are *moved* onto the split dimension too, so each process
reads whole rows, an equal share, sharded parameters included; the reshard sends
each piece back to each process that holds it (:mod:`.route`).

Every choice here is made from what every process knows alike (the plan, the
files' headers), so the staging shardings and the order of the collectives agree on
every process; the reshards run in about 16 batches, each within ``budget`` bytes per
process (:func:`batches`). What shapes the collectives (:func:`facts`: ``fan_out``,
the budget, the staging and the batches) is compared by every process before the
first one (:func:`meshinit._run.agree.checkpoint`, in :mod:`.load`).
"""

from __future__ import annotations

import dataclasses
import math
import socket
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import _caches
from ..._jax import compat as _compat
from ..._plan.entries import PlanEntry
from ..._run import agree as _agree
from ..._run import compile as _compile
from ..layout import blocks as _blocks
from ..layout.host import resolved


@dataclasses.dataclass(frozen=True)
class Stage:
    """How one parameter is read with fan-out: onto ``sharding`` (the planned spec with
    ``added`` mesh axes on ``axis``, and the ``moved`` ones taken from the other
    dimensions to it, on the mesh's all-Auto twin), an array of ``shape``: along
    ``axis`` each of the planned sharding's ``shards`` blocks of ``rows`` rows is
    padded to ``padded`` rows (a multiple of the added and moved axes' size)."""

    sharding: NamedSharding
    shape: tuple[int, ...]
    axis: int
    shards: int
    rows: int
    padded: int
    added: tuple[str, ...]
    moved: tuple[str, ...] = ()

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


def process_of(device: Any) -> int:
    """The process a device belongs to."""
    return int(device.process_index)


def _axes(spec: Any) -> tuple[str, ...]:
    if spec is None:
        return ()
    return (spec,) if isinstance(spec, str) else tuple(spec)


@_caches.memo(64)
def spanning(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's axes along which a step can change the process (in mesh order)."""
    procs = np.vectorize(process_of, otypes=[int])(mesh.devices)
    return tuple(
        name
        for i, name in enumerate(mesh.axis_names)
        if procs.shape[i] > 1 and bool((np.diff(procs, axis=i) != 0).any())
    )


def processes() -> int:
    """The job's process count (a function: tests stand in for a job of several)."""
    return jax.process_count()


def staged(jobs: list[Any], fan_out: bool | None, one: bool = False) -> list[Any]:
    """``jobs`` (:class:`~meshinit._checkpoint.layout.host.Job`), each with the stage it
    is read onto where fan-out applies: unless ``fan_out`` is False, under more than one
    process; with ``fan_out=None``, not a job that reads local files only where every
    process runs on ``one`` host (:func:`one_host`)."""
    if fan_out is False or processes() == 1:
        return jobs
    if fan_out is None and one:  # local files on one host: its page cache serves all
        remote = [any(leaf.stored.file.fetched for leaf in _blocks.leaves(j.node)) for j in jobs]
        out = iter(staged([j for j, r in zip(jobs, remote, strict=True) if r], fan_out))
        return [next(out) if r else j for j, r in zip(jobs, remote, strict=True)]
    # a parameter read by its own Parts (an encoding's) is staged where they can
    # gather its stored bytes (``stages``: float8's; ``stage_of``: an array of their
    # own, MXFP4's, staged by this module's stage); else each holder reads it
    return [dataclasses.replace(j, stage=_stage_of(j)) if _stages(j) else j for j in jobs]


def _stage_of(job: Any) -> Stage | None:
    own = getattr(job.parts, "stage_of", None)
    return stage(job.entry, job.node) if own is None else own(job, stage)


def _stages(job: Any) -> bool:
    if job.parts is None:
        return True
    return bool(getattr(job.parts, "stages", False) and math.prod(job.entry.spec.shape))


HOSTS = "meshinit/hosts"
"""The key-value store's folder where each process posts its host (:func:`one_host`)."""

HOSTS_TIMEOUT_MS = 60_000
_one_host: dict[int, bool] = {}


def _host() -> str:
    """This host's identity: its name and its kernel's boot id (the processes of one
    kernel share its page cache)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()} {boot}"


def one_host() -> bool:
    """Whether every process of the job runs on this host: there a local file that one
    process reads is in the page cache for all, and fan-out would only add loopback
    traffic. Each process posts its host's name and boot id to ``jax.distributed``'s
    key-value store once a job, at its first load, and reads the others' (every
    process reaches the same answer)."""
    client = _compat.distributed_client()
    if processes() == 1 or client is None:
        return processes() == 1
    if id(client) not in _one_host:
        client.key_value_set(f"{HOSTS}/{jax.process_index()}", _host(), allow_overwrite=True)
        seen = {
            client.blocking_key_value_get(f"{HOSTS}/{i}", HOSTS_TIMEOUT_MS)
            for i in range(processes())
        }
        _one_host[id(client)] = len(seen) == 1
    return _one_host[id(client)]


def shared(entry: PlanEntry) -> bool:
    """Whether a block of the entry is held by devices of more than one process."""
    owners: dict[tuple[Any, ...], set[int]] = {}
    shape = entry.spec.shape
    for device, index in entry.sharding.devices_indices_map(shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        found = owners.setdefault(key, set())
        found.add(process_of(device))
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
    planned: no block is held by two processes and no process's block interleaves
    with another's along the stored rows, or no axis to split."""
    sharding, shape = entry.sharding, entry.spec.shape
    if not shape or not _blocks.leaves(node):
        return None  # a scalar, or a constant (a Fill reads nothing)
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)  # the load refuses abstract meshes before it reads
    spec = [_axes(a) for a in sharding.spec] + [()] * (len(shape) - len(sharding.spec))
    used = {a for axes in spec for a in axes}
    span = spanning(mesh)
    added = tuple(a for a in span if a not in used)
    shared_ = shared(entry)

    def moved(a: int) -> tuple[str, ...]:
        # spanning axes that split another dimension than ``a``: each process's block
        # is then a piece of each stored row that other processes' pieces interleave
        # with (runs the fetch reads through, or a request each): moved onto ``a``
        return tuple(x for d, axes in enumerate(spec) if d != a for x in axes if x in span)

    def share(a: int) -> int:
        return math.prod(mesh.shape[x] for x in added + moved(a))

    def rows_of(a: int) -> int:
        return shape[a] // math.prod(mesh.shape[x] for x in spec[a])

    # of the axes of long runs, one the shares divide, else one with a row for each
    # share (its blocks padded: shares differ by a row), else the first
    axes = outer_axes(node) or [max(range(len(shape)), key=lambda a: (shape[a], -a))]
    even = [a for a in axes if rows_of(a) % share(a) == 0]
    axis = (even + [a for a in axes if rows_of(a) >= share(a)] or axes)[0]
    move = moved(axis)
    if not (added and shared_) and not move:
        return None  # nothing shared, and each process's blocks are whole stored rows
    if not shared_:
        added = ()
    k = share(axis) if shared_ else math.prod(mesh.shape[x] for x in move)
    shards = math.prod(mesh.shape[a] for a in spec[axis])
    rows = shape[axis] // shards
    padded = -(-rows // k) * k
    spec = [tuple(x for x in axes if x not in move) for axes in spec]
    spec[axis] = spec[axis] + added + move
    twin = _compile.auto_twin(mesh)  # Auto axes: the reshard may slice where jax's
    # Explicit types would refuse a cut of a sharded dimension that does not divide
    staging = NamedSharding(
        twin, P(*(a if a else None for a in spec)), memory_kind=sharding.memory_kind
    )
    staged = (*shape[:axis], shards * padded, *shape[axis + 1 :])
    made = Stage(staging, staged, axis, shards, rows, padded, added, move)
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


def ends(jobs: Sequence[Any], budget: int) -> frozenset[str]:
    """The paths of the staged jobs that close a batch (:func:`batches`): at each, the
    reshard step has the batch's reads and runs it."""
    staged = [job.entry for job in jobs if job.stage is not None]
    found = batches(staged, budget)
    return frozenset(
        entry.path
        for k, entry in enumerate(staged)
        if k + 1 == len(staged) or found[k] != found[k + 1]
    )


def _busiest(entry: PlanEntry) -> int:
    per: dict[int, int] = {}
    shape = entry.spec.shape
    block = np.dtype(entry.spec.dtype).itemsize * math.prod(entry.sharding.shard_shape(shape))
    for device in entry.sharding.device_set:
        per[process_of(device)] = per.get(process_of(device), 0) + block
    return max(per.values(), default=0)


def facts(jobs: Sequence[Any], fan_out: bool | None, budget: int) -> dict[str, str]:
    """What shapes a load's collectives, as every process must have it alike: compared
    before the first collective (:func:`meshinit._run.agree.checkpoint`)."""
    staged = [(job.entry, job.stage) for job in jobs if job.stage is not None]
    return {
        # None and True alike: where they stage differently (local files on one
        # host), the staging decisions differ
        "fan_out": repr(fan_out is not False),
        "max_inflight_bytes": str(budget),
        "the paths read": _agree.digest([job.entry.path for job in jobs]),
        "the staging decisions": _agree.digest([(entry.path, stage) for entry, stage in staged]),
        "the batches of reshards": _agree.digest(batches([entry for entry, _ in staged], budget)),
    }
