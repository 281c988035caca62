"""The reshard step of fan-out: a staging array (:mod:`.staging`), once every process
holding its parameter has read its share, filled onto the planned sharding by one
compiled collective (an all-gather; where axes were moved, collective permutes that
:mod:`.route` plans, each piece crossing to a process once; bf16's and float8's bits
as unsigned integers, :func:`carrier`: XLA moves only data, so the values are the
bytes read, and each dtype crosses as its own bytes), batch by batch as the read
places them (:class:`Resharder`).

The batches (:func:`~meshinit._checkpoint.read.staging.batches`) run while the next
batches' shares are fetched, so the reshards overlap the fetches that follow; before
each batch every process agrees that all read their shares
(:func:`meshinit._run.agree.checkpoint`), so a failed fetch on one process makes every
process raise instead of waiting in a collective. One reshard runs at a time.

:func:`enter` and :func:`finish` are looked up on this module as each reshard runs:
the multi-process tests inject their faults there.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import math
import threading
from collections.abc import Collection, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import _caches
from ..._plan.entries import PlanEntry
from ..._run import agree as _agree
from ..._run import compile as _compile
from ..encodings import keys as _keys
from ..layout.host import Gathered, resolved
from . import route as _route
from . import staging as _staging
from .staging import Stage

BYTES_FROM_PEERS = "/meshinit/safetensors/bytes_from_peers"
"""The ``jax.monitoring`` scalar each process records once per load: the bytes of its
distinct blocks (each once, however many of its devices hold it) that the fan-out's
collectives brought from other processes' reads."""

_lock = threading.Lock()  # the cache's: programs are compiled ahead on a worker thread
_reshards = _caches.lru("fan-out reshards", 256, _lock)


def program(entry: PlanEntry, stage: Stage, staged: Any) -> Any:
    """The compiled reshard of ``staged`` (on ``stage.sharding``; an array, or its
    ``ShapeDtypeStruct`` where it is compiled ahead: :meth:`Resharder.prepare`) to the
    entry's planned sharding, the padding cut off: one program per signature, compiled
    before its batch's agreement, so that what can fail on one process alone fails
    before any process enters the batch's collectives. None where this process holds
    none of the entry (it takes no part)."""
    sharding, shape = entry.sharding, entry.spec.shape
    if not any(_staging.process_of(d) == jax.process_index() for d in sharding.device_set):
        return None
    twin = NamedSharding(stage.sharding.mesh, sharding.spec, memory_kind=sharding.memory_kind)
    key = _compile.full_key((stage, twin, shape, str(staged.dtype)))
    with _lock:
        compiled = _reshards.get(key)
    if compiled is None:
        with jax.set_mesh(stage.sharding.mesh):  # type: ignore[arg-type]  # over a user's
            jitted = jax.jit(_cut(stage, shape, twin), out_shardings=twin)
            # as every compile of meshinit's: the platform's options, and kept in
            # jax's persistent compilation cache where one is set (a restart reads it)
            mesh = cast(Mesh, stage.sharding.mesh)  # a staging mesh is made of devices
            compiled = _compile.compile_lowered(jitted.lower(staged), mesh)
        with _lock:
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
    if _route.routes(stage, twin, shape):  # moved axes: each piece crosses once
        return _carried(_route.program(stage, twin, shape))
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


def _carried(move: Any) -> Any:
    """``move`` (a function that moves its argument's values, computing nothing) on the
    bits of bf16 and float8 (:func:`carrier`), behind barriers as in :func:`_cut`."""

    def moved(x: jax.Array) -> jax.Array:
        dtype, bits = x.dtype, carrier(x.dtype)
        if bits is None:
            return move(x)
        x = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(x, bits))
        return jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(move(x)), dtype)

    return moved


def from_peers(entry: PlanEntry, stage: Stage, itemsize: int | None = None) -> int:
    """The bytes of this process's distinct planned blocks of ``entry`` that no device
    of this process read: what must reach it from other processes' reads (a block on
    two of its devices counted once: the process's due, not its devices'; ``itemsize``:
    of the gathered dtype, where it is not the planned one: a dequantized one's stored)."""
    me = jax.process_index()
    itemsize = itemsize or np.dtype(entry.spec.dtype).itemsize
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
        self._then: dict[str, Any] = {}  # a Gathered's finish and entry, by path
        self._ahead: dict[str, tuple[str, concurrent.futures.Future]] = {}  # by path
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._what = what
        self._batch = 0
        self.from_peers = 0

    def prepare(self, jobs: Sequence[Any]) -> None:
        """Starts compiling the staged jobs' reshards on a worker thread, in the read's
        order, so that they compile while the shares are fetched (a small load's
        compiles would otherwise come after its last fetch): those read in their
        planned dtype. Another (a dequantized one's stored bytes, a typed key's data)
        is compiled at its batch."""
        for job in jobs:
            entry, stage = job.entry, job.stage
            if stage is None or job.parts is not None or _keys.is_key(entry.spec.dtype):
                continue
            spec = jax.ShapeDtypeStruct(stage.shape, entry.spec.dtype, sharding=stage.sharding)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, "meshinit-reshards")
            # with this call's options (a context variable) in the worker thread
            future = self._pool.submit(contextvars.copy_context().run, program, entry, stage, spec)
            self._ahead[entry.path] = (str(spec.dtype), future)

    def _program(self, entry: PlanEntry, stage: Stage, staged: jax.Array) -> Any:
        """The reshard of ``staged``: compiled ahead where it was (its compile's error
        raised here, before the batch's agreement), else now."""
        dtype, future = self._ahead.pop(entry.path, ("", None))
        try:
            if future is not None and dtype == str(staged.dtype):
                return future.result()
            return program(entry, stage, staged)
        finally:
            if not self._ahead:  # the last one waited for: the thread goes
                self._stop()

    def _stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def add(self, entry: PlanEntry, stage: Stage | None, made: Any) -> dict[str, Any]:
        """The arrays ready once ``made`` (the entry's array, or its staging array) is:
        none until its batch is whole. Of a
        :class:`~meshinit._checkpoint.layout.host.Gathered`, what its ``then`` gives of
        the gathered array (a callable that finishes it: :mod:`.ahead`)."""
        if stage is None:
            return {entry.path: made}
        if isinstance(made, Gathered):  # resharded as its own entry where it has one
            # (MXFP4's stored bytes), finished into the parameter's
            self._then[entry.path] = (made.then, entry)
            entry, made = made.entry or entry, made.staged
        self._pending.append((entry, stage, made))
        if entry.path not in self._ends:
            return {}
        out: dict[str, Any] = self._flush()
        try:  # after the batch's collectives: each then() only places its arguments
            for path in [p for p in out if p in self._then]:
                then, planned = self._then.pop(path)
                # else: it holds none of it (the parameter's shape, not its bytes')
                out[path] = then(out[path]) if out[path].addressable_shards else absent(planned)
        except BaseException:
            for made in out.values():
                if isinstance(made, jax.Array):
                    made.delete()
            raise
        return out

    def _flush(self) -> dict[str, jax.Array]:
        programs = [self._program(entry, stage, staged) for entry, stage, staged in self._pending]
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
                        self.from_peers += from_peers(entry, stage, staged.dtype.itemsize)
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
        self._then.clear()
        self._ahead.clear()
        self._stop()
