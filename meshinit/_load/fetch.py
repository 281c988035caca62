"""A parameter's remote bytes fetched into place: exactly the ranges its blocks read.

A remote object's part of a parameter is viewed (as a local file's is, by
:class:`meshinit._load.read.Source`) in an anonymous mapping that stands for the
object's span: untouched, it costs no memory. Before a block is read, :class:`Fetch`
has fetched into that mapping the byte ranges the block's views will read, and
nothing else: each view's elements, in the stored layout, are runs of contiguous
bytes (a row, a column block of a row), found from the view's strides. Runs of this
process's blocks are merged where the gap between them is small next to them (at
most :data:`GAP` and 1/32 of their length, so the bytes fetched stay within a few
percent of those owned), and fetched concurrently, at most ``budget`` bytes of
blocks at a time: a chunk's pages are released (``MADV_DONTNEED`` on an anonymous
mapping frees them) before the next chunk is fetched.
"""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import layout as _layout
from . import remote as _remote

GAP = 64 << 10
"""The largest gap between two runs that one request reads through."""

MAX_RUNS = 1 << 16
"""The most runs one view is read in: a view of more (a column of a row-major
tensor, say) is read in fewer, longer runs, through the gaps between its elements."""


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


def merge(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` spans sorted and joined where they touch, overlap, or leave a
    gap of at most :data:`GAP` and 1/32 of the two spans' length."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out:
            last = out[-1]
            gap = start - last[1]
            if gap <= 0 or gap <= min(GAP, (last[1] - last[0] + end - start) // 32):
                last[1] = max(last[1], end)
                continue
        out.append([start, end])
    return [(a, b) for a, b in out]


class Fetch:
    """The remote ranges of one parameter's blocks, fetched a chunk at a time."""

    def __init__(
        self,
        node: _layout.Node,
        dtype: Any,
        blocks: Sequence[tuple[slice, ...]],
        views: Mapping[int, np.ndarray],
        maps: Mapping[_remote.Remote, tuple[mmap.mmap, int]],
        budget: int,
        total: list[int],
    ):
        self._maps, self._total = maps, total
        origin = {obj: np.frombuffer(m, np.uint8).ctypes.data for obj, (m, _) in maps.items()}
        self._chunks: list[dict[_remote.Remote, list[tuple[int, int]]]] = []
        self._chunk_of: dict[tuple[Any, ...], int] = {}
        pending: dict[_remote.Remote, list[tuple[int, int]]] = {}
        size = 0
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
            if pending and size + n > budget:
                self._close(pending)
                pending, size = {}, 0
            for obj, found in spans.items():
                pending.setdefault(obj, []).extend(found)
            size += n
            self._chunk_of[_key(index)] = len(self._chunks)
        self._close(pending)
        self._current: int | None = None
        self._labels = {
            obj: f" (tensors {', '.join(sorted(repr(n) for n in names))[:200]})"
            for obj, names in _names(node).items()
        }

    def _close(self, pending: dict[_remote.Remote, list[tuple[int, int]]]) -> None:
        self._chunks.append({obj: merge(found) for obj, found in pending.items()})

    def ready(self, index: tuple[slice, ...]) -> None:
        """The remote bytes of the block at ``index`` fetched: its chunk's, the
        previous chunk's pages released first."""
        chunk = self._chunk_of.get(_key(index))
        if chunk is None or chunk == self._current:
            return
        if self._current is not None:
            for mapped, _ in self._maps.values():
                mapped.madvise(mmap.MADV_DONTNEED)
        ranges = [
            (obj, a, b, a - self._maps[obj][1])
            for obj, spans in self._chunks[chunk].items()
            for a, b in spans
        ]
        into = {obj: mapped for obj, (mapped, _) in self._maps.items()}
        self._total[0] += _remote.fetch(ranges, into, self._labels)
        self._current = chunk


def _seen(reached: list[tuple[_layout.Leaf, Any]], leaf: _layout.Leaf, at: Any) -> None:
    reached.append((leaf, at))  # and None: a dry run of the block


def _key(index: tuple[slice, ...]) -> tuple[Any, ...]:
    return tuple((s.start, s.stop) for s in index)


def _names(node: _layout.Node) -> dict[Any, set[str]]:
    out: dict[Any, set[str]] = {}
    for leaf in _layout.leaves(node):
        out.setdefault(leaf.stored.file, set()).add(leaf.stored.name)
    return out
