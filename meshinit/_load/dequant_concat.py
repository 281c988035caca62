"""Float8 weights dequantized through a Concat, a Pad, a Fill, a Stack permute or a
Stack of parts that differ (:mod:`.dequant` reads a weight, and a Stack of equal ones).

Such a block reaches several stored weights, each over a box of it (a *tile*: its
place in the block, and the index of the weight's view it reads there), and
constants (a pad's padding, a Fill). Each weight's view steps through its stored rows
and columns per axis of the block; where every weight's view steps alike (q, k and v
fused, a layer's parts, stacked layers), an element's stored row and column are its
tile's origin plus the block's position times those steps. So a block goes to the
device as its stored bytes and small tables:

- the tiles' boxes, as the intervals of each axis between the boxes' edges
  (``runs``: the interval of each position) and which tile holds each cell of that
  grid (``cells``);
- per tile, its origin (the stored row and column that the block's first element
  would have in it), the first scale row and column it reads, and that window of its
  weight's scale (``rects``); a constant tile's value;

and one program per signature dequantizes it: ``planned(float32(w) * float32(s))``
with ``s`` the element's tile's scale at (row // b0, column // b1), as
:mod:`.dequant`'s. The sizes of the tables are the largest any block of the
parameter needs (every process works them out alike, from the plan), so every
device runs the same program, and layers of equal shapes share it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _caches
from . import blocks as _blocks
from . import dequant as _dequant
from .header import READABLE
from .reshape import unmerge

Step = tuple[int, int]  # stored rows, stored columns


@dataclasses.dataclass(frozen=True)
class Tile:
    """A box of a block that one weight (or one constant) fills."""

    leaf: _blocks.Leaf | None  # None: a constant
    value: bool | int | float
    at: tuple[slice, ...]  # the index of the leaf's transposed view it reads
    where: tuple[slice, ...]  # its box in the block
    axes: tuple[int, ...]  # the block's axis of each axis of the leaf's view


def _sizes(index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(max(0, s.stop - s.start) for s in index)


def _whole(sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in sizes)


def tiles(node: _blocks.Node, index: tuple[slice, ...]) -> list[Tile]:
    """The tiles of the block at ``index``, a later one over an earlier where they
    overlap (a pad's part over its padding). The dry run of :func:`~.blocks.block`:
    nothing is read."""
    sizes = _sizes(index)
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
        got = _dequant.geometry(leaf)
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


def _first(
    leaf: _blocks.Leaf, at: tuple[slice, ...]
) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """The stored (row, column) of the tile's first element, and the first and last
    stored row and column the tile reaches."""
    got = _dequant.geometry(leaf)
    assert not isinstance(got, str)
    (r, c), moves = got
    row = r + sum(s.start * dr for s, (dr, _) in zip(at, moves, strict=True))
    col = c + sum(s.start * dc for s, (_, dc) in zip(at, moves, strict=True))
    sizes = _sizes(at)
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
        if t.leaf is None or not math.prod(_sizes(t.at)):
            continue
        b0, b1 = t.leaf.quant.block
        _, (lo_r, hi_r, lo_c, hi_c) = _first(t.leaf, t.at)
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


class TileParts(_dequant.QuantParts):
    """:class:`~meshinit._load.dequant.QuantParts` of a parameter whose blocks reach
    weights through a Concat, a Pad, a Fill, a permute or unequal Stack parts."""

    def __init__(self, *args: Any, **kwargs: Any):
        job = args[0] if args else kwargs["job"]
        entry = job.entry
        node, self._merge = unmerged(job.node)
        self._node = node
        self._steps = steps(node)
        assert not isinstance(self._steps, str)  # refused at plan time
        # the tables' sizes: the largest any block of the parameter needs, on any process
        shape = entry.spec.shape
        sizes = [0, 0, 0]  # tiles, scale rows, scale columns
        cells = [0] * len(node.result)
        constants = False
        seen = set()
        boxes = set()
        for index in entry.sharding.devices_indices_map(shape).values():
            index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
            key = tuple((s.start, s.stop) for s in index)
            if key in seen or not math.prod(_sizes(index)):
                continue
            seen.add(key)
            inner = self._inner(index)
            boxes.add(_sizes(inner))
            found = tiles(node, inner)
            _, grid_ = grid(found, _sizes(inner))
            cells = [max(a, b) for a, b in zip(cells, grid_.shape, strict=True)]
            sizes[0] = max(sizes[0], len(found))
            constants = constants or any(t.leaf is None for t in found)
            for _, (r0, r1), (c0, c1) in windows(found):
                sizes[1], sizes[2] = max(sizes[1], r1 - r0 + 1), max(sizes[2], c1 - c0 + 1)
        assert len(boxes) <= 1  # even blocks: unmerged alike
        self._static = (sizes[0], max(1, sizes[1]), max(1, sizes[2]), tuple(cells), constants)
        super().__init__(*args, **kwargs)

    def _inner(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        return index if self._merge is None else self._merge.inner(index)

    def windows(self, index: tuple[slice, ...]) -> list[_dequant.Window]:
        if not math.prod(_sizes(index)):
            return []
        return windows(tiles(self._node, self._inner(index)))

    def _block(self, index: tuple[slice, ...]) -> _dequant.Raw:
        node, entry = self.job.node, self.job.entry
        sizes = _sizes(index)
        key = tuple((s.start, s.stop) for s in index)
        planned = np.dtype(entry.spec.dtype)
        if not math.prod(sizes):  # an empty block (of an empty parameter): placed as planned
            raw = np.zeros(sizes, planned)
            return _dequant.Raw(key, raw, (np.zeros((0, 1, 1), np.float32),), (), False, "")
        inner = self._inner(index)
        found = tiles(self._node, inner)
        leaves = [t.leaf for t in found if t.leaf is not None]
        first = _blocks.leaves(self._node)[0]  # all alike (plan time): a block of constants too
        stored = READABLE[first.stored.dtype]
        raw = _blocks.block(node, index, self._raw, stored)
        count, nr, nc, cells_shape, constants = self._static
        rects = np.zeros((count, nr, nc), np.float32)
        table = np.zeros((count, 4), np.int32)  # origin row, column; first scale row, column
        values = np.zeros(count, planned)
        flags = np.zeros(count, np.bool_)
        for k, t in enumerate(found):
            if t.leaf is None:
                values[k], flags[k] = _blocks.constant(t.value, planned)[0], True
                continue
            if not math.prod(_sizes(t.at)):
                continue
            (row, col), (lo_r, hi_r, lo_c, hi_c) = _first(t.leaf, t.at)
            b0, b1 = t.leaf.quant.block
            rb, cb = lo_r // b0, lo_c // b1
            scale = self._scale(t.leaf.quant)[rb : hi_r // b0 + 1, cb : hi_c // b1 + 1]
            rects[k, : scale.shape[0], : scale.shape[1]] = scale
            # the origin: the stored row and column the block's first element would have
            r0 = row - sum(w.start * s[0] for w, s in zip(t.where, self._steps, strict=True))
            c0 = col - sum(w.start * s[1] for w, s in zip(t.where, self._steps, strict=True))
            table[k] = (r0, c0, rb, cb)
        runs, cells = grid(found, _sizes(inner))
        padded = np.zeros(cells_shape, np.int32)
        padded[tuple(slice(0, n) for n in cells.shape)] = cells
        names = _dequant.named([leaf.stored.name for leaf in leaves or [first]])
        _dequant.tiny(rects, stored, entry.path, names)
        work = np.dtype(first.tensor.compute_dtype or entry.spec.dtype)
        check = _dequant.overflows(rects, stored, work, planned)
        block = first.quant.block
        merge = None if self._merge is None else (_sizes(inner), self._merge.order)
        signature = (raw.shape, merge, stored, self._static, self._steps, block, work, planned)
        args = (rects, table, values, flags, np.concatenate(runs), padded)
        return _dequant.Raw(key, raw, args, signature, check, names)

    def program(self, signature: tuple[Any, ...], check: bool, sharding: Any) -> Any:
        mesh, spec = sharding.mesh, sharding.spec
        return program(signature, check, mesh, spec, tuple(mesh.axis_names))


def _merged(shape: tuple[int, ...], order: tuple[int, ...] | None) -> tuple[int, ...]:
    """A block's shape before its permute."""
    return shape if order is None else tuple(shape[order.index(a)] for a in range(len(shape)))


@_caches.memo(256)
def program(
    signature: tuple[Any, ...], check: bool, mesh: Any, spec: Any, names: tuple[str, ...]
) -> Any:
    """The compiled dequantization of one signature over the mesh; each device's
    block and tables are arguments."""
    shape, merge, stored, static, moves, block, work, planned = signature
    sizes = shape if merge is None else merge[0]  # the tiles' box
    order = None if merge is None else merge[1]
    constants = static[4]
    b0, b1 = block
    P = jax.sharding.PartitionSpec

    def dequantized(
        raw: Any, rects: Any, table: Any, values: Any, flags: Any, runs: Any, cells: Any
    ) -> Any:
        rects, table, values, flags, runs, cells = (
            x[0] for x in (rects, table, values, flags, runs, cells)
        )
        if merge is not None:  # the bytes as the unmerged node's box
            if order is not None:
                raw = raw.transpose(np.argsort(order))
            raw = raw.reshape(sizes)
        index, k = [], 0
        for a, n in enumerate(sizes):
            along = [1] * len(sizes)
            along[a] = n
            index.append(runs[k : k + n].reshape(along))
            k += n
        tile = cells[tuple(index)]  # each element's tile
        at = table[tile]
        row, col = at[..., 0], at[..., 1]
        for a, (dr, dc) in enumerate(moves):
            if dr or dc:
                step = jax.lax.broadcasted_iota(jnp.int32, sizes, a)
                row, col = row + step * dr, col + step * dc
        srow = jnp.clip(row // b0 - at[..., 2], 0, rects.shape[1] - 1)
        scol = jnp.clip(col // b1 - at[..., 3], 0, rects.shape[2] - 1)
        scale = rects[tile, srow, scol]
        wide = raw.astype(jnp.float32) * scale  # rounded once to float32, as the reference
        out = wide.astype(work).astype(planned)  # then to the planned dtype
        if constants:
            out = jnp.where(flags[tile], values[tile], out)
        if merge is not None:  # the values as the parameter's block
            out = out.reshape(_merged(shape, order))
            out = out if order is None else out.transpose(order)
        if not check:
            return out
        fits = jnp.isfinite(wide.astype(work)) | ~jnp.isfinite(raw)
        if constants:
            fits = fits | flags[tile]
        return out, jnp.all(fits)[None]

    outs = (spec, P(names)) if check else spec
    mapped = jax.shard_map(
        dequantized, mesh=mesh, in_specs=(spec, *[P(names)] * 6), out_specs=outs,
        check_vma=False,
    )  # fmt: skip
    return jax.jit(mapped)
