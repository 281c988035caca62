"""The tiles of a block that reaches float8 weights through a Concat, a Pad, a Fill,
a permute or unequal Stack parts (:mod:`.joins` dequantizes it): the box of
the block each weight (or constant) fills and the index of the weight's view it reads
there (:func:`tiles`), the grid of intervals each element's tile is looked up in
(:func:`grid`), the stored rows and columns a step along each axis moves in every
weight (:func:`steps`), each weight tile's origin and scale window, and a merge of the
whole parameter undone (:func:`unmerged`). Index arithmetic on shapes and strides:
nothing here reads a byte.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ...layout import blocks as _blocks
from ...layout.reshape import unmerge
from . import geometry as _geometry

Step = tuple[int, int]  # stored rows, stored columns


@dataclasses.dataclass(frozen=True)
class Tile:
    """A box of a block that one weight (or one constant) fills."""

    leaf: _blocks.Leaf | None  # None: a constant
    value: bool | int | float
    at: tuple[slice, ...]  # the index of the leaf's transposed view it reads
    where: tuple[slice, ...]  # its box in the block
    axes: tuple[int, ...]  # the block's axis of each axis of the leaf's view


def extents(index: tuple[slice, ...]) -> tuple[int, ...]:
    """The sizes of a block at ``index``."""
    return tuple(max(0, s.stop - s.start) for s in index)


def _whole(sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in sizes)


def tiles(node: _blocks.Node, index: tuple[slice, ...]) -> list[Tile]:
    """The tiles of the block at ``index``, a later one over an earlier where they
    overlap (a pad's part over its padding). The dry run of :func:`~.blocks.block`:
    nothing is read."""
    sizes = extents(index)
    if isinstance(node, _blocks.Leaf):
        return [Tile(node, 0, index, _whole(sizes), tuple(range(len(index))))]
    if isinstance(node, _blocks.Const):
        return [Tile(None, node.value, (), _whole(sizes), ())]
    if isinstance(node, _blocks.Padded):
        out = [Tile(None, node.value, (), _whole(sizes), ())]
        inner = []
        for s, n in zip(index, node.part.result, strict=True):
            if min(s.stop, n) <= s.start:
                return out  # wholly in the padding
            inner.append(slice(s.start, min(s.stop, n)))
        return out + tiles(node.part, tuple(inner))  # the part sits at the origin
    assert node.groups is None  # refused at plan time (refusal)
    joined = (
        index
        if node.order is None
        else tuple(index[node.order.index(a)] for a in range(len(index)))
    )
    axis, along = node.axis, joined[node.axis]
    found: list[Tile] = []
    if along.stop > along.start:
        rest = joined[:axis] + joined[axis + 1 :]
        for k, part in enumerate(node.parts):
            if node.stacked:
                if not along.start <= k < along.stop:
                    continue
                at = k - along.start
                for t in tiles(part, rest):
                    where = (*t.where[:axis], slice(at, at + 1), *t.where[axis:])
                    axes = tuple(a + (a >= axis) for a in t.axes)
                    found.append(dataclasses.replace(t, where=where, axes=axes))
                continue
            start = node.starts[k]
            lo, hi = max(along.start, start), min(along.stop, start + part.result[axis])
            if lo >= hi:
                continue
            sub = joined[:axis] + (slice(lo - start, hi - start),) + joined[axis + 1 :]
            for t in tiles(part, sub):
                moved = t.where[axis]
                shift = lo - along.start
                where = (
                    *t.where[:axis],
                    slice(moved.start + shift, moved.stop + shift),
                    *t.where[axis + 1 :],
                )
                found.append(dataclasses.replace(t, where=where))
    if node.order is None:
        return found
    order = node.order
    return [
        dataclasses.replace(
            t,
            where=tuple(t.where[order[i]] for i in range(len(order))),
            axes=tuple(order.index(a) for a in t.axes),
        )
        for t in found
    ]


def _placed(node: _blocks.Node) -> list[tuple[_blocks.Leaf, tuple[int, ...]]]:
    """Each leaf of ``node`` with the result axis of each axis of its view."""
    if isinstance(node, _blocks.Leaf):
        return [(node, tuple(range(len(node.view))))]
    if isinstance(node, _blocks.Const):
        return []
    if isinstance(node, _blocks.Padded):
        return _placed(node.part)
    out = []
    for part in node.parts:
        for leaf, axes in _placed(part):
            if node.stacked:
                axes = tuple(a + (a >= node.axis) for a in axes)
            if node.order is not None:
                axes = tuple(node.order.index(a) for a in axes)
            out.append((leaf, axes))
    return out


def steps(node: _blocks.Node) -> tuple[Step, ...] | str:
    """The stored rows and columns one step along each axis of ``node``'s result moves
    in every weight whose view has that axis (an axis of size 1, or a stacked one, in
    some: any step), or why they step differently (the first such axis)."""
    found: list[tuple[Step, str] | None] = [None] * len(node.result)
    for leaf, axes in _placed(node):
        got = _geometry.geometry(leaf)
        assert not isinstance(got, str)  # refused before
        for n, step, a in zip(leaf.view, got[1], axes, strict=True):
            if n == 1:
                continue
            if found[a] is None:
                found[a] = (step, leaf.stored.name)
            elif found[a][0] != step:  # type: ignore[index]
                other = found[a][1]  # type: ignore[index]
                return (
                    f"along axis {a}, tensor {other!r}'s view steps {found[a][0]} (stored "  # type: ignore[index]
                    f"rows, columns) and {leaf.stored.name!r}'s {step}: its parts' views "
                    f"step through their stored tensors differently"
                )
    return tuple((0, 0) if f is None else f[0] for f in found)


def _interval(edges: np.ndarray, s: slice) -> slice:
    return slice(int(np.searchsorted(edges, s.start)), int(np.searchsorted(edges, s.stop)))


def grid(found: list[Tile], sizes: tuple[int, ...]) -> tuple[list[np.ndarray], np.ndarray]:
    """Each axis's interval of each position, and the tile of each cell of the grid of
    intervals (the later tile where tiles overlap)."""
    edges = []
    for a, n in enumerate(sizes):
        cuts = {0, n} | {t.where[a].start for t in found} | {t.where[a].stop for t in found}
        edges.append(np.array(sorted(c for c in cuts if 0 <= c <= n), np.int64))
    runs = [
        (np.searchsorted(e, np.arange(n), side="right") - 1).astype(np.int32)
        for e, n in zip(edges, sizes, strict=True)
    ]
    cells = np.full(tuple(len(e) - 1 for e in edges), -1, np.int32)
    for k, t in enumerate(found):
        cells[tuple(_interval(e, s) for e, s in zip(edges, t.where, strict=True))] = k
    assert (cells >= 0).all()  # the tiles cover the block
    return runs, cells


def bounds(
    leaf: _blocks.Leaf, at: tuple[slice, ...]
) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """The stored (row, column) of the tile's first element, and the first and last
    stored row and column the tile reaches."""
    got = _geometry.geometry(leaf)
    assert not isinstance(got, str)
    (r, c), moves = got
    row = r + sum(s.start * dr for s, (dr, _) in zip(at, moves, strict=True))
    col = c + sum(s.start * dc for s, (_, dc) in zip(at, moves, strict=True))
    sizes = extents(at)
    bounds = []
    for start, k in ((row, 0), (col, 1)):
        bounds.append(
            start + sum(min(0, (n - 1) * m[k]) for n, m in zip(sizes, moves, strict=True))
        )
        bounds.append(
            start + sum(max(0, (n - 1) * m[k]) for n, m in zip(sizes, moves, strict=True))
        )
    return (row, col), (bounds[0], bounds[1], bounds[2], bounds[3])


def windows(found: list[Tile]) -> list[tuple[Any, tuple[int, int], tuple[int, int]]]:
    """Each weight tile's scale, and the scale rows and columns it reads."""
    out = []
    for t in found:
        if t.leaf is None or not math.prod(extents(t.at)):
            continue
        b0, b1 = t.leaf.quant.block
        _, (lo_r, hi_r, lo_c, hi_c) = bounds(t.leaf, t.at)
        out.append((t.leaf.quant.scale, (lo_r // b0, hi_r // b0), (lo_c // b1, hi_c // b1)))
    return out


@dataclasses.dataclass(frozen=True)
class Merge:
    """A merge (``out_shape``) of the whole parameter's axes, then its permute: the
    tiles are worked out on the node before them, and the program reshapes the
    block's bytes to that node's box before, and its values back after."""

    groups: tuple[int, ...]
    shape: tuple[int, ...]  # the unmerged node's result
    order: tuple[int, ...] | None

    def inner(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        """The box of the unmerged node that a block at ``index`` covers."""
        order = self.order
        merged = index if order is None else tuple(index[order.index(a)] for a in range(len(index)))
        found = unmerge(merged, self.groups, self.shape)
        assert found is not None  # a block that cuts a merged row is refused at plan time
        return found


def unmerged(node: _blocks.Node) -> tuple[_blocks.Node, Merge | None]:
    """``node`` before its own merge (``out_shape``) and the permute after it, and
    that :class:`Merge` (None: it merges nothing)."""
    if isinstance(node, _blocks.Leaf) and node.groups is not None:
        return dataclasses.replace(node, groups=None), Merge(node.groups, node.view, None)
    if isinstance(node, _blocks.Joined) and node.groups is not None:
        inner = dataclasses.replace(node, out_shape=None, groups=None, order=None)
        return inner, Merge(node.groups, node.shape, node.order)
    return node, None


def origin(t: Tile, moves: tuple[Step, ...]) -> tuple[int, int, int, int]:
    """A weight tile's origin (the stored row and column the block's first element
    would have in it, the view stepping by ``moves``) and the first scale row and
    column it reads."""
    assert t.leaf is not None
    (row, col), (lo_r, _, lo_c, _) = bounds(t.leaf, t.at)
    b0, b1 = t.leaf.quant.block
    r0 = row - sum(w.start * s[0] for w, s in zip(t.where, moves, strict=True))
    c0 = col - sum(w.start * s[1] for w, s in zip(t.where, moves, strict=True))
    return r0, c0, lo_r // b0, lo_c // b1
