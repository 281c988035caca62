"""The reshard step of fan-out: a staging array (:mod:`.staging`), once every process
holding its parameter has read its share, filled onto the planned sharding by one
compiled collective (an all-gather; bf16's and float8's bits as unsigned integers,
:func:`carrier`: XLA moves only data, so the values are the bytes read, and each
dtype crosses as its own bytes), batch by batch as the read places them
(:class:`Resharder`).

The batches (:func:`~meshinit._checkpoint.read.staging.batches`) run while the next
batches' shares are fetched, so the reshards overlap the fetches that follow; before
each batch every process agrees that all read their shares
(:func:`meshinit._run.agree.checkpoint`), so a failed fetch on one process makes every
process raise instead of waiting in a collective. One reshard runs at a time.

:func:`enter` and :func:`finish` are looked up on this module as each reshard runs:
the multi-process tests inject their faults there.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ... import _caches
from ..._plan.entries import PlanEntry
from ..._run import agree as _agree
from ..layout.host import resolved
from . import staging as _staging
from .staging import Stage

BYTES_FROM_PEERS = "/meshinit/safetensors/bytes_from_peers"
"""The ``jax.monitoring`` scalar each process records once per load: the bytes of its
distinct blocks (each once, however many of its devices hold it) that the fan-out's
collectives brought from other processes' reads."""

_reshards = _caches.lru("fan-out reshards", 256)


def program(entry: PlanEntry, stage: Stage, staged: jax.Array) -> Any:
    """The compiled reshard of ``staged`` (on ``stage.sharding``) to the entry's planned
    sharding, the padding cut off: one program per signature, compiled here, before
    its batch's agreement, so that what can fail on one process alone fails before
    any process enters the batch's collectives. None where this process holds none of
    the entry (it takes no part)."""
    sharding, shape = entry.sharding, entry.spec.shape
    if not any(_staging.process_of(d) == jax.process_index() for d in sharding.device_set):
        return None
    twin = NamedSharding(stage.sharding.mesh, sharding.spec, memory_kind=sharding.memory_kind)
    key = (stage, twin, shape, str(staged.dtype))
    compiled = _reshards.get(key)
    if compiled is None:
        with jax.set_mesh(stage.sharding.mesh):  # type: ignore[arg-type]  # over a user's
            jitted = jax.jit(_cut(stage, shape, twin), out_shardings=twin)
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


def carrier(dtype: Any) -> np.dtype | None:
    """The unsigned integer dtype that ``dtype``'s bits cross between the processes as,
    or None where they cross as they are. XLA's CPU all-gather widens bf16 to f32 and
    float8 to f16 (twice the bytes): their bits cross as uint16 and uint8. f16, f32
    and integers move their own bytes. (A bitcast of f32 to uint32 made the reshard
    after a peer's failed load wait for ever on jax 0.12.1, 3 runs of 3, not on jax
    0.10.2: only the dtypes that need it are cast.)"""
    dtype = np.dtype(dtype)
    if dtype == jax.numpy.bfloat16:
        return np.dtype(np.uint16)
    if dtype.itemsize == 1 and jax.numpy.issubdtype(dtype, jax.numpy.floating):
        if jax.numpy.finfo(dtype).bits == 8:  # not a sub-byte float (fp4)
            return np.dtype(np.uint8)
    return None


def _cut(stage: Stage, shape: tuple[int, ...], twin: NamedSharding) -> Any:
    d, s, rows, padded = stage.axis, stage.shards, stage.rows, stage.padded
    middle = None
    if stage.moved:  # first back to their dimensions (an all-to-all within the groups
        # of the moved axes), then gathered: as one step XLA gathers every share whole
        spec = list(twin.spec) + [None] * (len(shape) - len(twin.spec))
        axes = [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in spec]
        axes[d] = axes[d] + stage.added
        middle = NamedSharding(twin.mesh, P(*(a if a else None for a in axes)))

    def cut(x: jax.Array) -> jax.Array:
        dtype, bits = x.dtype, carrier(x.dtype)
        if bits is not None:  # the collectives move the stored bits, bit for bit; the
            # barriers keep XLA from folding the bitcasts together across them (it
            # then widens bf16 again)
            x = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(x, bits))
        if middle is not None:
            x = jax.lax.with_sharding_constraint(x, middle)
        if padded != rows:
            y = x.reshape(shape[:d] + (s, padded) + shape[d + 1 :])
            x = jax.lax.slice_in_dim(y, 0, rows, axis=d + 1).reshape(shape)
        if bits is None:
            return x
        x = jax.lax.with_sharding_constraint(x, twin)  # resharded here, as bits
        return jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(x), dtype)

    return cut


def from_peers(entry: PlanEntry, stage: Stage) -> int:
    """The bytes of this process's distinct planned blocks of ``entry`` that no device
    of this process read: what must reach it from other processes' reads (a block on
    two of its devices counted once: the process's due, not its devices')."""
    me = jax.process_index()
    itemsize = np.dtype(entry.spec.dtype).itemsize
    mine = set()  # the planned array's parts that this process's staging blocks hold
    for device, index in stage.sharding.devices_indices_map(stage.shape).items():
        if _staging.process_of(device) == me:
            real, _ = stage.real(resolved(index, stage.shape))
            mine.add(tuple((s.start, s.stop) for s in real))
    held = entry.sharding.addressable_devices_indices_map(entry.spec.shape).values()
    total = 0
    for want in {tuple((s.start, s.stop) for s in resolved(i, entry.spec.shape)) for i in held}:
        have = sum(_overlap(want, m) for m in mine)
        total += (math.prod(b - a for a, b in want) - have) * itemsize
    return total


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    return math.prod(max(0, min(x[1], y[1]) - max(x[0], y[0])) for x, y in zip(a, b, strict=True))


class Resharder:
    """The staged arrays of a load, resharded batch by batch
    (:func:`~meshinit._checkpoint.read.staging.batches`) as the read places them.

    A batch is fenced: its programs are compiled first, then every process agrees
    (:func:`~meshinit._run.agree.checkpoint`, naming the batch and its signatures), and
    from there each runs the batch whole. A failure after a collective started (an
    error or Ctrl-C while its output is finished) is raised once the batch's last
    collective has run, so no peer is left waiting in one that this process never
    enters; the peers meet it at the next agreement. A process that cannot start a
    collective that its peers are in, or whose collective fails, says so at once
    (:func:`~meshinit._run.agree.left_collectives`), and the job's collectives are
    not used again."""

    def __init__(self, ends: Collection[str], what: str):
        self._ends = ends  # the last path of each batch (staging.ends): its reshard waits
        # for the batch's reads
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
