"""Remote bytes fetched into place: the ranges the blocks read, ahead of them.

A remote object's part of a parameter is viewed (as a local file's is, by
:class:`meshinit._load.read.Source`) in an anonymous mapping that stands for the
object's span: untouched, it costs no memory. Before a block is read, the byte
ranges its views will read have been fetched into that mapping:
each view's elements, in the stored layout, are runs of contiguous bytes (a row, a
column block of a row), found from the view's strides (:func:`runs`). Runs of this
process's blocks are merged where the gap between them is small next to them (at
most :data:`GAP` and 1/32 of their length, so the bytes fetched stay within a few
percent of those owned), in chunks of at most ``budget`` bytes of blocks. Short runs
far apart (a column block of each row: a transposed weight whose rows' columns are
split between hosts) are joined through gaps of up to :data:`READ_THROUGH` while the
chunk stays within the budget: one request per run would cost a round trip per row.
Nothing outside the span of a chunk's own runs is fetched.

:class:`Pipeline` fetches ahead: a feeder thread prepares each parameter's sources in
the load's order and hands their chunks to :data:`~meshinit._load.remote.CONCURRENCY`
reading threads as long as the bytes fetched and not yet placed stay within the
budget; the caller places one parameter while the next ones arrive. A chunk's pages
are released (``MADV_DONTNEED`` frees an anonymous mapping's pages) once its blocks
are placed, and its bytes returned to the budget.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import mmap
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import PlanError, Problem
from . import layout as _layout
from . import remote as _remote

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

MAX_RUNS = 1 << 16
"""The most runs one view is read in: a view of more (a column of a row-major
tensor, say) is read in fewer, longer runs, through the gaps between its elements."""

PIECE = 8 << 20
"""A long range is read in pieces of at most this, concurrently."""

AHEAD = 8
"""Parameters prepared ahead of the one being placed (their bytes within the budget)."""


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


def merge(spans: Sequence[tuple[int, int]], room: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` spans sorted and joined where they touch, overlap, or leave a
    gap of at most :data:`GAP` and 1/32 of the two spans' length. Where more than
    :data:`MANY` remain, they are joined through gaps of at most :data:`READ_THROUGH`,
    the smallest first, until :data:`MANY` remain or the gaps read through would add
    more than ``room`` bytes."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out:
            last = out[-1]
            gap = start - last[1]
            if gap <= 0 or gap <= min(GAP, (last[1] - last[0] + end - start) // 32):
                last[1] = max(last[1], end)
                continue
        out.append([start, end])
    if len(out) <= MANY or room <= 0:
        return [(a, b) for a, b in out]
    starts, ends = np.array(out, np.int64).T
    gaps = starts[1:] - ends[:-1]
    order = np.argsort(gaps, kind="stable")[: len(out) - MANY]
    order = order[gaps[order] <= READ_THROUGH]
    joined = np.zeros(len(gaps), bool)
    joined[order[np.cumsum(gaps[order]) <= room]] = True
    firsts = starts[np.concatenate([[True], ~joined])]
    lasts = ends[np.concatenate([~joined, [True]])]
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


@dataclasses.dataclass(eq=False)
class Chunk:
    """Blocks of one parameter fetched together: their merged ranges per object."""

    spans: dict[_remote.Remote, list[tuple[int, int]]]
    nbytes: int
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    failed: list[tuple[_remote.Remote, int, int, str]] = dataclasses.field(default_factory=list)
    left: int = 0


class Fetch:
    """The remote ranges of one parameter's blocks, in chunks of at most ``budget``
    bytes (a block larger than that is a chunk of its own)."""

    def __init__(
        self,
        node: _layout.Node,
        dtype: Any,
        blocks: Sequence[tuple[slice, ...]],
        views: Mapping[int, np.ndarray],
        maps: Mapping[_remote.Remote, tuple[mmap.mmap, int]],
        budget: int,
    ):
        self.maps, self.budget = maps, budget
        origin = {obj: np.frombuffer(m, np.uint8).ctypes.data for obj, (m, _) in maps.items()}
        self.chunks: list[Chunk] = []
        self._chunk_of: dict[tuple[Any, ...], Chunk] = {}
        pending: dict[_remote.Remote, list[tuple[int, int]]] = {}
        size = 0
        members: list[tuple[Any, ...]] = []
        for index in blocks:
            reached: list[tuple[_layout.Leaf, Any]] = []
            _layout.block(node, index, functools.partial(_seen, reached), dtype)
            spans: dict[_remote.Remote, list[tuple[int, int]]] = {}
            for leaf, at in reached:
                obj = leaf.stored.file
                if not isinstance(obj, _remote.Remote):
                    continue
                view = views[id(leaf)][at]
                if view.size == 0:
                    continue
                base = maps[obj][1]
                starts, length = runs(view, view.ctypes.data - origin[obj])
                got = spans.setdefault(obj, [])
                got.extend((base + int(s), base + int(s) + length) for s in starts)
            n = sum(b - a for found in spans.values() for a, b in found)
            if members and size + n > budget:
                self._close(pending, members)
                pending, size, members = {}, 0, []
            for obj, found in spans.items():
                pending.setdefault(obj, []).extend(found)
            size += n
            members.append(_key(index))
        if members:
            self._close(pending, members)
        for obj, (mapped, _) in maps.items():
            fetched = sum(b - a for chunk in self.chunks for a, b in chunk.spans.get(obj, ()))
            if 2 * fetched >= len(mapped) and hasattr(mmap, "MADV_HUGEPAGE"):
                # dense: huge pages fault in 512x fewer times as the readers fill them
                # (not where the runs are sparse: a 2 MiB page would hold far more
                # than its runs)
                mapped.madvise(mmap.MADV_HUGEPAGE)
        self._current: Chunk | None = None
        self.release: Callable[[Chunk], None] = lambda chunk: None  # set by the pipeline
        self.labels = {
            obj: f" (tensors {', '.join(sorted(repr(n) for n in names))[:200]})"
            for obj, names in _names(node).items()
        }

    def _close(self, pending: dict[_remote.Remote, list[tuple[int, int]]], members: list) -> None:
        spans = {obj: merge(found) for obj, found in pending.items()}
        owned = sum(b - a for s in spans.values() for a, b in s)
        room = max(self.budget, owned) - owned  # gaps read through stay within the budget
        for obj, found in spans.items():
            spans[obj] = merge(found, room)
            room -= sum(b - a for a, b in spans[obj]) - sum(b - a for a, b in found)
        chunk = Chunk(spans, sum(b - a for s in spans.values() for a, b in s))
        self.chunks.append(chunk)
        for key in members:
            self._chunk_of[key] = chunk

    def ready(self, index: tuple[slice, ...]) -> None:
        """Waits for the remote bytes of the block at ``index`` (its chunk), the
        previous chunk's pages and bytes released first."""
        chunk = self._chunk_of.get(_key(index))
        if chunk is None or chunk is self._current:
            return
        self.finish()
        chunk.done.wait()
        if chunk.failed:
            raise PlanError(
                [
                    Problem(obj.url, f"bytes [{lo}, {hi}){self.labels.get(obj, '')}: {why}")
                    for obj, lo, hi, why in sorted(chunk.failed, key=lambda f: (f[0].url, f[1]))
                ][:10],
                header="meshinit.safetensors.load: a read failed (nothing loaded):",
            )
        self._current = chunk

    def finish(self) -> None:
        """The current chunk's pages and bytes released: its blocks are placed."""
        if self._current is not None:
            for mapped, _ in self.maps.values():
                mapped.madvise(mmap.MADV_DONTNEED)
            self.release(self._current)
            self._current = None


