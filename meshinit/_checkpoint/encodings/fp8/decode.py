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

Where each element's stored row and column are (:mod:`.geometry`), which scales a
block may read (:mod:`.checks`), and how a large block is placed in slices
(:mod:`.slices`) are modules of their own.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .... import _caches
from ...._errors import PlanError, Problem
from ...layout import blocks as _blocks
from ...layout import host as _host
from ...store.header import READABLE
from .. import base as _base
from . import checks as _checks
from . import remote_scales as _scales
from . import slices as _slices
from .geometry import Axis, axes, geometry


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
    cut: tuple[int, int] | None = None  # placed in slices: (axis, how many), else None


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
        self._slices: list[list[jax.Array]] = []  # placed in slices: each slice's arrays
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
        part = self.reading(leaf)
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

    def place(
        self, key: Any, index: tuple[slice, ...], devices: list[Any], memory_kind: str | None
    ) -> list[jax.Array]:
        """The block's stored bytes on ``devices``; a block of more than
        :data:`~.slices.SLICE_BYTES` in slices (:func:`~.slices.cut`), each read and
        placed in turn, the arrays of each slice kept for :meth:`whole`'s program."""
        sizes = tuple(max(0, s.stop - s.start) for s in index)
        stored = READABLE[_blocks.leaves(self.job.node)[0].stored.dtype]
        at = _slices.cut(sizes, stored.itemsize) if self.job.stage is None else None
        if at is None:
            return super().place(key, index, devices, memory_kind)
        if self.fetch is not None:
            self.fetch.ready(index)
        self._unread = True  # the scales and the signature, no bytes yet
        try:
            found = self._block(index)
        finally:
            self._unread = False
        found.cut = at
        self._held[found.key] = found
        if not self._slices:
            self._slices = [[] for _ in range(at[1])]
        made: list[jax.Array] = []
        try:
            for k, piece in enumerate(_slices.pieces(index, at)):
                block = self._bytes(self.job.node, piece, stored)
                got = _host.copies(block, devices, memory_kind)
                del block
                made += got
                self._slices[k] += got
        except BaseException:
            for array in made:
                array.delete()
            raise
        return made

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
        overflow = _checks.applied(reached, self._scale, stored, (work, planned), entry.path)
        shapes = (raw.shape, stored, rects.shape, rects.dtype, tuple(steps), (b0, b1))
        offsets = np.array((r0, c0, rb, cb), np.int32)
        args = (rects, offsets)
        return Raw(key, raw, args, (*shapes, work, planned), bool(overflow), overflow)

    def program(
        self, signature: tuple[Any, ...], check: bool, sharding: Any, at: Any = None
    ) -> Any:
        mesh, spec = sharding.mesh, sharding.spec
        return program(signature, check, mesh, spec, tuple(mesh.axis_names), at)

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
        at = made[0].cut
        assert all((b.signature, b.cut) == (signature, at) for b in made)  # even shards
        if at is None:
            raws = [jax.make_array_from_single_device_arrays(shape, sharding, shards)]
        else:  # each slice of every block, joined in the program
            axis, count = at
            part = (*shape[:axis], shape[axis] // count, *shape[axis + 1 :])
            raws = [
                jax.make_array_from_single_device_arrays(part, sharding, arrays)
                for arrays in self._slices
            ]
            self._slices = []
        mesh = sharding.mesh
        n = math.prod(mesh.devices.shape)
        per = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
        args = [
            _base.per_device([(d, b.args[k]) for d, b in blocks.items()], n, per)
            for k in range(len(made[0].args))
        ]
        check = any(b.check for b in made)
        run = self.program(signature, check, sharding, at)
        self._held.clear()
        path = entry.path

        def finish() -> jax.Array:  # on a worker thread (.ahead): compiles while reading
            got = _base.run(run, mesh, *raws, *args)
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
    signature: tuple[Any, ...],
    check: bool,
    mesh: Any,
    spec: Any,
    names: tuple[str, ...],
    at: tuple[int, int] | None = None,
) -> Any:
    """The compiled dequantization of one signature over the mesh: each device's
    block, scales and offsets are arguments, so every parameter of the signature
    (every layer) shares it. Placed in slices (``at``: the axis and how many), each
    device's block comes as that many arguments, each dequantized with its part of
    the block's scales, and the values joined (the TPU's compiler took 2-4x as long
    over the float8 bytes joined first)."""
    sizes: tuple[int, ...]
    steps: tuple[Axis, ...]
    block: tuple[int, int]
    sizes, stored, rect_shape, rect_dtype, steps, block, work, planned = signature
    b0, b1 = block
    P = jax.sharding.PartitionSpec
    # rows and columns each move along one axis at most: gathered as slices
    separable = all(sum(1 for a in steps if a[c]) <= 1 for c in (1, 2))

    def dequantized(*args: Any) -> Any:
        rects, offsets = args[-2][0], args[-1][0]
        if separable:
            scale = _spread(rects, offsets, sizes, steps, block)
        else:  # an element's scale gathered at its own (leaf, row, column)
            leaf, row, col = jnp.int32(0), offsets[0], offsets[1]
            for k, (dl, dr, dc) in enumerate(steps):
                step = jax.lax.broadcasted_iota(jnp.int32, sizes, k)
                leaf, row, col = leaf + step * dl, row + step * dr, col + step * dc
            scale = rects[leaf, row // b0 - offsets[2], col // b1 - offsets[3]]
        scale = scale.astype(jnp.float32)
        outs, fits = [], []
        for k, raw in enumerate(args[:-2]):
            raw = _base.stored_as(raw, stored)
            # rounded once to float32, as the reference; then to the planned dtype
            wide = raw.astype(jnp.float32) * _slices.part(scale, k, at)
            out = wide.astype(work).astype(planned)
            outs.append(out)
            fits.append(jnp.all(jnp.isfinite(out) | ~jnp.isfinite(raw)))  # in work, planned
        out = outs[0] if at is None else jnp.concatenate(outs, axis=at[0])
        if not check:
            return out
        return out, jnp.all(jnp.stack(fits))[None]

    outs = (spec, P(names)) if check else spec
    specs = (*_slices.specs(spec, at), P(names), P(names))
    mapped = jax.shard_map(dequantized, mesh=mesh, in_specs=specs, out_specs=outs, check_vma=False)
    return jax.jit(mapped)
