"""Float8 weights dequantized through a Concat, a Pad, a Fill, a permute, a merge
(``out_shape``) of the whole parameter, or a Stack of parts that differ
(:mod:`.decode` reads a weight, and a Stack of equal ones).

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
:mod:`.decode`'s. The sizes of the tables are the largest any block of the
parameter needs (every process works them out alike, from the plan), so every
device runs the same program, and layers of equal shapes share it.

Where every weight tile of every block reads the same scale columns (q, k and v
concatenated along their rows, a Stack of such layers; or the same rows, joined along
the columns) and rows and columns each move along one axis, the scales are gathered
as whole slices (:func:`fast`): rows of the rectangles per tile and position, then
columns of those, as :mod:`.decode` gathers a Stack's. Elsewhere (a pad's corner:
tiles that vary along both axes) each element's scale is gathered on its own, about
6x slower on CPU. A merge is undone first: the tiles are those of the node before
it, and the program reshapes the bytes to that node's box and the values back.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .... import _caches
from ...layout import blocks as _blocks
from ...store.header import READABLE
from .. import base as _base
from . import checks as _checks
from . import decode as _dequant
from . import slices as _slices
from . import tiles as _tiles


def fast(moves: tuple[_tiles.Step, ...], cells: tuple[int, ...], alike: tuple[bool, bool]) -> Any:
    """How the program gathers the scales as slices (see :func:`program`): rows first
    where every weight tile of every block takes the same scale columns (``alike[1]``:
    q, k and v concatenated along their rows), columns first where the rows are alike;
    None (each element's scale gathered on its own) where rows or columns move along
    more than one axis, or the tiles vary along the axis of the second gather."""
    rows = [a for a, m in enumerate(moves) if m[0]]
    cols = [a for a, m in enumerate(moves) if m[1]]
    if len(rows) > 1 or len(cols) > 1:
        return None
    ar = rows[0] if rows else None
    ac = cols[0] if cols else None
    varies: set[int | None] = {a for a, n in enumerate(cells) if n > 1}
    if alike[1] and (ac is None or ac not in varies | {ar}):
        return ("rows", ar, ac)
    if alike[0] and (ar is None or ar not in varies | {ac}):
        return ("columns", ac, ar)
    return None


class TileParts(_dequant.QuantParts):
    """:class:`~meshinit._checkpoint.encodings.fp8.decode.QuantParts` of a parameter whose blocks
    reach
    weights through a Concat, a Pad, a Fill, a permute or unequal Stack parts."""

    def __init__(self, *args: Any, **kwargs: Any):
        job = args[0] if args else kwargs["job"]
        entry = job.entry
        node, self._merge = _tiles.unmerged(job.node)
        self._node = node
        moves = _tiles.steps(node)
        assert not isinstance(moves, str)  # refused at plan time
        self._steps = moves
        # the tables' sizes: the largest any block of the parameter needs, on any process
        shape = entry.spec.shape
        sizes = [0, 0, 0]  # tiles, scale rows, scale columns
        cells = [0] * len(node.result)
        constants = False
        alike = [True, True]  # whether each block's weight tiles share scale rows, columns
        seen = set()
        boxes = set()
        for index in entry.sharding.devices_indices_map(shape).values():
            index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
            key = tuple((s.start, s.stop) for s in index)
            if key in seen or not math.prod(_tiles.extents(index)):
                continue
            seen.add(key)
            inner = self._inner(index)
            boxes.add(_tiles.extents(inner))
            found = _tiles.tiles(node, inner)
            _, grid_ = _tiles.grid(found, _tiles.extents(inner))
            cells = [max(a, b) for a, b in zip(cells, grid_.shape, strict=True)]
            sizes[0] = max(sizes[0], len(found))
            constants = constants or any(t.leaf is None for t in found)
            for _, (r0, r1), (c0, c1) in _tiles.windows(found):
                sizes[1], sizes[2] = max(sizes[1], r1 - r0 + 1), max(sizes[2], c1 - c0 + 1)
            starts = [_tiles.origin(t, self._steps) for t in found if t.leaf is not None]
            for k in (0, 1):
                alike[k] = alike[k] and len({(o[k], o[k + 2]) for o in starts}) <= 1
        assert len(boxes) <= 1  # even blocks: unmerged alike
        how = fast(self._steps, tuple(cells), (alike[0], alike[1]))
        self._static = (
            sizes[0], max(1, sizes[1]), max(1, sizes[2]), tuple(cells), constants, how
        )  # fmt: skip
        super().__init__(*args, **kwargs)

    def _inner(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        return index if self._merge is None else self._merge.inner(index)

    def windows(self, index: tuple[slice, ...]) -> list[_dequant.Window]:
        if not math.prod(_tiles.extents(index)):
            return []
        return _tiles.windows(_tiles.tiles(self._node, self._inner(index)))

    def _block(self, index: tuple[slice, ...]) -> _dequant.Raw:
        node, entry = self.job.node, self.job.entry
        sizes = _tiles.extents(index)
        key = tuple((s.start, s.stop) for s in index)
        planned = np.dtype(entry.spec.dtype)
        if not math.prod(sizes):  # an empty block (of an empty parameter): placed as planned
            raw = np.zeros(sizes, planned)
            return _dequant.Raw(key, raw, (np.zeros((0, 1, 1), np.float32),), (), False, "")
        inner = self._inner(index)
        found = _tiles.tiles(self._node, inner)
        first = _blocks.leaves(self._node)[0]  # all alike (plan time): a block of constants too
        stored = READABLE[first.stored.dtype]
        raw = self._bytes(node, index, stored)
        count, nr, nc, cells_shape, constants, _ = self._static
        rects = np.zeros((count, nr, nc), np.float32)
        # per tile: origin row, column; first scale row, column; last: the first weight's
        table = np.zeros((count + 1, 4), np.int32)
        values = np.zeros(count, planned)
        flags = np.zeros(count, np.bool_)
        for k, t in enumerate(found):
            if t.leaf is None:
                values[k], flags[k] = _blocks.constant(t.value, planned)[0], True
                continue
            if not math.prod(_tiles.extents(t.at)):
                continue
            _, (lo_r, hi_r, lo_c, hi_c) = _tiles.bounds(t.leaf, t.at)
            b0, b1 = t.leaf.quant.block
            scale = self._scale(t.leaf.quant)[
                lo_r // b0 : hi_r // b0 + 1, lo_c // b1 : hi_c // b1 + 1
            ]
            rects[k, : scale.shape[0], : scale.shape[1]] = scale
            table[k] = _tiles.origin(t, self._steps)
        weights = [k for k, t in enumerate(found) if t.leaf is not None]
        if weights:
            table[count] = table[weights[0]]
        runs, cells = _tiles.grid(found, _tiles.extents(inner))
        padded = np.zeros(cells_shape, np.int32)
        padded[tuple(slice(0, n) for n in cells.shape)] = cells
        work = np.dtype(first.tensor.compute_dtype or entry.spec.dtype)
        weights_read = [(t.leaf, t.at) for t in found if t.leaf is not None]
        overflow = _checks.applied(weights_read, self._scale, stored, (work, planned), entry.path)
        block = first.quant.block
        merge = None if self._merge is None else (_tiles.extents(inner), self._merge.order)
        signature = (raw.shape, merge, stored, self._static, self._steps, block, work, planned)
        args = (rects, table, values, flags, np.concatenate(runs), padded)
        return _dequant.Raw(key, raw, args, signature, bool(overflow), overflow)

    def program(
        self, signature: tuple[Any, ...], check: bool, sharding: Any, at: Any = None
    ) -> Any:
        mesh, spec = sharding.mesh, sharding.spec
        return program(signature, check, mesh, spec, tuple(mesh.axis_names), at)


def _merged(shape: tuple[int, ...], order: tuple[int, ...] | None) -> tuple[int, ...]:
    """A block's shape before its permute."""
    return shape if order is None else tuple(shape[order.index(a)] for a in range(len(shape)))


def _sliced(
    rects: Any, table: Any, tile: Any, sizes: tuple[int, ...], moves: Any, block: Any, how: Any
) -> Any:
    """Each element's scale gathered as slices (``how`` from :func:`fast`): per tile
    and position along the first coordinate's axis, whole rows (or columns) of the
    rectangles; then, the second coordinate alike in every tile, whole columns (rows)
    of those, placed on that axis. ``tile`` varies only along the axes it must."""
    mode, first, second = how
    p = 0 if mode == "rows" else 1  # the coordinate gathered first
    q = 1 - p
    held = rects if p == 0 else rects.transpose(0, 2, 1)  # (tiles, p's blocks, q's)
    coord = table[tile, p]
    if first is not None:
        shape = [1] * len(sizes)
        shape[first] = sizes[first]
        coord = coord + jax.lax.broadcasted_iota(jnp.int32, shape, first) * moves[first][p]
    sp = jnp.clip(coord // block[p] - table[tile, p + 2], 0, held.shape[1] - 1)
    got = held.reshape(-1, held.shape[2])[tile * held.shape[1] + sp]  # (..., q's blocks)
    alike = table[-1]  # every weight tile's second coordinate: the first weight's
    if second is None:
        sq = jnp.clip(alike[q] // block[q] - alike[q + 2], 0, held.shape[2] - 1)
        return got[..., sq]
    cq = alike[q] + jnp.arange(sizes[second], dtype=jnp.int32) * moves[second][q]
    sq = jnp.clip(cq // block[q] - alike[q + 2], 0, held.shape[2] - 1)
    got = jnp.take(jnp.squeeze(got, second), sq, axis=-1)  # the tile varies not along it
    return jnp.moveaxis(got, -1, second)


@_caches.memo(256)
def program(
    signature: tuple[Any, ...],
    check: bool,
    mesh: Any,
    spec: Any,
    names: tuple[str, ...],
    at: tuple[int, int] | None = None,
) -> Any:
    """The compiled dequantization of one signature over the mesh; each device's
    block (in ``at``'s slices: each dequantized with its part of the tiles and scales,
    the values joined; under a merge, the stored bytes joined first) and tables are
    arguments. Each element's tile is looked up in the grid of
    intervals (over the axes where tiles vary; others broadcast); its scale is
    gathered as slices where :func:`fast` allows, else element by element."""
    shape, merge, stored, static, moves, block, work, planned = signature
    sizes = shape if merge is None else merge[0]  # the tiles' box
    order = None if merge is None else merge[1]
    cells_shape, constants, how = static[3], static[4], static[5]
    b0, b1 = block
    P = jax.sharding.PartitionSpec

    def dequantized(*args: Any) -> Any:
        rects, table, values, flags, runs, cells = (x[0] for x in args[-6:])
        held, cut = args[:-6], at
        if merge is not None:  # the bytes as the unmerged node's box: slices joined first
            raw = _base.stored_as(_slices.joined(held, at), stored)
            if order is not None:
                raw = raw.transpose(np.argsort(order))
            held, cut = (raw.reshape(sizes),), None
        index, k = [], 0
        for a, n in enumerate(sizes):
            along = [1] * len(sizes)
            if cells_shape[a] > 1 or how is None:  # tiles vary along it
                along[a] = n
                index.append(runs[k : k + n].reshape(along))
            else:
                index.append(jnp.zeros(along, jnp.int32))
            k += n
        tile = cells[tuple(index)]  # each element's tile (size 1 where tiles vary not)
        if how is not None:
            scale = _sliced(rects, table, tile, sizes, moves, block, how)
        else:
            per = table[tile]
            row, col = per[..., 0], per[..., 1]
            for a, (dr, dc) in enumerate(moves):
                if dr or dc:
                    step = jax.lax.broadcasted_iota(jnp.int32, sizes, a)
                    row, col = row + step * dr, col + step * dc
            srow = jnp.clip(row // b0 - per[..., 2], 0, rects.shape[1] - 1)
            scol = jnp.clip(col // b1 - per[..., 3], 0, rects.shape[2] - 1)
            scale = rects[tile, srow, scol]
        outs, fits = [], []
        for k, raw in enumerate(held):  # each slice with its part of the tiles and scales
            raw = _base.stored_as(raw, stored)
            mine = _slices.part(tile, k, cut)
            # rounded once to float32, as the reference; then to the planned dtype
            wide = raw.astype(jnp.float32) * _slices.part(scale, k, cut)
            out = wide.astype(work).astype(planned)
            fit = jnp.isfinite(out) | ~jnp.isfinite(raw)  # in work and planned
            if constants:
                out = jnp.where(flags[mine], values[mine], out)
                fit = fit | flags[mine]
            outs.append(out)
            fits.append(jnp.all(fit))
        out = outs[0] if cut is None else jnp.concatenate(outs, axis=cut[0])
        if merge is not None:  # the values as the parameter's block
            out = out.reshape(_merged(shape, order))
            out = out if order is None else out.transpose(order)
        if not check:
            return out
        return out, jnp.all(jnp.stack(fits))[None]

    outs = (spec, P(names)) if check else spec
    mapped = jax.shard_map(
        dequantized, mesh=mesh, in_specs=(*_slices.specs(spec, at), *[P(names)] * 6),
        out_specs=outs,
        check_vma=False,
    )  # fmt: skip
    return jax.jit(mapped)
