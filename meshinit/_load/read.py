"""Reading checked safetensors files into a plan's shardings, block by block.

Only :mod:`meshinit.safetensors` calls this, after every file passed
:func:`meshinit._load.file.check` and every path was resolved to its parts
(:mod:`.layout`): each process reads, from memory-mapped files, only the distinct
blocks its own devices hold, each once, and of each block only the bytes of the parts
it reaches, as views of the file (no copy where one part fills the block and no cast
or scale is needed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import pathlib
import traceback
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from .._errors import PlanError, Problem
from .._plan.plan import PlanEntry
from .._run import progress as _progress
from . import fetch as _fetch
from . import file as _file
from . import layout as _layout
from . import remote as _remote

Where = pathlib.Path | _remote.Remote
BYTES_READ = "/meshinit/safetensors/bytes_read"
"""The ``jax.monitoring`` scalar each process records once per load: the bytes it read
from the files (in their stored dtypes), every part of every parameter counted."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One plan path's read: its parts, resolved against the checked files."""

    entry: PlanEntry
    node: _layout.Node


def read(
    jobs: list[Job],
    checked: Mapping[Where, _file.Checked],
    budget: int = 1 << 30,
    progress: bool | None = None,
) -> dict[str, jax.Array]:
    """The arrays of ``jobs``: every file known to be the one checked before anything
    is read, and again as it is opened (an object: by its ETag, on every read); on
    any failure, nothing read stays alive. Of remote objects, at most ``budget``
    bytes are fetched and not yet placed at once. Records the bytes read
    (:data:`BYTES_READ`; of remote objects, the bytes fetched) once the load is
    whole."""
    out: dict[str, jax.Array] = {}
    total = [0]
    try:
        needed = dict.fromkeys(
            leaf.stored.file for job in jobs for leaf in _layout.leaves(job.node)
        )
        changed = [
            Problem(str(path), "changed since it was checked; load again")
            for path in needed
            if isinstance(path, pathlib.Path) and _now(path) != checked[path].identity
        ]
        if changed:
            raise PlanError(changed, header="meshinit.safetensors.load: nothing was read:")
        if not any(isinstance(p, _remote.Remote) for p in needed):
            for job in jobs:
                out[job.entry.path] = array(job.entry, source(job, checked, total, budget))
        else:  # fetched ahead, within the budget, while each parameter is placed
            make = functools.partial(_made, checked=checked, total=total, budget=budget)
            owned = sum(_owned(job) for job in jobs)
            with (
                _progress.byte_bar("fetching", owned, progress) as update,
                _fetch.Pipeline(jobs, make, budget, total, update) as pipeline,
            ):
                for job, sources in pipeline:
                    out[job.entry.path] = array(job.entry, sources)
                    if sources.fetch is not None:
                        sources.fetch.finish()
                    del sources
    except BaseException as e:
        for made in out.values():
            made.delete()
        out.clear()
        # A held exception (a notebook's sys.last_traceback) keeps the frames below
        # alive, and with them the block being read: drop their locals.
        traceback.clear_frames(e.__traceback__)
        raise
    jax.monitoring.record_scalar(BYTES_READ, float(total[0]))
    return out


def _owned(job: Job) -> int:
    """About the stored bytes of this process's blocks of the job (for the bar)."""
    leaf = _layout.leaves(job.node)[0]
    itemsize = (
        _file.READABLE[leaf.stored.dtype].itemsize if leaf.stored.dtype in _file.READABLE else 1
    )
    return sum(
        math.prod(s.stop - s.start for s in index) * itemsize
        for index, _ in holders(job.entry).values()
    )


def _made(job: Job, checked: Mapping[Where, _file.Checked], total: list[int], budget: int) -> Any:
    return source(job, checked, total, budget)  # looked up when called: tests wrap it


def _now(path: pathlib.Path) -> tuple[int, ...] | None:
    try:
        return _file.identity(os.stat(path))
    except OSError:
        return None


def _reopen(path: pathlib.Path, checked: _file.Checked) -> Any:
    """``path`` opened again, known to be the file that was checked."""
    f, st, why = _file.open_regular(path)
    if f is not None and st is not None and _file.identity(st) == checked.identity:
        return f
    if f is not None:
        f.close()
    raise PlanError(
        [Problem(str(path), why or "changed since it was checked; load again")],
        header="meshinit.safetensors.load: a file changed while it was read (nothing loaded):",
    )


RELEASE_BYTES = 64 << 20


