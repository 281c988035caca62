"""Remote bytes fetched into place: the ranges the blocks read, ahead of them, and
released only once the devices hold what was placed from them.

A fetched source's part of a parameter (a remote object's) is viewed (as a local
file's is, by :class:`meshinit._checkpoint.layout.host.Part`) in an anonymous mapping that stands
for
the
object's span: untouched, it costs no memory. Before a block is read, the byte
ranges its views will read have been fetched into that mapping: each view's
elements, in the stored layout, are runs of contiguous bytes (a row, a column block
of a row), found from the view's strides (:func:`runs`).

Blocks are placed in the order of the first byte each reads (blocks that share
pages side by side), and fetched in chunks in that order. A chunk holds the
mapping's pages its runs touch (its footprint, what it costs in memory), at most
``budget`` bytes of them, except that a block most of whose pages the chunk already
holds always joins it: column blocks of a row-major tensor each touch every page of
it, and together their runs merge into whole rows (a block larger than the budget
is a chunk of its own). A chunk's runs are merged where the gap between them is
small next to them (at most :data:`GAP` and 1/32 of their length); short runs far
apart (a host's column block of each row of a transposed weight) are joined
through gaps of up to :data:`READ_THROUGH` while the chunk stays within the
budget: one request per run would cost a round trip per row. Nothing outside the
span of a chunk's own runs is fetched.

:class:`Pipeline` fetches ahead: a feeder thread prepares each parameter's sources
in the load's order and starts their chunks' reads on :mod:`.aio`'s loop
(:data:`~meshinit._checkpoint.store.remote.CONCURRENCY` requests at once, each within the
deadline) as long as the footprints fetched and not yet released stay within the
budget; the caller places one parameter while the next ones arrive. A chunk's pages
are released (``MADV_DONTNEED`` frees an anonymous mapping's pages) once every block
read from it has been placed and every array made from them is ready (a device may
still be copying from the host after ``device_put`` returns), and only the pages no
later chunk of the parameter touches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..._errors import PlanError, Problem
from . import aio as _aio
from . import remote as _remote
from .source import Source

GAP = 64 << 10
"""The largest gap between two runs that one request always reads through (where it is
at most 1/32 of the runs' length)."""

READ_THROUGH = 1 << 20
"""The largest gap that a request reads through where runs are many and far apart: an
object store answers a request in tens of milliseconds, in which one stream reads
about this much (``object_store``, obstore's engine, coalesces ranges 1 MiB apart in
its ``get_ranges``). Row by row, the column block a host owns of each stored row (a
few hundred bytes to a few KiB) would be a request each: a load bound by the store's
latency, not its bandwidth."""

MANY = 4 * _remote.CONCURRENCY
"""Spans of one chunk that are read as they are, byte for byte: four rounds of
concurrent requests. Past this, round trips cost more than bytes, and the smallest
gaps are read through (:data:`READ_THROUGH`) until this many are left. (One round,
``CONCURRENCY``, was faster still on a column-split benchmark, 0.35 s against 0.58 s,
but reads through the gaps of small, coarsely split parameters too: bytes a cloud
bills as egress, for a round trip or two.)"""

MAX_RUNS = 1 << 22
"""The most runs one view is read in (32 MiB of offsets): a view of more is read in
fewer, longer runs, through the gaps between its elements."""

PIECE = 8 << 20
"""A long range is read in pieces of at most this, concurrently."""

AHEAD = 8
"""Parameters prepared ahead of the one being placed (their bytes within the budget)."""

COPIERS = min(8, os.cpu_count() or 1)
"""Threads that copy fetched bytes into place (numpy copies without the GIL)."""

PAGE = mmap.PAGESIZE


def runs(view: np.ndarray, offset: int) -> tuple[np.ndarray, int]:
    """The starts (from the mapping's start; ``offset`` is the view's first byte) and
    the common length of the contiguous byte runs that hold ``view``'s elements."""
    itemsize = view.itemsize
    dims = sorted((st, n) for st, n in zip(view.strides, view.shape, strict=True) if n > 1)
    length, k = itemsize, 0
    while k < len(dims) and dims[k][0] == length:  # the innermost dims run on in memory
        length *= dims[k][1]
        k += 1
    outer = dims[k:]
    while outer and math.prod(n for _, n in outer) > MAX_RUNS:  # read through the gaps
        stride, n = outer.pop(0)
        length += (n - 1) * stride
    starts = np.array([offset], np.int64)
    for stride, n in outer:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    return np.sort(starts), length


def _merge(starts: np.ndarray, ends: np.ndarray, room: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`merge` on arrays of starts and ends (any order), as sorted arrays."""
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    if len(s) < 2:
        return s, e
    reach = np.maximum.accumulate(e)
    gaps = s[1:] - reach[:-1]
    lengths = e - s
    small = np.minimum(GAP, (lengths[:-1] + lengths[1:]) // 32)
    first = np.concatenate([[True], ~((gaps <= 0) | (gaps <= small))])
    heads = np.flatnonzero(first)
    s, e = s[heads], reach[np.concatenate([heads[1:] - 1, [len(reach) - 1]])]
    if len(s) <= MANY or room <= 0:
        return s, e
    gaps = s[1:] - e[:-1]
    order = np.argsort(gaps, kind="stable")[: len(s) - MANY]
    order = order[gaps[order] <= READ_THROUGH]
    joined = np.zeros(len(gaps), bool)
    joined[order[np.cumsum(gaps[order]) <= room]] = True
    return s[np.concatenate([[True], ~joined])], e[np.concatenate([~joined, [True]])]


def merge(spans: Sequence[tuple[int, int]], room: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` spans sorted and joined where they touch, overlap, or leave a
    gap of at most :data:`GAP` and 1/32 of the two runs' length. Where more than
    :data:`MANY` remain, they are joined through gaps of at most :data:`READ_THROUGH`,
    the smallest first, until :data:`MANY` remain or the gaps read through would add
    more than ``room`` bytes."""
    if not spans:
        return []
    both = np.array(spans, np.int64).reshape(-1, 2)
    s, e = _merge(both[:, 0], both[:, 1], room)
    return list(zip(s.tolist(), e.tolist(), strict=True))


def _pages(starts: np.ndarray, ends: np.ndarray, n: int) -> np.ndarray:
    """Which of a mapping's ``n`` pages the spans touch."""
    if not len(starts):
        return np.zeros(n, bool)
    count = np.bincount(starts // PAGE, minlength=n + 1)
    count -= np.bincount((ends - 1) // PAGE + 1, minlength=n + 1)
    return np.cumsum(count[:n]) > 0


Spans = tuple[np.ndarray, np.ndarray]  # starts and ends, from the mapping's start


@dataclasses.dataclass(eq=False)
class Chunk:
    """Blocks of one parameter fetched together: their merged ranges per object."""

    spans: dict[Source, Spans]
    nbytes: int  # fetched
    footprint: int  # bytes of the pages it holds
    blocks: int  # blocks read from it, to be placed
    free: dict[Source, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    failed: list[tuple[Source, int, int, str]] = dataclasses.field(default_factory=list)
    placed: list[Any] = dataclasses.field(default_factory=list)  # arrays made from it

    def fetched(self, obj: Source) -> int:
        if obj not in self.spans:
            return 0
        starts, ends = self.spans[obj]
        return int((ends - starts).sum())


class Fetch:
    """The remote ranges of one parameter's blocks, in chunks of at most ``budget``
    bytes of pages (see the module's docstring)."""

    def __init__(
        self,
        reads: Sequence[tuple[tuple[slice, ...], Sequence[tuple[Source, np.ndarray]]]],
        names: Mapping[Source, set[str]],
        maps: Mapping[Source, tuple[mmap.mmap, int]],
        budget: int,
    ):
        """``reads``: each block's index and the views of fetched sources it reads
        (:meth:`meshinit._checkpoint.layout.host.Parts` finds them from the parameter's
        layout); ``names``: each source's tensors, for messages; ``maps``: each
        source's anonymous mapping and the offset in the source it starts at."""
        self.maps, self.budget = maps, budget
        origin = {obj: np.frombuffer(m, np.uint8).ctypes.data for obj, (m, _) in maps.items()}
        npages = {obj: -(-len(m) // PAGE) for obj, (m, _) in maps.items()}
        self.chunks: list[Chunk] = []
        self._chunk_of: dict[tuple[Any, ...], Chunk] = {}
        rank = {obj: k for k, obj in enumerate(maps)}
        found_of: list[tuple[tuple[int, int], tuple[Any, ...], dict[Source, list[Spans]]]] = []
        for index, views in reads:
            spans: dict[Source, list[Spans]] = {}
            for obj, view in views:
                starts, length = runs(view, view.ctypes.data - origin[obj])
                spans.setdefault(obj, []).append((starts, starts + length))
            first = min(
                ((rank[o], int(_cat(f)[0].min())) for o, f in spans.items()), default=(-1, 0)
            )
            found_of.append((first, block_key(index), spans))
        # Placed in the order of the first byte each block reads (stable: as the devices
        # come where blocks start alike): blocks that share pages are then neighbours
        # (a transposed weight's blocks of the same stored rows, which the devices
        # interleave with others), fetched in one chunk, once. In the devices' order a
        # small budget closed a chunk between them, and each chunk read its rows
        # through the other's columns: 1.8x the bytes.
        found_of.sort(key=lambda f: f[0])
        self.order = [key for _, key, _ in found_of]
        held: dict[Source, np.ndarray] = {}  # the open chunk's pages
        pending: dict[Source, list[Spans]] = {}
        size, members = 0, list[tuple[Any, ...]]()
        for _, key, spans in found_of:
            touched = {obj: _pages(*_cat(found), npages[obj]) for obj, found in spans.items()}
            own = sum(int(p.sum()) for p in touched.values())
            shared = sum(int((p & held[o]).sum()) for o, p in touched.items() if o in held)
            grows = own - shared
            # a block most of whose pages the chunk holds joins it (its runs interleave
            # with the chunk's: together they merge into few spans, apart each chunk
            # holds the same pages); a block of other pages joins within the budget
            if members and 2 * shared <= own and (size + grows) * PAGE > budget:
                self._close(pending, members, npages)
                held, pending, size, members = {}, {}, 0, []
                grows = sum(int(p.sum()) for p in touched.values())
            for obj, found in spans.items():
                pending.setdefault(obj, []).extend(found)
                held[obj] = held[obj] | touched[obj] if obj in held else touched[obj]
            size += grows
            members.append(key)
        if members:
            self._close(pending, members, npages)
        self._plan_release(npages)
        for obj, (mapped, _) in maps.items():
            fetched = sum(c.fetched(obj) for c in self.chunks)
            if 2 * fetched >= len(mapped) and hasattr(mmap, "MADV_HUGEPAGE"):
                # dense: huge pages fault in 512x fewer times as the copies fill them
                # (not where the runs are sparse: a 2 MiB page would hold far more
                # than its runs)
                mapped.madvise(mmap.MADV_HUGEPAGE)
        self.release: Callable[[Chunk], None] = lambda chunk: None  # set by the pipeline
        self.labels = {
            obj: f" (tensors {', '.join(sorted(repr(n) for n in names))[:200]})"
            for obj, names in names.items()
        }

    def _close(
        self,
        pending: dict[Source, list[Spans]],
        members: list[tuple[Any, ...]],
        npages: Mapping[Source, int],
    ) -> None:
        spans = {obj: _merge(*_cat(found), 0) for obj, found in pending.items()}
        owned = sum(int((e - s).sum()) for s, e in spans.values())
        held = sum(int(_pages(*found, npages[obj]).sum()) for obj, found in spans.items()) * PAGE
        # gaps read through stay within the pages the chunk holds anyway, or the budget
        room = max(self.budget, held) - owned
        for obj, (s, e) in spans.items():
            merged = spans[obj] = _merge(s, e, room)
            room -= int((merged[1] - merged[0]).sum()) - int((e - s).sum())
        nbytes = sum(int((e - s).sum()) for s, e in spans.values())
        pages = sum(int(_pages(*found, npages[obj]).sum()) for obj, found in spans.items())
        chunk = Chunk(spans, nbytes, pages * PAGE, len(members))
        self.chunks.append(chunk)
        for key in members:
            self._chunk_of[key] = chunk

    def _plan_release(self, npages: Mapping[Source, int]) -> None:
        """Each chunk's pages that no later chunk touches: released once it is placed."""
        for obj, n in npages.items():
            last = np.full(n, -1, np.int32)
            for k, chunk in enumerate(self.chunks):
                if obj in chunk.spans:
                    last[_pages(*chunk.spans[obj], n)] = k
            size = len(self.maps[obj][0])
            for chunk in self.chunks:
                chunk.free[obj] = []
            cuts = np.flatnonzero(np.diff(last)) + 1  # runs of pages of one last chunk
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
                if last[a] >= 0:
                    end = min(b * PAGE, size)
                    self.chunks[last[a]].free[obj].append((a * PAGE, end - a * PAGE))

    def ready(self, index: tuple[slice, ...]) -> None:
        """Waits for the remote bytes of the block at ``index`` (its chunk's)."""
        chunk = self._chunk_of[block_key(index)]
        chunk.done.wait()
        if chunk.failed:
            raise PlanError(
                [
                    Problem(str(obj), f"bytes [{lo}, {hi}){self.labels.get(obj, '')}: {why}")
                    for obj, lo, hi, why in sorted(chunk.failed, key=lambda f: (str(f[0]), f[1]))
                ][:10],
                header="meshinit.safetensors.load: a read failed (nothing loaded):",
            )

    def placed(self, index: tuple[slice, ...], arrays: Sequence[Any]) -> None:
        """The block at ``index`` is placed as ``arrays``: once every block of its
        chunk is, and every array made from them is ready (the devices hold their
        bytes), the chunk's own pages are released and its bytes returned."""
        chunk = self._chunk_of[block_key(index)]
        chunk.placed.extend(arrays)
        chunk.blocks -= 1
        if chunk.blocks == 0:
            jax.block_until_ready(chunk.placed)
            chunk.placed.clear()
            for obj, ranges in chunk.free.items():
                mapped = self.maps[obj][0]
                for start, length in ranges:
                    mapped.madvise(mmap.MADV_DONTNEED, start, length)
            self.release(chunk)


class Pipeline:
    """Each job's sources, made and fetched ahead in the load's order, within a
    budget of bytes of pages fetched and not yet released; iterate for
    ``(job, sources)``."""

    def __init__(
        self,
        jobs: Sequence[Any],
        make: Callable[[Any], Any],
        budget: int,
        total: list[int],
        progress: Callable[[int], None] = lambda n: None,
    ):
        self._jobs, self._make, self._budget, self._total = jobs, make, budget, total
        self._progress = progress
        self._deadline = _aio.deadline()  # this thread's: the feeder's context has none
        self._inflight = 0
        self._lock = threading.Condition()
        self._stopped = False
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=AHEAD)
        self._requests = asyncio.Semaphore(_remote.CONCURRENCY)
        self._started: set[concurrent.futures.Future[None]] = set()
        self._copier = concurrent.futures.ThreadPoolExecutor(COPIERS, "meshinit-copy")
        self._feeder = threading.Thread(target=self._feed, name="meshinit-feed", daemon=True)

    def __enter__(self) -> Pipeline:
        self._feeder.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        """Stops everything at once: the feeder, and every read in flight (cancelled,
        its connection closed), whatever made the load stop."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
            started = list(self._started)
        for future in started:
            future.cancel()
        while True:  # unblock a feeder waiting to hand over a job
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        self._feeder.join()
        concurrent.futures.wait(started, timeout=5)
        self._copier.shutdown(wait=True, cancel_futures=True)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for _ in self._jobs:
            got = self._ready.get()
            if isinstance(got, BaseException):
                raise got
            yield got

    def _feed(self) -> None:
        try:
            for job in self._jobs:
                sources = self._make(job)
                fetch = getattr(sources, "fetch", None)
                if fetch is not None:
                    fetch.release = self._release
                if not self._put((job, sources)):
                    return
                if fetch is None:
                    continue
                for chunk in fetch.chunks:
                    if not self._reserve(chunk.footprint):
                        return
                    self._start(chunk, fetch.maps)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
            self._put(e)

    def _put(self, item: Any) -> bool:
        while True:
            with self._lock:
                if self._stopped:
                    return False
            try:
                self._ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue

    def _reserve(self, nbytes: int) -> bool:
        """Waits until ``nbytes`` more fit the budget (or nothing is in flight)."""
        with self._lock:
            while not self._stopped and self._inflight and self._inflight + nbytes > self._budget:
                self._lock.wait()
            self._inflight += nbytes
            return not self._stopped

    def _release(self, chunk: Chunk) -> None:
        with self._lock:
            self._inflight -= chunk.footprint
            self._lock.notify_all()

    def _start(self, chunk: Chunk, maps: Mapping[Source, tuple[mmap.mmap, int]]) -> None:
        pieces = [
            (obj, lo, min(hi, lo + PIECE))
            for obj, (starts, ends) in chunk.spans.items()
            for a, hi in zip(starts.tolist(), ends.tolist(), strict=True)
            for lo in range(a, hi, PIECE)
        ]
        if not pieces:
            chunk.done.set()
            return
        with self._lock:
            if self._stopped:
                return
            future = _aio.submit(self._chunk(chunk, maps, pieces))
            self._started.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._started.discard(future)

    async def _chunk(self, chunk: Chunk, maps: Any, pieces: list[Any]) -> None:
        try:
            await asyncio.gather(*(self._piece(chunk, maps, *piece) for piece in pieces))
        except BaseException:  # cancelled: never a chunk that looks whole
            obj, lo, hi = pieces[0]
            base = maps[obj][1]
            chunk.failed.append((obj, base + lo, base + hi, "its read was cancelled"))
            raise
        finally:
            chunk.done.set()

    async def _piece(self, chunk: Chunk, maps: Any, obj: Source, lo: int, hi: int) -> None:
        mapped, base = maps[obj]
        async with self._requests:
            if chunk.failed:
                return
            try:
                fetched = obj.fetch(base + lo, base + hi)
                data = await _aio.bounded(fetched, self._deadline)
            except (_remote.Permanent, _aio.TimedOut) as e:
                chunk.failed.append((obj, base + lo, base + hi, str(e)))
                return
            except Exception as e:  # noqa: BLE001 - named to the caller, never lost
                chunk.failed.append((obj, base + lo, base + hi, f"{type(e).__name__}: {e}"))
                return
        # numpy copies without the GIL: the copiers copy (and fault in) together
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._copier, _copy, mapped, lo, data)
        with self._lock:
            self._total[0] += hi - lo
        self._progress(hi - lo)


def _copy(mapped: mmap.mmap, at: int, data: Any) -> None:
    source = np.frombuffer(data, np.uint8)
    np.frombuffer(mapped, np.uint8)[at : at + len(source)] = source


def _cat(found: list[Spans]) -> Spans:
    if len(found) == 1:
        return found[0]
    return np.concatenate([s for s, _ in found]), np.concatenate([e for _, e in found])


def block_key(index: tuple[slice, ...]) -> tuple[Any, ...]:
    return tuple((s.start, s.stop) for s in index)
