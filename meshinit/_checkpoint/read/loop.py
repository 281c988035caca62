"""Reading checked safetensors files into a plan's shardings, block by block.

Only :mod:`meshinit.safetensors` calls this, after every file passed
:func:`meshinit._checkpoint.store.listing.check` and every path was resolved to its parts
(:mod:`.layout`): each process reads, from memory-mapped files, only the distinct
blocks its own devices hold, each once, and of each block only the bytes of the parts
it reaches, as views of the file (no copy where one part fills the block and no cast
or scale is needed).

The loop composes the read flow's steps, one parameter at a time, each handing to the
next: fetch (:class:`~meshinit._checkpoint.store.fetch.Pipeline`, or the local
mappings), place (:func:`~meshinit._checkpoint.layout.host.array`), finish
(:class:`~.ahead.Ahead`), reshard (:class:`~.reshard.Resharder`), out.
"""

from __future__ import annotations

import contextlib
import functools
import math
import traceback
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import jax

from ..._errors import PlanError, Problem
from ..._run import progress as _progress
from ..layout import blocks as _blocks
from ..layout import host as _host
from ..layout.host import Job
from ..store import fetch as _fetch
from ..store import listing as _file
from ..store.header import READABLE
from ..store.source import Source
from . import ahead as _ahead
from . import reshard as _reshard

BYTES_READ = "/meshinit/safetensors/bytes_read"
"""The ``jax.monitoring`` scalar each process records once per load: the bytes it read
from the files (in their stored dtypes), every part of every parameter counted."""


def read(
    jobs: list[Job],
    checked: Mapping[Source, _file.Checked],
    budget: int = 1 << 30,
    progress: bool | None = None,
    *,
    ends: Collection[str],
    agreed: Callable[[], None] = lambda: None,
) -> dict[str, jax.Array]:
    """The arrays of ``jobs``: every file known to be the one checked before anything
    is read, and again as it is opened (an object: by its ETag, on every read); on
    any failure, nothing read stays alive. Of remote objects, at most ``budget``
    bytes of pages are fetched and not yet released at once. Records the bytes read
    (:data:`BYTES_READ`; of remote objects, the bytes fetched) once the load is
    whole, and the bytes its shards got from other processes' reads
    (:data:`~meshinit._checkpoint.read.reshard.BYTES_FROM_PEERS`). A job with a stage is read
    onto it and resharded onto its plan's sharding
    (:class:`~meshinit._checkpoint.read.reshard.Resharder`), in batches each closed by
    one of ``ends`` (:func:`~meshinit._checkpoint.read.staging.ends`). ``agreed`` (the
    agreement of every process on what shapes the collectives) is called once the
    fetches and the reshards' compiles are under way, before the first collective: a
    small load's agreement waits while its first bytes arrive."""
    out: dict[str, jax.Array] = {}
    total = [0]
    fan = _reshard.Resharder(ends, "meshinit.safetensors.load")
    ahead = _ahead.Ahead()
    after = _ahead.Ahead()  # finished once resharded (a staged dequantized parameter)
    fan.prepare(jobs)  # their reshards compiled while the shares are fetched

    def resharded(job: Job, finished: Any) -> None:  # a staged one waits for its batch
        for path, got in fan.add(job.entry, job.stage, finished).items():
            out.update(after.add(path, got))

    try:
        needed = dict.fromkeys(
            leaf.stored.file for job in jobs for leaf in _blocks.leaves(job.node)
        )
        changed = [
            Problem(str(file), why)
            for file in needed
            if (why := file.changed(checked[file].identity)) is not None
        ]
        if changed:
            raise PlanError(changed, header="meshinit.safetensors.load: nothing was read:")
        owned = functools.partial(sum, map(_owned, jobs))
        fetched = any(file.fetched for file in needed)
        bar = "fetching" if fetched else "reading"
        with _progress.byte_bar(bar, owned, progress) as update, contextlib.ExitStack() as stack:
            fetch: Iterable[tuple[Job, Any]]
            if fetched:  # fetched ahead, within the budget, while each parameter is placed
                make = functools.partial(
                    _made, checked=checked, total=total, budget=budget, update=update
                )
                fetch = stack.enter_context(_fetch.Pipeline(jobs, make, budget, total, update))
            else:  # local files: mapped as each parameter is placed
                fetch = ((job, _host.parts(job, checked, total, budget, update)) for job in jobs)
            agreed()
            for job, pieces in fetch:
                made = _host.array(job.entry, pieces)
                try:
                    pieces.close()  # placed: its mappings go before it is handed on
                except BaseException:
                    if isinstance(made, _host.Gathered):
                        made.staged.delete()
                    elif not callable(made):
                        made.delete()
                    raise
                del pieces
                for done, finished in ahead.add(job, made):
                    resharded(done, finished)
        for done, finished in ahead.settle(0):
            resharded(done, finished)
        out.update(after.settle(0))
        out = {job.entry.path: out[job.entry.path] for job in jobs}  # the jobs' order
    except BaseException as e:
        fan.close()
        for made in [*out.values(), *ahead.drop(), *after.drop()]:
            made.delete()
        out.clear()
        # A held exception (a notebook's sys.last_traceback) keeps the frames below
        # alive, and with them the block being read: drop their locals.
        traceback.clear_frames(e.__traceback__)
        raise
    jax.monitoring.record_scalar(BYTES_READ, float(total[0]))
    jax.monitoring.record_scalar(_reshard.BYTES_FROM_PEERS, float(fan.from_peers))
    return out


def _owned(job: Job) -> int:
    """The stored bytes this process's blocks of the job read, of every part each block
    reaches (for the bar; a constant or a pad's padding reads none)."""
    total = 0
    image = job.stage is not None and getattr(job.parts, "stage_of", None) is not None
    for index, _ in _host.holders(job.entry, job.stage).values():
        if image:  # a staged array of its stored bytes (MXFP4's): a byte an element
            total += math.prod(max(0, s.stop - s.start) for s in index)
            continue
        for leaf, at in _blocks.reached(job.node, index):
            held, dtype = leaf.stored, READABLE.get(leaf.stored.dtype)
            size = math.prod(max(0, s.stop - s.start) for s in at)
            if dtype is None:  # a virtual tensor (MXFP4): its stored bytes an element
                total += size * held.nbytes // max(1, math.prod(held.shape))
            else:
                total += size * dtype.itemsize
    return total


def _made(
    job: Job,
    checked: Mapping[Source, _file.Checked],
    total: list[int],
    budget: int,
    update: Callable[[int], None],
) -> Any:
    return _host.parts(job, checked, total, budget, update)  # looked up when called: tests wrap it
