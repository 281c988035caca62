"""Agreement between processes: a collective call succeeds everywhere or nowhere.

Under ``jax.distributed`` every process runs the same ``materialize``, each making its
own shards. If one process fails (a bad local memory check, an out-of-memory, a
compile error) and the others return, their arrays lack the failed process's shards,
and the next collective fails long after, saying nothing of the cause. So each call
ends with :func:`agree`: every process, whether its part succeeded or failed, joins one
``jax.experimental.multihost_utils.process_allgather`` of its outcome (jax's public
API), and a failure anywhere is raised everywhere, naming the process and its error.

A process that fails raises, it does not die, so it reaches the agreement from its
error path. One that is killed never does: the others then fail in the gather itself,
after the collectives' own timeout, and say that a process did not reach it.

Every collective call runs inside :func:`collective`, which agrees exactly once, when
the outermost such call ends, however it ends: a factory that raises while tracing on
one process, a plan that fails there, or a run that fails later all meet the others'
outcome in the same gather. Nested calls (an adapter's init runs ``run_plan``) join
the outer call's agreement; what they made is handed to it (:func:`keep`), to be
deleted if any process failed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from .._errors import PeerFailure


class _Call:
    """The outermost collective call in progress: the arrays it made so far, and
    whether an agreement inside it (:func:`checkpoint`) already met a failure, which
    every process then knows: no agreement follows it."""

    def __init__(self) -> None:
        self.made: list[Any] = []
        self.settled = False


_call: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "meshinit collective call", default=None
)


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """One collective call: on every process, exactly one :func:`agree`, at its end.

    The outermost ``collective`` agrees when its block ends: with its error if it
    raised (everything before allocating included: tracing a factory, planning), else
    with success. If any process failed, the arrays handed to :func:`keep` are
    deleted and every process raises. A ``collective`` inside another one does
    nothing of its own: the outer one agrees for both.

    Args:
      what: the call's name in messages (``"meshinit.nnx.init"``).

    Raises:
      PeerFailure: this process succeeded and another failed (see :func:`agree`).
    """
    if _call.get() is not None:
        yield
        return
    call = _Call()
    token = _call.set(call)
    try:
        yield
    except BaseException as e:
        _call.reset(token)
        _delete(call.made)
        if not call.settled:
            agree(what, e)
        raise
    _call.reset(token)
    try:
        agree(what, None)
    except BaseException:
        _delete(call.made)
        raise


def keep(arrays: Iterable[Any]) -> None:
    """Hands arrays made inside a :func:`collective` call to it, to be deleted if the
    call fails, here or on any other process. Outside one it does nothing."""
    call = _call.get()
    if call is not None:
        call.made.extend(arrays)


def checkpoint(what: str, error: BaseException | None = None) -> None:
    """An agreement inside a collective call, before work that every process must
    join (a collective program): with ``error`` None, it returns when every process
    got this far; else (this process failed) it tells the others and returns, and the
    caller raises its error. A failure anywhere settles the call: the others raise
    :class:`PeerFailure` here, and the call's own agreement at its end is skipped on
    every process, since each has now agreed as often as every other.

    Every process must reach the same checkpoints in the same order (or fail before
    one, and agree with its error there); the one failure a process reports is its
    last agreement of the call."""
    call = _call.get()
    try:
        agree(what, error)
    except BaseException:
        if call is not None:
            call.settled = True
        raise
    if error is not None and call is not None:
        call.settled = True


def _delete(arrays: list[Any]) -> None:
    for array in arrays:
        array.delete()
    arrays.clear()


_WIDTH = 512  # bytes of each process's outcome: "ok", or its error's first line


def _outcome(error: BaseException | None) -> str:
    if error is None:
        return "ok"
    text = str(error).strip().splitlines()
    return f"error: {type(error).__name__}: {text[0] if text else ''}"


def _encode(text: str) -> np.ndarray:
    data = text.encode("utf-8", "replace")[: _WIDTH - 1]
    out = np.zeros(_WIDTH, np.uint8)
    out[: len(data)] = np.frombuffer(data, np.uint8)
    return out


def _decode(row: Any) -> str:
    return bytes(np.asarray(row, np.uint8)).rstrip(b"\0").decode("utf-8", "replace")


def agree(what: str, error: BaseException | None) -> None:
    """Gathers every process's outcome of a collective call and checks them.

    Every process must call it once per collective call, in the same order, whether the
    call succeeded (``error`` None) or failed; :func:`collective` does, once per
    outermost call. Returns when every process succeeded.

    Raises:
      PeerFailure: this process succeeded and another failed, or the gather itself
        failed (a process that died never reaches it); the message names each failed
        process and its error. When this process failed itself, nothing is raised
        here; the caller re-raises its own error, with a note naming the others.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    me = jax.process_index()
    try:
        rows = multihost_utils.process_allgather(_encode(_outcome(error)))
    except Exception as e:
        if error is not None:
            error.add_note(f"meshinit: could not learn the other processes' outcome: {e}")
            return
        raise PeerFailure(
            f"meshinit: {what} could not agree with the other processes (one may have died "
            f"or hung before reaching the agreement), so it fails on this one too (process "
            f"{me}), its arrays deleted: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e
    failures = [
        f"process {p} failed: {_decode(row).removeprefix('error: ')}"
        for p, row in enumerate(rows)
        if p != me and _decode(row) != "ok"
    ]
    if not failures:
        return
    summary = "; ".join(failures)
    if error is not None:
        error.add_note(f"meshinit: other processes of this {what}: {summary}")
        return
    raise PeerFailure(
        f"meshinit: {what} failed on another process, so it fails on this one too "
        f"(process {me}) and returns nothing, its arrays deleted: {summary}"
    )
