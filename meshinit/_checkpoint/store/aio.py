"""The event loop every remote request runs on: one deadline per request, and
cancellation that reaches the wire.

obstore's blocking calls hold the calling thread inside Rust: the main thread does not
see Ctrl-C there, and a thread stuck in one cannot be stopped. Its ``*_async`` calls
run on an asyncio loop instead, and cancelling the task drops the request (its
connection is closed). So every request runs as a task on one loop, in a thread of
its own (``meshinit-io``) that lives while a load or an inventory does
(:func:`session`); the calling thread only waits, interruptibly, and cancels what it
waits for when it stops waiting for any reason (Ctrl-C, a failure elsewhere).

:func:`deadline` bounds each request, the client's own retries and meshinit's
included: past it, the request is cancelled and fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

TIMEOUT = 120.0
"""Seconds one request may take by default, retries included (``timeout=`` of
:func:`meshinit.safetensors.load`)."""

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "meshinit_remote_timeout", default=TIMEOUT
)


class TimedOut(Exception):
    """A request that took longer than its deadline (and was cancelled)."""


def deadline() -> float | None:
    """The seconds a request may take in this context (None: no deadline)."""
    return _deadline.get()


class _Loop:
    """An asyncio loop in its own daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="meshinit-io", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def stop(self) -> None:
        """Every task cancelled, then the loop stopped and its thread joined."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - stopping regardless
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


_lock = threading.Lock()
_current: _Loop | None = None
_users = 0


@contextlib.contextmanager
def session(timeout: float | None = TIMEOUT) -> Iterator[None]:
    """The loop kept for the calls inside (started on first use), every request in
    them bounded by ``timeout`` seconds; when the last session ends, whatever still
    runs is cancelled and the loop's thread ends: nothing of a load outlives it."""
    global _users, _current
    with _lock:
        _users += 1
    token = _deadline.set(timeout)
    try:
        yield
    finally:
        _deadline.reset(token)
        with _lock:
            _users -= 1
            ending = _current if _users == 0 else None
            if ending is not None:
                _current = None
        if ending is not None:
            ending.stop()


def _loop() -> _Loop:
    global _current
    with _lock:
        if _current is None:
            _current = _Loop()
        return _current


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """``coro`` started on the loop; cancel the returned future to cancel it."""
    return asyncio.run_coroutine_threadsafe(coro, _loop().loop)


def run(coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``coro()`` run on the loop within this context's :func:`deadline`, the calling
    thread waiting for it interruptibly: on Ctrl-C (or anything else that stops the
    wait) the request is cancelled before the exception goes on."""

    async def inside() -> T:  # the awaitable made on the loop: obstore's need one running
        return await coro()

    with session(deadline()):
        future = submit(bounded(inside(), deadline()))
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise


async def bounded(work: Awaitable[T], timeout: float | None) -> T:
    """``work``, cancelled past ``timeout`` seconds (:class:`TimedOut`)."""
    if timeout is None:
        return await work
    try:
        return await asyncio.wait_for(work, timeout)
    except TimeoutError:
        raise TimedOut(
            f"no complete answer within {timeout:g} s (retries included); a slower store "
            f"needs a larger timeout= of meshinit.safetensors.load"
        ) from None
