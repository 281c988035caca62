"""Float8 block-scaled weights dequantized on the device, block by block.

A parameter whose stored tensors are float8 weights paired with their block scales
(:mod:`.pairing`) is read by :class:`QuantParts`: each block of it that a device
holds is read from the files as stored (one byte an element), with the rectangle of
each weight's scale that covers the block, and both go to the device, where one
compiled program per signature (the block's shape and geometry, the block size, the
dtypes; the block's offsets in the stored tensor are arguments) computes DeepSeek's
``weight_dequant``: ``planned(float32(w[i, j]) * float32(scale[i // b0, j // b1]))``,
rounded to float32, then to the planned dtype. A block that cuts through a scale
block, or reaches a ragged last block, takes its scales from the same rule.

The geometry of a view (:func:`geometry`): each axis of a leaf's transposed view
moves ``dr`` stored rows or ``dc`` stored columns per step (an axis that does both, a
merge of rows into columns, is refused at plan time). A :class:`Stack` of such leaves
with equal geometry adds axes that move between leaves: every leaf a block reaches is
read at the same index, so one origin serves them all.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .... import _caches
from ...._errors import PlanError, Problem, printable
from ...layout import blocks as _blocks
from ...layout import host as _host
from ...store.header import READABLE
from .. import base as _base
from . import remote_scales as _scales

Axis = tuple[int, int, int]  # per step: leaves, stored rows, stored columns


def geometry(leaf: _blocks.Leaf) -> tuple[tuple[int, int], list[tuple[int, int]]] | str:
    """The stored (row, column) of the view's first element and, per axis of the
    transposed view, the (rows, columns) one step moves; or why the view mixes rows
    and columns in one axis. Worked out on a strided stand-in: no memory is read."""
    rows, cols = leaf.stored.shape
    base = np.zeros(1, np.uint8)
    fake = np.lib.stride_tricks.as_strided(base, (rows, cols), (cols, 1), writeable=False)
    view = fake[leaf.index] if leaf.index else fake
    try:
        shaped = _viewed(view, leaf.shape)  # a view or an error, never a copy
    except (AttributeError, ValueError):
        return "its reshape cannot be followed as a view"
    shaped = shaped.transpose(leaf.order)
    start = shaped.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    origin = (start // cols, start % cols) if cols else (0, 0)
    steps, low, high = [], origin[1], origin[1]
    for n, stride in zip(shaped.shape, shaped.strides, strict=True):
        if n == 1 or cols == 0:
            steps.append((0, 0))
        elif stride % cols == 0:
            steps.append((stride // cols, 0))
        else:
            steps.append((0, stride))
            low, high = low + min(0, (n - 1) * stride), high + max(0, (n - 1) * stride)
    if low < 0 or high >= max(cols, 1):
        return "an axis of its view steps across stored rows and columns at once (a merge)"
    return origin, steps


def _viewed(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return array.reshape(shape, copy=False)  # type: ignore[call-overload,unused-ignore]
    except TypeError:  # numpy < 2.1: setting the shape never copies either
        shaped = array.view()
        shaped.shape = shape
        return shaped


def axes(node: _blocks.Node, sizes: tuple[int, ...]) -> tuple[_blocks.Leaf, list[Axis]]:
    """A leaf of ``node`` (all have its geometry) and each axis of a block of ``sizes``
    as (leaves, rows, columns) per step, leaves counted in :func:`blocks.reached`'s
    order."""
    if isinstance(node, _blocks.Leaf):
        got = geometry(node)
        assert not isinstance(got, str)  # refused at plan time
        return node, [(0, dr, dc) for dr, dc in got[1]]
    assert isinstance(node, _blocks.Joined) and node.stacked  # refused at plan time
    inner = sizes[: node.axis] + sizes[node.axis + 1 :]
    leaf, found = axes(node.parts[0], inner)
    per = math.prod(inner[k] for k, a in enumerate(found) if a[0]) or 1
    found.insert(node.axis, (per, 0, 0))
    return leaf, found


@dataclasses.dataclass
class Raw:
    """A block as the device program takes it: the stored bytes, the per-device
    arguments beside them (the scale rectangles first) and the program's signature."""

    key: tuple[tuple[int, int], ...]  # the block's bounds
    raw: np.ndarray
    args: tuple[np.ndarray, ...]  # the scale rectangles, then what places them
    signature: tuple[Any, ...]
    check: bool  # whether a product may overflow the planned dtype
    overflow: str  # what a product that overflows is refused with (the largest scale read)


