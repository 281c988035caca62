"""This process's files of an export, written front to back on one thread
(:class:`Writer`) as the driver hands their tensors over, each device-to-host copy
started when it is handed, so that the copies overlap the writes."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..._errors import PlanError, Problem
from ..._run import progress as _progress
from ..store.sink import Sink, Upload
from . import files as _files

PARTIAL = ".model.safetensors.partial"
"""A lone file's name until the commit renames it (hidden: no loader takes it)."""


class Writer:
    """This process's files, written front to back on one thread as their tensors are
    handed over (:meth:`hand`). The device-to-host copy of the tensor after the one
    being written is started as soon as both are known, so that each copy overlaps a
    write and the host holds at most two tensors' copies (copies started all at once
    share the link and all arrive late). The tensors handed and not yet written stay
    within ``room`` bytes (:meth:`wait_room`)."""

    def __init__(self, sink: Sink, plan: _files.Files, me: int, room: int, progress: bool | None):
        self._sink = sink
        self._files = plan.written_by(me)
        self._room = room
        self._progress = progress
        self._ready: dict[str, jax.Array] = {}
        self._held = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._upload: Upload | None = None
        self.lone: Upload | None = None
        self._wanted: str | None = None
        self._waiting = False  # the writer waits for a tensor not yet handed
        self._order = [t.name for f in self._files for t in f.tensors]
        self._next: dict[str, str] = dict(zip(self._order, self._order[1:], strict=False))
        self.opened: list[str] = []
        self._total = sum(f.size for f in self._files)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="meshinit-export", daemon=True)
        self._thread.start()

    def hand(self, name: str, array: jax.Array) -> None:
        with self._cond:
            self._ready[name] = array
            self._held += array.nbytes
            if name == self._wanted or name == self._next.get(self._wanted or ""):
                _copy(array)  # the tensor being waited for, or the one after it
            if name == self._wanted:
                self._waiting = False  # it has its tensor (before its thread wakes)
            self._cond.notify_all()

    def wait_room(self, nbytes: int) -> None:
        """Waits until ``nbytes`` more may be held for the writer: while what it holds
        would pass ``room``, unless nothing is held, or the writer itself waits for a
        tensor not yet handed (it could never free room)."""
        with self._cond:
            while (
                self._held
                and self._held + nbytes > self._room
                and self._error is None
                and not self._waiting
            ):
                self._cond.wait(0.05)
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        assert self._thread is not None
        self._thread.join()
        self.check()

    def abort(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._upload is not None:
            self._upload.abort()
        for array in self._ready.values():
            if not array.is_deleted():
                array.delete()

    def _take(self, name: str) -> jax.Array | None:
        """The tensor ``name`` once handed (None: the export stopped), the copy of the
        one after it started if it is here."""
        with self._cond:
            self._wanted = name
            if name in self._ready:
                _copy(self._ready[name])  # (started already where it was handed next)
            self._waiting = name not in self._ready
            self._cond.notify_all()
            while name not in self._ready and not self._stop:
                self._cond.wait(0.05)
            self._waiting = False
            if self._stop:
                return None
            array = self._ready.pop(name)
            after = self._next.get(name)
            if after in self._ready:
                _copy(self._ready[after])
            return array

    def _loop(self) -> None:
        try:
            with _progress.byte_bar("writing", self._total, self._progress) as update:
                for f in self._files:
                    self._write(f, update)
        except BaseException as e:  # raised on the main thread at its next step
            self._error = e
            with self._cond:
                self._cond.notify_all()

    def _write(self, f: _files.File, update: Callable[[int], None]) -> None:
        # A lone file appears last: on a disk written under a hidden name and renamed at
        # the commit; in a bucket left open, its parts sent, until the commit closes it
        lone = f.name == _files.LONE
        name = PARTIAL if lone and self._sink.renames_atomically else f.name
        self.opened.append(name)
        upload = self._upload = self._sink.open(name, size=f.size)
        upload.write(f.header)
        update(len(f.header))
        for t in f.tensors:
            array = self._take(t.name)
            if array is None:
                return
            try:
                for shard in shards(array):
                    data = np.ascontiguousarray(np.asarray(shard.data))
                    upload.write(data.view(np.uint8).reshape(-1))
                    update(data.nbytes)
                    del data  # the host copy: freed once written (the upload keeps none
                    # on a disk; a bucket's parts hold it until sent)
            finally:
                array.delete()
                with self._cond:
                    self._held -= t.nbytes
                    self._cond.notify_all()
        if lone and not self._sink.renames_atomically:
            self.lone = upload  # closed by the commit (self._upload: aborted on failure)
            return
        written = upload.close()
        self._upload = None
        if written != f.size:
            raise PlanError(
                [Problem(f"{self._sink}/{f.name}", f"wrote {written} bytes of {f.size}")]
            )


def _copy(array: jax.Array) -> None:
    """Starts the device-to-host copy of this process's shards of ``array`` (again
    changes nothing)."""
    for shard in shards(array):
        shard.data.copy_to_host_async()


def shards(array: jax.Array) -> list[Any]:
    """This process's shards of a gathered tensor in row order, one per row range."""
    seen: dict[Any, Any] = collections.OrderedDict()
    for shard in array.addressable_shards:
        index = shard.index[0] if shard.index else slice(None)
        key = (index.start or 0) if isinstance(index, slice) else index
        seen.setdefault(key, shard)
    return [seen[k] for k in sorted(seen)]
