"""The host side of a parameter's read: its stored tensors viewed in their sources'
mappings (:class:`Part`, :class:`Parts`), the distinct blocks this process's devices
hold (:func:`holders`), each read once and placed on its devices in memory of its own
(:func:`array`, :func:`put`).

An encoding that reads its stored bytes otherwise (a dequantized parameter's) gives its
own ``Parts`` (:mod:`meshinit._checkpoint.encodings`); the read flow
(:mod:`meshinit._checkpoint.read.loop`) drives them all alike.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import mmap
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ..._plan.plan import PlanEntry
from ..store import fetch as _fetch
from ..store import listing as _file
from ..store.header import READABLE
from ..store.source import Source
from . import blocks as _blocks
from .values import cast, offset, scaled


@dataclasses.dataclass(frozen=True)
class Job:
    """One plan path's read: its parts, resolved against the checked files, and where
    other processes hold its blocks too, the staging it is read onto (fan-out)."""

    entry: PlanEntry
    node: _blocks.Node
    stage: Any = None  # fan-out's Stage (meshinit._checkpoint.read.staging), or None
    parts: Any = None  # the Parts class that reads it (None: Parts; dequantized: .dequant)


@dataclasses.dataclass(frozen=True)
class Gathered:
    """A staged parameter's stored bytes on its staging sharding (fan-out), and what
    finishes it once the reshard has gathered them onto the planned sharding: ``then``
    of that array (a dequantized parameter's program over its stored bytes). ``entry``:
    the gathered array's own, where it is not the parameter's (MXFP4's stored bytes,
    an array of another shape: :mod:`meshinit._checkpoint.encodings.mxfp4.packed`)."""

    staged: jax.Array
    then: Callable[[jax.Array], jax.Array | Callable[[], jax.Array]]
    entry: PlanEntry | None = None


Made = jax.Array | Callable[[], jax.Array] | Gathered
"""A parameter's array, a callable that finishes it, or its stored bytes to gather
first (:meth:`Parts.whole`)."""

RELEASE_BYTES = 64 << 20

OPEN_FILES = 16
"""Local files one parameter keeps mapped at once (each mapping holds a descriptor):
a parameter stacked from more files maps them in turn, as its blocks reach them."""


class Part:
    """A stored tensor viewed as a part of the parameter, in its file's mapping: the
    slice, the reshape and the transpose are views, so a block touches only its own
    bytes. Its own pages of the mapping are released (``MADV_DONTNEED``; they stay in
    the page cache) once the parameter's parts have read ``RELEASE_BYTES`` since the
    last release (:meth:`Parts.reading`): a stack of parts smaller than that lets go
    of those already in its block as it reads the next. Not after every block: the
    kernel maps a block's neighbours with it, and a block's release would drop the
    next block's pages too (measured: 1.3x the load's time); nor the whole mapping at
    once, which would drop the other parts' pages (a stacked parameter's layers)."""

    def __init__(
        self,
        leaf: _blocks.Leaf,
        entry: PlanEntry,
        mapping: Callable[[Source], tuple[Any, int]],
        total: list[int],
        tally: list[int] | None = None,
    ):
        stored = leaf.stored
        self.leaf, self.entry, self._total = leaf, entry, total
        self._tally = [0] if tally is None else tally  # bytes read since the bar was told
        self._mapping, self._read = mapping, 0
        self._view_of: tuple[Any, np.ndarray] | None = None
        low = stored.start
        self.pages = (low - low % mmap.PAGESIZE, low + stored.nbytes)  # in the file

    @property
    def view(self) -> np.ndarray:
        """The part's view of its file's mapping (mapped again if it was let go)."""
        stored, leaf = self.leaf.stored, self.leaf
        if stored.nbytes == 0:  # no bytes to map (an empty tensor at the end of the file)
            mapped, base = None, 0
        else:
            mapped, base = self._mapping(stored.file)
        if self._view_of is not None and self._view_of[0] is mapped:
            return self._view_of[1]
        stored_dtype = READABLE[stored.dtype]
        count = math.prod(stored.shape)
        if mapped is None:
            flat = np.zeros(count, stored_dtype)
        else:
            flat = np.frombuffer(mapped, stored_dtype, count, stored.start - base)
        whole = flat.reshape(stored.shape)
        if leaf.index:  # not on a 0-d tensor: [()] of one is a numpy scalar, not a view
            whole = whole[leaf.index]
        view = whole.reshape(leaf.shape).transpose(leaf.order)
        # resolve() checked that the slice reshapes as a view: a copy here would read
        # the whole slice, bytes this process does not own
        assert whole.size == 0 or np.may_share_memory(view, whole)
        self._view_of = (mapped, view)
        return view

    def forget(self) -> None:
        self._view_of = None

    def block(self, index: Any) -> np.ndarray:
        """The part's block at ``index``: a view of the file where no cast, scale or
        offset is needed (:func:`put` places it in memory of its own), else the cast
        (checked), scaled and offset copy."""
        block = _blocks.at(self.view, index)  # a 0-d block stays an array
        self._read += block.nbytes
        self._total[0] += block.nbytes
        self._tally[0] += block.nbytes
        dtype = self.entry.spec.dtype
        tensor = self.leaf.tensor
        # the dtype MaxText's hooks see the values in: the planned one unless told
        work = dtype if tensor.compute_dtype is None else tensor.compute_dtype
        if block.dtype != work:
            block = cast(block, work, self.entry.path, self.leaf)
        if tensor.scale is not None:  # after the cast: MaxText's hooks see it cast
            block = scaled(block, tensor.scale, self.entry.path, self.leaf)
        if tensor.offset is not None:  # after the scale, rounded on its own
            block = offset(block, tensor.offset, self.entry.path, self.leaf)
        if block.dtype != dtype:
            block = cast(block, dtype, self.entry.path, self.leaf)
        return block

    def release(self, mapped: Any, base: int) -> None:
        """Drops its pages of ``mapped`` (those read since the last time)."""
        if self._read and hasattr(mapped, "madvise"):
            self._read = 0
            low, high = self.pages[0] - base, self.pages[1] - base
            mapped.madvise(mmap.MADV_DONTNEED, low, high - low)


class Parts:
    """Every part of one parameter: :meth:`block` reads the parameter's block at an
    index from the parts it reaches.

    Each local file the parameter reads is opened again when a block first needs it
    (known to be the file checked), memory-mapped over the span of its parts, and
    closed: a mapping holds one descriptor (Python duplicates it), and at most
    :data:`OPEN_FILES` mappings are kept, so a load holds a bounded number whatever
    the checkpoint's count of files (241-shard checkpoints meet macOS's limit of
    256). Each part releases its pages as it goes (:class:`Part`), and the
    mappings go with the parameter, so the file's bytes never count much in this
    process's memory. A fetched source's span (a remote object's) is an anonymous
    mapping that :class:`~meshinit._checkpoint.store.fetch.Fetch` fills."""

    def __init__(
        self,
        job: Job,
        checked: Mapping[Source, _file.Checked],
        total: list[int],
        budget: int,
        update: Callable[[int], None] = lambda n: None,
    ):
        self.job = job
        self._checked = checked
        self._update, self._tally = update, [0]  # a local file's bytes, for the bar
        leaves = list(_blocks.leaves(job.node))
        spans: dict[Source, list[int]] = {}
        for leaf in leaves:
            held = leaf.stored
            if held.nbytes:
                span = spans.setdefault(held.file, [held.start, held.start + held.nbytes])
                span[0], span[1] = min(span[0], held.start), max(span[1], held.start + held.nbytes)
        self._spans = {
            path: (start - start % mmap.ALLOCATIONGRANULARITY, end)
            for path, (start, end) in spans.items()
        }
        self._open: collections.OrderedDict[Source, tuple[Any, int]] = collections.OrderedDict()
        self._dirty: dict[int, Part] = {}  # the local parts read since the last release
        self._since = 0  # their bytes
        self._last: tuple[Part, int] | None = None  # the part being read, and its count
        fetched = {}
        for file, (base, end) in self._spans.items():
            if file.fetched:  # anonymous: filled by ranged reads
                fetched[file] = (file.mapping(checked[file].identity, base, end), base)
        self._fetched = fetched
        self.parts = {}
        for leaf in leaves:
            # a fetched part's bytes are counted as they are fetched
            fetched_part = leaf.stored.file.fetched
            counts, tally = ([0], [0]) if fetched_part else (total, self._tally)
            self.parts[id(leaf)] = Part(leaf, job.entry, self._mapping, counts, tally)
        self.fetch = None  # what its fetched parts need fetched, and when
        if fetched:
            views = {
                key: part.view for key, part in self.parts.items() if part.leaf.stored.file.fetched
            }
            reads = []
            for index, _ in holders(job.entry, job.stage).values():
                reached = [
                    (leaf.stored.file, _blocks.at(views[id(leaf)], at))
                    for leaf, at in _blocks.reached(job.node, index)
                    if leaf.stored.file.fetched
                ]
                reads.append((index, [(obj, view) for obj, view in reached if view.size]))
            names: dict[Source, set[str]] = {}
            for leaf in leaves:
                names.setdefault(leaf.stored.file, set()).add(leaf.stored.name)
            self.fetch = _fetch.Fetch(reads, names, fetched, budget)

    def _mapping(self, path: Source) -> tuple[Any, int]:
        if path in self._fetched:
            return self._fetched[path]
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        while len(self._open) >= OPEN_FILES:  # let the oldest go (a view keeps it alive)
            gone, _ = self._open.popitem(last=False)
            for part in self.parts.values():
                if part.leaf.stored.file == gone:
                    part.forget()
        base, end = self._spans[path]
        self._open[path] = (path.mapping(self._checked[path].identity, base, end), base)
        return self._open[path]

    def order(self, held: Mapping[tuple[Any, ...], Any]) -> list[tuple[Any, ...]]:
        """The order to place the blocks of ``held`` (:func:`holders`) in: a fetch's
        (blocks that share pages side by side), else as given."""
        if self.fetch is None:
            return list(held)
        keys: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
        for key, (index, _) in held.items():  # a staging block's key is not its index
            keys.setdefault(_fetch.block_key(index), []).append(key)
        return [k for found in self.fetch.order for k in keys.pop(found, [])]

    def block(self, index: tuple[slice, ...]) -> np.ndarray:
        if self.fetch is not None:
            self.fetch.ready(index)
        return _blocks.block(
            self.job.node,
            index,
            lambda leaf, at: self.reading(leaf).block(at),
            self.job.entry.spec.dtype,
        )

    def reading(self, leaf: _blocks.Leaf) -> Part:
        """The part ``leaf`` is about to be read from. The parts read before it are in
        the block by now (a joined block copies each part's as it is read): once they
        read ``RELEASE_BYTES`` since the last release, their pages go, so a block
        stacked from many parts never has all their pages mapped beside it."""
        self._settle(RELEASE_BYTES)
        part = self.parts[id(leaf)]
        if not leaf.stored.file.fetched:
            self._dirty[id(leaf)] = part
            self._last = (part, part._read)
        return part

    def _settle(self, least: int) -> None:
        """Releases the pages of the local parts read since the last release, once
        they read at least ``least`` bytes (a mapping let go since has none left)."""
        if self._last is not None:
            part, before = self._last
            self._since += part._read - before
            self._last = None
        if self._since < least:
            return
        for part in self._dirty.values():
            if part.leaf.stored.file in self._open:
                part.release(*self._open[part.leaf.stored.file])
        self._dirty.clear()
        self._since = 0

    def place(
        self, key: Any, index: tuple[slice, ...], devices: list[Any], memory_kind: str | None
    ) -> list[jax.Array]:
        """The block at ``index`` read and placed on ``devices``: the arrays made (one
        per device; a staging block's, zero-padded to its bounds ``key``)."""
        block = self.block(index)
        stage = self.job.stage
        if stage is not None and (pad := stage.real(tuple(slice(*b) for b in key))[1]):
            widths = [(0, 0)] * block.ndim
            widths[stage.axis] = (0, pad)
            block = np.pad(block, widths)
        return copies(block, devices, memory_kind)

    def whole(self, shape: Any, sharding: Any, shards: list[jax.Array]) -> Made:
        """The parameter's array from its placed blocks; or, where a program must run
        over them (a dequantized parameter's), a callable that runs it (.ahead)."""
        dtype = self.job.entry.spec.dtype
        return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=dtype)

    def placed(self, index: tuple[slice, ...], arrays: list[jax.Array]) -> None:
        """The block at ``index`` is on its devices as ``arrays``: the parts' read
        pages go (a local file's stay in the page cache; a remote chunk's once the
        devices hold every block of it)."""
        self._settle(RELEASE_BYTES)
        read, self._tally[0] = self._tally[0], 0
        if read:
            self._update(read)
        if self.fetch is not None:
            self.fetch.placed(index, arrays)

    def close(self) -> None:
        """The parameter is placed: its local mappings are let go."""
        self._open.clear()
        for part in self.parts.values():
            part.forget()


def parts(
    job: Job,
    checked: Mapping[Source, _file.Checked],
    total: list[int],
    budget: int = 1 << 30,
    update: Callable[[int], None] = lambda n: None,
) -> Parts:
    return (job.parts or Parts)(job, checked, total, budget, update)


def holders(
    entry: PlanEntry, stage: Any = None
) -> dict[tuple[Any, ...], tuple[tuple[slice, ...], list[Any]]]:
    """This process's distinct blocks of the entry (bounds resolved), in the order
    :func:`array` reads them, each with the devices that hold it. With a ``stage``, its
    staging blocks, each keyed by its bounds in the staging array, with the planned
    array's part of it (:meth:`~meshinit._checkpoint.read.staging.Stage.real`)."""
    shape = entry.spec.shape if stage is None else stage.shape
    sharding = entry.sharding if stage is None else stage.sharding
    out: dict[tuple[Any, ...], tuple[tuple[slice, ...], list[Any]]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        assert index is not None  # a NamedSharding gives every addressable device an index
        index = resolved(index, shape)
        key = _fetch.block_key(index)  # slices hash from 3.12 only
        if stage is not None:
            index = stage.real(index)[0]
        out.setdefault(key, (index, []))[1].append(device)
    return out


def array(entry: PlanEntry, pieces: Parts) -> Made:
    """The entry's array, one block at a time: each distinct block of this process's
    devices is read once onto the first device that holds it, copied from there to the
    others, and dropped, so the host holds at most one block beside the arrays (a
    dequantized parameter's large block: one slice of it, its ``place``). No
    array keeps the loader's memory (:func:`put`). With fan-out (the job's stage),
    the staging array: each staging block's part of the entry, zero-padded."""
    stage = pieces.job.stage
    sharding = entry.sharding if stage is None else stage.sharding
    shape = entry.spec.shape if stage is None else stage.shape
    shards: list[jax.Array] = []
    try:
        held = holders(entry, stage)
        for key in pieces.order(held):
            index, devices = held[key]
            made = pieces.place(key, index, devices, sharding.memory_kind)
            shards += made
            pieces.placed(index, made)
        # dtype: a process whose devices hold none of it passes no shards to tell it
        return pieces.whole(shape, sharding, shards)
    except BaseException:
        for s in shards:
            s.delete()
        raise


def copies(block: np.ndarray, devices: list[Any], memory_kind: str | None) -> list[jax.Array]:
    """``block`` on each of ``devices``: read onto the first (:func:`put`), copied from
    there to the others."""
    made: list[jax.Array] = []
    try:
        for device in devices:
            where = jax.sharding.make_single_device_sharding(device, memory_kind=memory_kind)
            made.append(put(block, where) if not made else jax.device_put(made[0], where))
    except BaseException:
        for array in made:
            array.delete()
        raise
    return made


def put(block: np.ndarray, where: jax.sharding.Sharding) -> jax.Array:
    """``block`` on ``where``, in memory of its own. jax's CPU client may keep using a
    numpy array's memory instead of copying it (an aligned, contiguous view of a
    file's or a fetch's mapping): the array would change with the file, or with the
    pages the loader releases. Where it did, the block is copied into memory the
    array alone holds. (Elsewhere the transfer copies, possibly after ``device_put``
    returns: a fetch releases its pages only once the arrays are ready.)"""
    placed = jax.device_put(block, where)
    if block.flags.owndata or not block.nbytes:  # memory the loader made for it alone
        return placed
    if not any(getattr(d, "platform", None) == "cpu" for d in where.device_set):
        return placed
    start = block.__array_interface__["data"][0]
    if start <= placed.unsafe_buffer_pointer() < start + block.nbytes:
        placed = jax.device_put(np.array(block), where)
    return placed


def resolved(index: Any, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """``index`` with its bounds resolved against ``shape`` (no None, no step)."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