Window = tuple[Any, tuple[int, int], tuple[int, int]]
"""A scale tensor (:class:`~.source.Stored`) and the first and last scale row, and
column, that a block reads of it."""


class QuantParts(_host.Parts):
    """:class:`~meshinit._checkpoint.layout.host.Parts` of a dequantized parameter: a block is its
    stored bytes (a :class:`Raw` kept aside), placed on the devices that hold it as
    any block is, and :meth:`whole` runs one program over the whole sharded array of
    bytes (each device dequantizing its own block with its own scales and offsets).

    A scale in a local file is read whole (each is 1/16384 of its weight's elements
    at 128x128); of a remote one (a fetched source), only the rows and columns that
    cover this process's blocks are fetched, ahead, as the weights' bytes are. Staged
    (fan-out), the stored bytes are gathered first (:meth:`whole`): the same bits."""

    stages = True  # fan-out may stage it (read.staging.staged)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._counted = args[2] if len(args) > 2 else kwargs["total"]
        self._scales: dict[str, np.ndarray] = {}
        self._held: dict[tuple[tuple[int, int], ...], Raw] = {}
        self._remote: _scales.Fetched | None = None
        self._unread = False  # whether _block keeps only the scales (the bytes: gathered)
        quants = [leaf.quant for leaf in _blocks.leaves(self.job.node)]
        if any(q.scale.file.fetched for q in quants):
            wanted = [  # of the planned blocks: staged, their scales are read as planned
                w
                for index, _ in _host.holders(self.job.entry).values()
                for w in self.windows(index)
                if w[0].file.fetched
            ]
            self._remote = _scales.Fetched(wanted, self._checked)

    def windows(self, index: tuple[slice, ...]) -> list[Window]:
        """The scale rows and columns the block at ``index`` reads, of each scale."""
        if not math.prod(max(0, s.stop - s.start) for s in index):
            return []
        (r, c), (lo_r, hi_r, lo_c, hi_c), _ = self._span(index)
        out = []
        for leaf, _ in _blocks.reached(self.job.node, index):
            b0, b1 = leaf.quant.block
            out.append((leaf.quant.scale, (lo_r // b0, hi_r // b0), (lo_c // b1, hi_c // b1)))
        return out

    def _scale(self, quant: Any) -> np.ndarray:
        """A scale tensor, read once per parameter, its bytes counted as read: a local
        one whole, a remote one where the blocks read it (zeros elsewhere)."""
        held = quant.scale
        if held.name not in self._scales:
            dtype, count = READABLE[held.dtype], math.prod(held.shape)
            if held.file.fetched:
                assert self._remote is not None
                got, fetched = self._remote.result(held, self.job.entry.path)
                self._counted[0] += fetched
            elif held.nbytes == 0:
                got = np.zeros(held.shape, dtype)
            else:
                base = held.start - held.start % mmap.ALLOCATIONGRANULARITY
                mapped = held.file.mapping(
                    self._checked[held.file].identity, base, held.start + held.nbytes
                )
                flat = np.frombuffer(mapped, dtype, count, held.start - base)
                got = flat.reshape(held.shape).copy()
                del flat
            if not held.file.fetched:
                self._counted[0] += held.nbytes
            self._scales[held.name] = got
        return self._scales[held.name]

    def _raw(self, leaf: _blocks.Leaf, at: tuple[slice, ...]) -> np.ndarray:
        part = self.parts[id(leaf)]
        block = _blocks.at(part.view, at)
        part._read += block.nbytes
        part._total[0] += block.nbytes
        part._tally[0] += block.nbytes
        return block

    def block(self, index: tuple[slice, ...]) -> np.ndarray:
        """The block's stored bytes (placed as they are by
        :func:`~meshinit._checkpoint.layout.host.put`); its
        scales, offsets and signature are kept for :meth:`whole` (staged: its share's bytes)."""
        if self.fetch is not None:
            self.fetch.ready(index)
        if self.job.stage is not None:  # as bytes: XLA's CPU all-gather widens float8
            stored = READABLE[_blocks.leaves(self.job.node)[0].stored.dtype]
            return self._bytes(self.job.node, index, stored).view(np.uint8)
        found = self._block(index)
        self._held[found.key] = found
        return found.raw

    def close(self) -> None:
        super().close()
        if self._remote is not None:
            self._remote.cancel()

    def _bytes(self, node: _blocks.Node, index: tuple[slice, ...], stored: Any) -> np.ndarray:
        """The block's stored bytes; a stand-in that reads nothing where they are gathered."""
        sizes = tuple(max(0, s.stop - s.start) for s in index)
        if self._unread or not math.prod(sizes):
            return np.broadcast_to(np.zeros((), stored), sizes)
        return _blocks.block(node, index, self._raw, stored)

    def _span(
        self, index: tuple[slice, ...]
    ) -> tuple[tuple[int, int], tuple[int, int, int, int], list[Axis]]:
        """The stored (row, column) of the block's first element, the first and last
        stored row and column it reaches, and its axes' steps."""
        sizes = tuple(max(0, s.stop - s.start) for s in index)
        _, at = _blocks.reached(self.job.node, index)[0]
        leaf, steps = axes(self.job.node, sizes)
        found = geometry(leaf)
        assert not isinstance(found, str)
        (r, c), moves = found
        r0 = r + sum(s.start * dr for s, (dr, _) in zip(at, moves, strict=True))
        c0 = c + sum(s.start * dc for s, (_, dc) in zip(at, moves, strict=True))
        bounds = []
        for start, k in ((r0, 1), (c0, 2)):
            lo = start + sum(min(0, (n - 1) * a[k]) for n, a in zip(sizes, steps, strict=True))
            hi = start + sum(max(0, (n - 1) * a[k]) for n, a in zip(sizes, steps, strict=True))
            bounds += [lo, hi]
        return (r0, c0), (bounds[0], bounds[1], bounds[2], bounds[3]), steps

    def _block(self, index: tuple[slice, ...]) -> Raw:
        node, entry = self.job.node, self.job.entry
        sizes = tuple(max(0, s.stop - s.start) for s in index)
        key = tuple((s.start, s.stop) for s in index)
        planned = np.dtype(entry.spec.dtype)
        if not math.prod(sizes):  # an empty block (of an empty parameter): placed as planned
            raw = np.zeros(sizes, planned)
            return Raw(key, raw, (np.zeros((0, 1, 1), np.float32),), (), False, "")
        reached = _blocks.reached(node, index)
        first, _ = reached[0]
        stored = READABLE[first.stored.dtype]
        raw = self._bytes(node, index, stored)
        (r0, c0), (lo_r, hi_r, lo_c, hi_c), steps = self._span(index)
        quant = first.quant
        (b0, b1), (s0, s1) = quant.block, quant.scale.shape
        spans = []
        for lo, hi, b, count in ((lo_r, hi_r, b0, s0), (lo_c, hi_c, b1, s1)):
            held = min(count, (hi - lo) // b + 2)
            spans.append((max(0, min(lo // b, count - held)), held))
        (rb, nr), (cb, nc) = spans
        rects = np.stack([self._scale(p.quant)[rb : rb + nr, cb : cb + nc] for p, _ in reached])
        work = np.dtype(first.tensor.compute_dtype or entry.spec.dtype)
        overflow = applied(reached, self._scale, stored, (work, planned), entry.path)
        shapes = (raw.shape, stored, rects.shape, rects.dtype, tuple(steps), (b0, b1))
        offsets = np.array((r0, c0, rb, cb), np.int32)
        args = (rects, offsets)
        return Raw(key, raw, args, (*shapes, work, planned), bool(overflow), overflow)

    def program(self, signature: tuple[Any, ...], check: bool, sharding: Any) -> Any:
        mesh, spec = sharding.mesh, sharding.spec
        return program(signature, check, mesh, spec, tuple(mesh.axis_names))

    def whole(self, shape: Any, sharding: Any, shards: list[jax.Array]) -> _host.Made:
        """The parameter, dequantized: one program over the array of stored bytes,
        each device with the scales and offsets of its own block. Staged, its bytes to
        gather first (:class:`~meshinit._checkpoint.layout.host.Gathered`)."""
        entry = self.job.entry
        if self.job.stage is None:
            return self._dequantized(shape, sharding, shards)
        staged = jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=np.uint8)
        self._unread = True
        try:
            for index, _ in _host.holders(entry).values():
                found = self._block(index)
                self._held[found.key] = found
        except BaseException:
            staged.delete()
            raise
        finally:
            self._unread = False

        def then(gathered: jax.Array) -> Any:  # its program over the gathered bytes
            shards = [s.data for s in gathered.addressable_shards]
            return self._dequantized(entry.spec.shape, entry.sharding, shards)

        return _host.Gathered(staged, then)

    def _dequantized(self, shape: Any, sharding: Any, shards: list[jax.Array]) -> _host.Made:
        entry = self.job.entry
        planned = np.dtype(entry.spec.dtype)
        if not shards or not math.prod(shape):
            return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=planned)
        blocks = _base.by_device(self._held, entry, None)
        made = list(blocks.values())
        signature = made[0].signature
        assert all(b.signature == signature for b in made)  # one signature: even shards
        raw = jax.make_array_from_single_device_arrays(shape, sharding, shards)
        mesh = sharding.mesh
        n = math.prod(mesh.devices.shape)
        per = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
        args = [
            _base.per_device([(d, b.args[k]) for d, b in blocks.items()], n, per)
            for k in range(len(made[0].args))
        ]
        check = any(b.check for b in made)
        run = self.program(signature, check, sharding)
        self._held.clear()
        path = entry.path

        def finish() -> jax.Array:  # on a worker thread (.ahead): compiles while reading
            got = _base.run(run, mesh, raw, *args)
            if not check:
                return got
            got, fits = got
            failed = [
                blocks[s.device].overflow
                for s in fits.addressable_shards
                if not bool(np.asarray(s.data).all())
            ]
            if failed:
                got.delete()
                raise PlanError(
                    [Problem(path, said) for said in dict.fromkeys(failed)],
                    header="meshinit.safetensors.load: a dequantized value does not fit:",
                )
            return got

        return finish


def read_blocks(leaf: _blocks.Leaf, at: tuple[slice, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The scale rows and columns (block indices, ascending) that the elements of
    ``leaf``'s transposed view at ``at`` take their scales from: only those some
    element reads, not the span between (a view that steps over a block skips it)."""
    got = geometry(leaf)
    assert not isinstance(got, str)  # refused at plan time
    (r, c), moves = got
    rows, cols = np.array([r], np.int64), np.array([c], np.int64)
    for s, (dr, dc) in zip(at, moves, strict=True):
        n = max(0, s.stop - s.start)
        if not n:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        along = s.start + np.arange(n, dtype=np.int64)
        rows = np.add.outer(rows, along * dr).ravel() if dr else rows
        cols = np.add.outer(cols, along * dc).ravel() if dc else cols
    b0, b1 = leaf.quant.block
    return np.unique(rows // b0), np.unique(cols // b1)


DAMAGED = (
    "the file is damaged: download or convert it again (meshinit.safetensors.save "
    "refuses such values too)"
)


def applied(
    parts: Any, scale_of: Any, stored: Any, dtypes: tuple[np.dtype, np.dtype], path: str
) -> str:
    """Checks the block scales that a block reads (``parts``: each weight it reaches
    and the index of its view, ``scale_of(quant)`` the scale tensor's values), only
    those some element of the view reads, so that no sharding refuses what another
    loads. Refuses a scale that is NaN or infinite (every value of its block would be
    NaN or infinite: DeepSeek's ``weight_dequant`` loads IEEE's result, we refuse it
    as a damaged file), and one so small that a product would be a float32 subnormal
    (XLA flushes those to zero, the reference keeps them). Returns, where a stored
    value times a scale may overflow the narrower of ``dtypes`` (the compute and
    planned dtypes), the refusal the program gives should one do (naming the largest
    such scale read), else ""."""
    smallest = 2.0**-126 / float(ml_dtypes.finfo(stored).smallest_subnormal)
    narrow = min(dtypes, key=lambda t: float(ml_dtypes.finfo(t).max))
    limit = float(ml_dtypes.finfo(narrow).max) / float(ml_dtypes.finfo(stored).max)
    problems, top = [], None
    seen: dict[Any, tuple[np.ndarray, np.ndarray]] = {}  # a Stack's leaves: one geometry
    for leaf, at in parts:
        key = (
            leaf.stored.shape, leaf.shape, leaf.order, leaf.quant.block,
            tuple((s.start, s.stop, s.step) for s in (*leaf.index, *at)),
        )  # fmt: skip
        if key not in seen:
            seen[key] = read_blocks(leaf, at)
        rows, cols = seen[key]
        if not rows.size or not cols.size:
            continue
        scale = leaf.quant.scale
        values = np.abs(scale_of(leaf.quant)[np.ix_(rows, cols)].astype(np.float32))
        where = f"of tensor {printable(leaf.stored.name)!r}"
        held = f"in {printable(scale.name)!r} in {scale.file.name}"
        for bad, why in (
            (~np.isfinite(values), f": a scale that is not a finite "
             f"number makes every value of its block NaN or infinite, as DeepSeek's "
             f"weight_dequant would load them; {DAMAGED}"),
            ((values > 0) & (values < smallest), f", below {smallest!r}: products would be "
             f"float32 subnormals, which the device flushes to zero; dequantize this "
             f"checkpoint on the host first"),
        ):  # fmt: skip
            if bad.any():
                i, j = (int(k[0]) for k in np.nonzero(bad))
                value = np.float32(scale_of(leaf.quant)[rows[i], cols[j]])
                more = int(bad.sum()) - 1
                also = f" (and {more} more of the blocks read)" if more else ""
                said = f"block scale ({rows[i]}, {cols[j]}) {where} is {str(value)} {held}"
                problems.append(Problem(path, f"{said}{also}{why}"))
        finite = np.where(np.isfinite(values), values, 0)
        k = np.unravel_index(int(np.argmax(finite)), finite.shape)
        if finite[k] >= limit and (top is None or finite[k] > top[0]):
            top = (float(finite[k]), leaf, scale, (int(rows[k[0]]), int(cols[k[1]])))
    if problems:
        raise PlanError(
            problems, header="meshinit.safetensors.load: a block scale cannot be applied:"
        )
    if top is None:
        return ""
    _, leaf, scale, (r, c) = top
    value = np.float32(scale_of(leaf.quant)[r, c])
    if float(ml_dtypes.finfo(narrow).max) < float(ml_dtypes.finfo(np.float32).max):
        fix = "plan float32" + (" or bfloat16" if narrow == np.float16 else "")
    else:
        fix = (
            "no float is wider than float32: a scale that large is no weight's (a damaged "
            "or misconverted file: download or convert it again), or plan the parameter "
            "as float8 to load the stored values and its scale as a parameter of its own"
        )
    return (
        f"tensor {printable(leaf.stored.name)!r} times its block scales overflows "
        f"{narrow.name}: block scale ({r}, {c}) is {str(value)} in {printable(scale.name)!r}; "
        f"{fix}"
    )


def _spread(
    rects: Any, offsets: Any, sizes: tuple[int, ...], steps: tuple[Axis, ...], block: Any
) -> Any:
    """Each element's scale where the row and the column each move along one axis of
    the block at most: the rectangles, one axis per stacked axis (the leaves are read
    in row-major order of those), gathered as whole slices of rows, then of columns,
    their axes then placed on their axes of the block."""
    stacked = sorted((k for k, a in enumerate(steps) if a[0]), key=lambda k: -steps[k][0])
    scale = rects.reshape(*(sizes[k] for k in stacked), *rects.shape[1:])
    placed = list(stacked)
    for c in (1, 2):
        axis = next((k for k, a in enumerate(steps) if a[c]), None)
        n, step = (1, 0) if axis is None else (sizes[axis], steps[axis][c])
        moved = offsets[c - 1] + jnp.arange(n, dtype=jnp.int32) * step
        index = moved // block[c - 1] - offsets[c + 1]
        scale = jnp.take(scale, index, axis=len(stacked) + c - 1, mode="clip")
        placed.append(len(sizes) + c if axis is None else axis)
    order = sorted(range(len(placed)), key=lambda c: placed[c])
    shape = [1] * len(sizes)
    for c, axis in enumerate(placed):
        if axis < len(sizes):
            shape[axis] = scale.shape[c]
    return scale.transpose(order).reshape(shape)


@_caches.memo(256)
def program(
    signature: tuple[Any, ...], check: bool, mesh: Any, spec: Any, names: tuple[str, ...]
) -> Any:
    """The compiled dequantization of one signature over the mesh: each device's
    block, scales and offsets are arguments, so every parameter of the signature
    (every layer) shares it."""
    sizes: tuple[int, ...]
    steps: tuple[Axis, ...]
    block: tuple[int, int]
    sizes, stored, rect_shape, rect_dtype, steps, block, work, planned = signature
    b0, b1 = block
    P = jax.sharding.PartitionSpec
    # rows and columns each move along one axis at most: gathered as slices
    separable = all(sum(1 for a in steps if a[c]) <= 1 for c in (1, 2))

    def dequantized(raw: Any, rects: Any, offsets: Any) -> Any:
        rects, offsets = rects[0], offsets[0]
        raw = _base.stored_as(raw, stored)
        if separable:
            scale = _spread(rects, offsets, raw.shape, steps, block)
        else:  # an element's scale gathered at its own (leaf, row, column)
            leaf, row, col = jnp.int32(0), offsets[0], offsets[1]
            for k, (dl, dr, dc) in enumerate(steps):
                step = jax.lax.broadcasted_iota(jnp.int32, raw.shape, k)
                leaf, row, col = leaf + step * dl, row + step * dr, col + step * dc
            scale = rects[leaf, row // b0 - offsets[2], col // b1 - offsets[3]]
        scale = scale.astype(jnp.float32)
        wide = raw.astype(jnp.float32) * scale  # rounded once to float32, as the reference
        out = wide.astype(work).astype(planned)  # then to the planned dtype
        if not check:
            return out
        fits = jnp.all(jnp.isfinite(out) | ~jnp.isfinite(raw))  # in work and planned
        return out, fits[None]

    outs = (spec, P(names)) if check else spec
    mapped = jax.shard_map(
        dequantized, mesh=mesh, in_specs=(spec, P(names), P(names)), out_specs=outs,
        check_vma=False,
    )  # fmt: skip
    return jax.jit(mapped)
