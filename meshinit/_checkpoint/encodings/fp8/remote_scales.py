"""The block scales of remote float8 weights, fetched where the blocks read them.

A dequantized parameter's scale in a local file is read whole (:mod:`.decode`). Of
a remote object (a fetched source, :mod:`.fetch`), only the scale rows and columns
that cover this process's blocks are fetched: each row of a window is one run of
bytes, the runs are merged as a weight's are (:func:`~meshinit._checkpoint.store.fetch.merge`),
and the requests start when the parameter's parts are made (ahead of placement, in
the fetch pipeline's thread), at most :data:`~meshinit._checkpoint.store.remote.CONCURRENCY` at
once. The first block that needs a scale waits for them, within the load's deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...._errors import PlanError, Problem, printable
from ...store import aio as _aio
from ...store import fetch as _fetch
from ...store import remote as _remote
from ...store.header import READABLE
from ...store.source import Source, Stored


class Fetched:
    """The windows (scale, (first row, last row), (first column, last column)) of
    remote scales, fetched into arrays of the scales' shapes (zeros elsewhere)."""

    def __init__(
        self,
        windows: Sequence[tuple[Stored, tuple[int, int], tuple[int, int]]],
        checked: Mapping[Source, Any],
    ):
        runs: dict[Stored, list[tuple[int, int]]] = {}
        for held, (r0, r1), (c0, c1) in windows:
            size = READABLE[held.dtype].itemsize
            cols = held.shape[1]
            found = runs.setdefault(held, [])
            for r in range(r0, r1 + 1):
                found.append(((r * cols + c0) * size, (r * cols + c1 + 1) * size))
        self.arrays = {held: np.zeros(held.nbytes, np.uint8) for held in runs}
        self.fetched = {held: 0 for held in runs}
        self.pieces = [
            (held, lo, hi) for held, found in runs.items() for lo, hi in _fetch.merge(found)
        ]
        self.failed: list[tuple[Stored, int, int, str]] = []
        self.future: concurrent.futures.Future[None] = _aio.submit(self._all())

    async def _all(self) -> None:
        requests = asyncio.Semaphore(_remote.CONCURRENCY)

        async def one(held: Stored, lo: int, hi: int) -> None:
            async with requests:
                try:
                    data = await held.file.fetch(held.start + lo, held.start + hi)
                except Exception as e:  # noqa: BLE001 - named to the caller, never lost
                    said = (
                        str(e) if isinstance(e, _remote.Permanent) else f"{type(e).__name__}: {e}"
                    )
                    self.failed.append((held, lo, hi, said))
                    return
            self.arrays[held][lo:hi] = np.frombuffer(data, np.uint8)
            self.fetched[held] += hi - lo

        await asyncio.gather(*(one(*piece) for piece in self.pieces))

    def result(self, held: Stored, path: str) -> tuple[np.ndarray, int]:
        """The scale (its windows fetched) and the bytes fetched of it; waits for the
        fetch within the load's deadline, and names what failed."""
        timeout = _aio.deadline()
        try:
            self.future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            self.future.cancel()
            self.failed.append((held, 0, held.nbytes, f"no complete answer within {timeout:g} s"))
        except BaseException:
            self.future.cancel()
            raise
        if self.failed:
            raise PlanError(
                [
                    Problem(
                        str(obj.file),
                        f"bytes [{obj.start + lo}, {obj.start + hi}) (the block scale "
                        f"{printable(obj.name)!r} of {path}): {why}",
                    )
                    for obj, lo, hi, why in sorted(self.failed, key=lambda f: (f[0].name, f[1]))
                ][:10],
                header="meshinit.safetensors.load: a read failed (nothing loaded):",
            )
        dtype = READABLE[held.dtype]
        return self.arrays[held].view(dtype).reshape(held.shape), self.fetched.pop(held, 0)

    def cancel(self) -> None:
        self.future.cancel()