class Source:
    """A stored tensor viewed as a part of the parameter, in its file's mapping: the
    slice, the reshape and the transpose are views, so a block touches only its own
    bytes. Its own pages of the mapping are released (``MADV_DONTNEED``; they stay in
    the page cache) once blocks of ``RELEASE_BYTES`` have been read from it since the
    last release. Not after every block: the kernel maps a block's neighbours with
    it, and a block's release would drop the next block's pages too (measured: 1.3x
    the load's time); nor the whole mapping at once, which would drop the other
    parts' pages (a stacked parameter's layers)."""

    def __init__(
        self, leaf: _layout.Leaf, entry: PlanEntry, mapped: Any, base: int, total: list[int]
    ):
        stored = leaf.stored
        stored_dtype = _file.READABLE[stored.dtype]
        count = math.prod(stored.shape)
        if stored.nbytes == 0:  # no bytes to map (an empty tensor at the end of the file)
            flat = np.zeros(count, stored_dtype)
        else:
            flat = np.frombuffer(mapped, stored_dtype, count, stored.start - base)
        whole = flat.reshape(stored.shape)
        if leaf.index:  # not on a 0-d tensor: [()] of one is a numpy scalar, not a view
            whole = whole[leaf.index]
        self.view = whole.reshape(leaf.shape).transpose(leaf.order)
        # resolve() checked that the slice reshapes as a view: a copy here would read
        # the whole slice, bytes this process does not own
        assert whole.size == 0 or np.may_share_memory(self.view, whole)
        self.leaf, self.entry, self._total = leaf, entry, total
        self._map, self._read = mapped, 0
        if mapped is not None:  # its own pages of the mapping
            low = stored.start - base
            self._pages = (low - low % mmap.PAGESIZE, low + stored.nbytes)

    def block(self, index: Any) -> np.ndarray:
        """The part's block at ``index``: a view of the file where no cast or scale is
        needed (``device_put`` copies it), else the cast (checked) and scaled copy."""
        block = self.view[index]
        self._read += block.nbytes
        self._total[0] += block.nbytes
        dtype = self.entry.spec.dtype
        if block.dtype != dtype:
            block = cast(block, dtype, self.entry.path, self.leaf)
        if self.leaf.tensor.scale is not None:  # after the cast: MaxText's hooks see it cast
            block = scaled(block, self.leaf.tensor.scale, self.entry.path, self.leaf)
        return block

    def release(self) -> None:
        """Drops its mapped pages if enough were read since the last time."""
        if self._read >= RELEASE_BYTES and self._map is not None:
            self._read = 0
            if hasattr(self._map, "madvise"):
                low, high = self._pages
                self._map.madvise(mmap.MADV_DONTNEED, low, high - low)


class Sources:
    """Every part of one parameter: :meth:`block` reads the parameter's block at an
    index from the parts it reaches.

    Each file the parameter reads is opened again (known to be the file checked),
    memory-mapped over the span of its parts, and closed: a mapping holds one
    descriptor (Python duplicates it), so a load holds one per file of the parameter
    being read, whatever the checkpoint's count of files (241-shard checkpoints meet
    macOS's limit of 256). Each part releases its pages as it goes (:class:`Source`),
    and the mappings go with the parameter's last block, so the file's bytes never
    count much in this process's memory."""

    def __init__(
        self, job: Job, checked: Mapping[Where, _file.Checked], total: list[int], budget: int
    ):
        self.job = job
        leaves = list(_layout.leaves(job.node))
        spans: dict[Where, list[int]] = {}
        for leaf in leaves:
            held = leaf.stored
            if held.nbytes:
                span = spans.setdefault(held.file, [held.start, held.start + held.nbytes])
                span[0], span[1] = min(span[0], held.start), max(span[1], held.start + held.nbytes)
        self._maps: dict[Where, tuple[mmap.mmap, int]] = {}
        for path, (start, end) in spans.items():
            base = start - start % mmap.ALLOCATIONGRANULARITY
            if isinstance(path, _remote.Remote):  # anonymous: filled by ranged reads
                self._maps[path] = (mmap.mmap(-1, end - base, flags=mmap.MAP_PRIVATE), base)
                continue
            with _reopen(path, checked[path]) as f:
                mapped = mmap.mmap(f.fileno(), end - base, access=mmap.ACCESS_READ, offset=base)
            self._maps[path] = (mapped, base)
        self.parts = {}
        for leaf in leaves:
            mapping = self._maps.get(leaf.stored.file)
            view, at = mapping if mapping is not None else (None, 0)
            # a remote part's bytes are counted as they are fetched
            counts = [0] if isinstance(leaf.stored.file, _remote.Remote) else total
            self.parts[id(leaf)] = Source(leaf, job.entry, view, at, counts)
        remote = {p: m for p, m in self._maps.items() if isinstance(p, _remote.Remote)}
        self.fetch = None  # what its remote parts need fetched, and when
        if remote:
            views = {key: part.view for key, part in self.parts.items()}
            blocks = [index for index, _ in holders(job.entry).values()]
            dtype = job.entry.spec.dtype
            self.fetch = _fetch.Fetch(job.node, dtype, blocks, views, remote, budget)

    def block(self, index: tuple[slice, ...]) -> np.ndarray:
        if self.fetch is not None:
            self.fetch.ready(index)
        return _layout.block(
            self.job.node,
            index,
            lambda leaf, at: self.parts[id(leaf)].block(at),
            self.job.entry.spec.dtype,
        )

    def release(self) -> None:
        for part in self.parts.values():
            part.release()


