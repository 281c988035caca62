"""Parameters finished on worker threads while the loader reads the next ones.

A dequantized parameter's :meth:`~meshinit._checkpoint.layout.host.Parts.whole` gives a callable
that runs its program over the blocks already on the devices: called on a worker
thread, XLA compiles that program (about a second on a TPU) while the host reads
the next parameter's blocks, and several programs compile at once, each with the
load's ``meshinit.options``. :func:`meshinit._checkpoint.encodings.base.run` keeps two
threads from compiling one program twice.

The finish step of the read flow: what it gives back, :mod:`.loop` hands on to the
reshard step. A staged dequantized parameter (fan-out) passes through it as its stored
bytes (:class:`~meshinit._checkpoint.layout.host.Gathered`); once the reshard has
gathered them, its program runs on a second :class:`Ahead`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
from typing import Any

import jax

AHEAD = 4
"""Parameters whose programs (a dequantized parameter's) compile and run on worker
threads while the next parameters are read, at most: each keeps its stored bytes on
its devices until its program has run."""


class Ahead:
    """The parameters finished on worker threads
    (:meth:`~meshinit._checkpoint.layout.host.Parts.whole` gave a callable that finishes
    the array): XLA compiles one program while the host reads the next parameter's
    blocks, and several compile at once."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()

    def add(self, job: Any, made: Any) -> list[tuple[Any, jax.Array]]:
        """The jobs finished now, each with its array: ``made`` itself, or the oldest
        finished ones while more than :data:`AHEAD` are on their way."""
        if not callable(made):
            return [(job, made)]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(AHEAD, "meshinit-finish")
        # with the load's options (a context variable) in the worker thread, where
        # the program compiles
        self._pending.append((job, self._pool.submit(contextvars.copy_context().run, made)))
        return self.settle(AHEAD)

    def settle(self, most: int) -> list[tuple[Any, jax.Array]]:
        """Waits until at most ``most`` are on their way: the others' jobs and arrays."""
        out = []
        try:
            while len(self._pending) > most:
                job, future = self._pending[0]
                out.append((job, future.result()))
                self._pending.popleft()
        except BaseException:
            for _, made in out:
                made.delete()
            raise
        finally:
            if not self._pending and self._pool is not None:
                self._pool.shutdown()
                self._pool = None
        return out

    def drop(self) -> list[jax.Array]:
        """After a failure: waits for every one on its way, and gives the arrays made."""
        made = []
        for _, future in self._pending:
            try:
                made.append(future.result())
            except BaseException:  # noqa: BLE001  (the first failure is the one raised)
                pass
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return made