class Pipeline:
    """Each job's sources, made and fetched ahead in the load's order, within a
    budget of bytes fetched and not yet placed; iterate for ``(job, sources)``."""

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
        self._inflight = 0
        self._lock = threading.Condition()
        self._stopped = False
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=AHEAD)
        self._pool = concurrent.futures.ThreadPoolExecutor(_remote.CONCURRENCY, "meshinit-fetch")
        self._feeder = threading.Thread(target=self._feed, name="meshinit-feed", daemon=True)

    def __enter__(self) -> Pipeline:
        self._feeder.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        while True:  # unblock a feeder waiting to hand over a job
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        self._feeder.join()
        self._pool.shutdown(wait=True, cancel_futures=True)

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
                    if not self._reserve(chunk.nbytes):
                        return
                    self._submit(chunk, fetch.maps)
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
            self._inflight -= chunk.nbytes
            self._lock.notify_all()

    def _submit(self, chunk: Chunk, maps: Mapping[_remote.Remote, tuple[mmap.mmap, int]]) -> None:
        pieces = [
            (obj, lo, min(hi, lo + PIECE))
            for obj, spans in chunk.spans.items()
            for a, hi in spans
            for lo in range(a, hi, PIECE)
        ]
        chunk.left = len(pieces)
        if not pieces:
            chunk.done.set()
            return
        for piece in pieces:
            self._pool.submit(self._read, chunk, maps, *piece)

    def _read(self, chunk: Chunk, maps: Any, obj: _remote.Remote, lo: int, hi: int) -> None:
        try:
            if not chunk.failed:
                mapped, base = maps[obj]
                data = _remote.read(obj, lo, hi)
                # numpy copies without the GIL: the readers copy (and fault in) together
                np.frombuffer(mapped, np.uint8)[lo - base : hi - base] = np.frombuffer(
                    data, np.uint8
                )
                with self._lock:
                    self._total[0] += hi - lo
                self._progress(hi - lo)
        except _remote.Permanent as e:
            chunk.failed.append((obj, lo, hi, str(e)))
        except BaseException as e:  # noqa: BLE001 - named to the caller, never lost
            chunk.failed.append((obj, lo, hi, f"{type(e).__name__}: {e}"))
        finally:
            with self._lock:
                chunk.left -= 1
                if chunk.left == 0:
                    chunk.done.set()


def _seen(reached: list[tuple[_layout.Leaf, Any]], leaf: _layout.Leaf, at: Any) -> None:
    reached.append((leaf, at))  # and None: a dry run of the block


def _key(index: tuple[slice, ...]) -> tuple[Any, ...]:
    return tuple((s.start, s.stop) for s in index)


def _names(node: _layout.Node) -> dict[Any, set[str]]:
    out: dict[Any, set[str]] = {}
    for leaf in _layout.leaves(node):
        out.setdefault(leaf.stored.file, set()).add(leaf.stored.name)
    return out