def source(
    job: Job, checked: Mapping[Where, _file.Checked], total: list[int], budget: int = 1 << 30
) -> Sources:
    return Sources(job, checked, total, budget)


def cast(block: np.ndarray, dtype: np.dtype, path: str, leaf: _layout.Leaf) -> np.ndarray:
    """``block`` cast to ``dtype``; a value the cast would change beyond rounding (an
    int out of range, a finite float that overflows) is a PlanError naming the path
    and the part."""
    why = None
    if jax.dtypes.issubdtype(dtype, np.integer) and block.size:
        info = ml_dtypes.iinfo(dtype)
        low, high = block.min(), block.max()
        if low < info.min or high > info.max:
            why = f"holds values from {low} to {high}, outside {dtype.name}'s range"
    with np.errstate(over="ignore", invalid="ignore"):
        out = block.astype(dtype)
    if why is None and jax.dtypes.issubdtype(dtype, np.inexact) and not np.isfinite(out).all():
        grew = np.isfinite(block) & ~np.isfinite(out)
        if grew.any():
            why = f"holds {block[grew].flat[0]}, which overflows {dtype.name}"
    if why is not None:
        raise PlanError(
            [Problem(path, f"{leaf.label}tensor {leaf.stored.name!r} {why}; plan a wider dtype")],
            header="meshinit.safetensors.load: a value does not fit the planned dtype:",
        )
    return out


def scaled(block: np.ndarray, scale: float, path: str, leaf: _layout.Leaf) -> np.ndarray:
    """``block``, already in the planned dtype, times ``scale`` as MaxText 0.2.5's
    conversion hooks compute it on a tensor in its save dtype:
    ``(x.astype(np.float32) * np.float32(scale)).astype(x.dtype)``. A float64 block is
    multiplied in float64 (as numpy promotes ``x * np.float32(scale)``, the other
    spelling of MaxText's hooks), not cut to float32. A finite value that the product
    or its rounding back makes infinite (NaN in a float8 without infinities) is a
    PlanError naming the path, the part and the value."""
    work = np.result_type(block.dtype, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        factor = work.type(scale)
        product = block.astype(work) * factor
        out = product.astype(block.dtype)
    grew = np.isfinite(block) & ~np.isfinite(out)
    if not grew.any():
        return out
    value, wide = float(block[grew].flat[0]), float(product[grew].flat[0])
    if not np.isfinite(factor):
        why = f"is scaled by {scale}, which overflows {work.name} (the product's dtype)"
    elif not np.isfinite(wide):
        why = f"holds {value}, which times scale={scale} overflows {work.name}"
    else:
        why = f"holds {value}, which times scale={scale} is {wide}: it overflows {out.dtype.name}"
    raise PlanError(
        [Problem(path, f"{leaf.label}tensor {leaf.stored.name!r} {why}; plan a wider dtype")],
        header="meshinit.safetensors.load: a scaled value does not fit the planned dtype:",
    )


def holders(entry: PlanEntry) -> dict[tuple[Any, ...], tuple[tuple[slice, ...], list[Any]]]:
    """This process's distinct blocks of the entry (bounds resolved), in the order
    :func:`array` reads them, each with the devices that hold it."""
    shape = entry.spec.shape
    out: dict[tuple[Any, ...], tuple[tuple[slice, ...], list[Any]]] = {}
    for device, index in entry.sharding.addressable_devices_indices_map(shape).items():
        assert index is not None  # a NamedSharding gives every addressable device an index
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        key = tuple(bounds)  # slices hash from 3.12 only
        out.setdefault(key, (tuple(slice(*b) for b in bounds), []))[1].append(device)
    return out


def array(entry: PlanEntry, source: Sources) -> jax.Array:
    """The entry's array, one block at a time: each distinct block of this process's
    devices is read once onto the first device that holds it, copied from there to the
    others, and dropped, so the host holds at most one block beside the arrays."""
    sharding, shape = entry.sharding, entry.spec.shape
    shards: list[jax.Array] = []
    try:
        for index, devices in holders(entry).values():
            block = source.block(index)
            first = None
            for device in devices:
                where = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
                shards.append(jax.device_put(block if first is None else first, where))
                first = shards[-1]
            del block, first
            source.release()
        # dtype: a process whose devices hold none of it passes no shards to tell it
        return jax.make_array_from_single_device_arrays(
            shape, sharding, shards, dtype=entry.spec.dtype
        )
    except BaseException:
        for s in shards:
            s.delete()
        raise
