"""Agreement between processes: a collective call succeeds everywhere or nowhere, and no
process ever waits in a collective that another process will not join.

Under ``jax.distributed`` every process runs the same ``materialize`` or ``load``, each
making its own shards. If one process fails (a bad local file, an out-of-memory, a
compile error) and the others return, their arrays lack the failed process's shards.
So every collective call runs inside :func:`collective`, and its processes agree:

- **Out of band.** Agreements go through the coordination service's key-value store
  (``jax.distributed``'s client), never through a device collective: gloo pairs
  collectives by order and message size alone, so an agreement sent on the data's
  channel could swap bytes with a reshard of the same size, and both would return.
  Each agreement is a key ``meshinit/agree/<call>/<k>/<process>``: the call's number
  (every process makes the same collective calls in the same order), the agreement's
  number within it, and what it closes (``"meshinit.safetensors.load: batch 3"``),
  which every process compares.
- **A failure is posted at once**, under ``meshinit/agree/<call>/failed/<process>``,
  by the process that failed, anywhere in the call; it then enters no further
  collective. The others raise :class:`~meshinit.PeerFailure` naming it at their next
  agreement (:func:`checkpoint`, or the call's end), or, if they are waiting for a
  collective program (:func:`settle`), as soon as its failure says that it left its
  collectives unfinished.
- **Inputs agreed before the first collective.** A checkpoint may carry ``facts``
  (the arguments and plan-derived choices that shape the collectives): any that
  differ between processes are a :class:`~meshinit.PlanError` on every process,
  naming each and every process's value, before a collective starts.
- **Broken collectives are never reused.** A process left waiting in a collective
  that a peer will never join (the peer could not start it, or died) cannot take
  that collective back: it raises, and the job's collectives are marked broken
  (:func:`broken`), here and in the store, so that every later collective call on
  every process raises instead of pairing with the stranded one.

A killed process posts nothing. The others learn of it when their collective fails
(gloo: "connection closed by peer") or, waiting at an agreement, when jax's
coordination service stops the job: after ``heartbeat_timeout_seconds`` (an argument
of ``jax.distributed.initialize``, 100 s by default) jax aborts every process. A killed
coordinator (process 0) makes jax abort every other process at once.

Nested calls (an adapter's init runs ``run_plan``) join the outer call's agreement; what
they made is handed to it (:func:`keep`), to be deleted if any process failed.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
import json
import logging
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax

from .._errors import PeerFailure, PlanError, Problem
from .._jax import compat as _compat

PREFIX = "meshinit/agree"
"""Where the agreements live in the coordination service's key-value store."""

WAIT_NOTICE_S = 60.0
"""How long an agreement waits before it logs which processes it still waits for
(and again each time as long): a slow peer is waited for, never given up on; a dead
one ends the job through jax's heartbeat."""

PEERS_S = 2.0
"""How long a process whose collective failed waits for the others' failures, to name
them: one that posted none by then is named as killed or hung."""

_log = logging.getLogger("meshinit")


class _Call:
    """The outermost collective call in progress: its number (the same on every
    process), its agreements so far, the arrays it made, and whether this process left
    a collective unfinished (it could not start one, or one failed)."""

    def __init__(self, what: str, number: int) -> None:
        self.what = what
        self.number = number
        self.agreed = 0
        self.made: list[Any] = []
        self.posted = False  # this process's failure is in the store
        self.left = False
        self.keys: list[str] = []  # what it set in the store


_call: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "meshinit collective call", default=None
)
# Process state, as jax.distributed's own is: the number of the next collective call,
# the keys this process set in calls every process has since left, and why this
# process's collectives can no longer be trusted (None while they can).
_numbers = itertools.count()
_stale: list[str] = []
_broken: list[str] = []


def _multi() -> Any:
    """The coordination service's client where more than one process runs, else None."""
    if jax.process_count() == 1:
        return None
    client = _compat.distributed_client()
    if client is None:  # several processes without jax.distributed: nothing to agree on
        return None
    return client


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """One collective call: on every process, exactly one :func:`agree`, at its end.

    The outermost ``collective`` agrees when its block ends: with its error if it
    raised (everything before allocating included: checking arguments, tracing a
    factory, planning), else with success. If any process failed, the arrays handed to
    :func:`keep` are deleted and every process raises. A ``collective`` inside another
    one does nothing of its own: the outer one agrees for both.

    Args:
      what: the call's name in messages (``"meshinit.nnx.init"``).

    Raises:
      PeerFailure: this process succeeded and another failed (see :func:`agree`), or
        the job's collectives were left broken by an earlier call.
    """
    if _call.get() is not None:
        yield
        return
    call = _Call(what, next(_numbers) if _multi() is not None else 0)
    token = _call.set(call)
    try:
        try:
            if _broken:
                raise PeerFailure(_broken_message(what, _broken[0]))
            yield
        except BaseException as e:
            _delete(call.made)
            agree(what, e)
            raise
        try:
            agree(what, None)
        except BaseException:
            _delete(call.made)
            raise
    finally:
        _call.reset(token)
        _stale.extend(call.keys)  # deleted once every process has moved on


def keep(arrays: Iterable[Any]) -> None:
    """Hands arrays made inside a :func:`collective` call to it, to be deleted if the
    call fails, here or on any other process. Outside one it does nothing."""
    call = _call.get()
    if call is not None:
        call.made.extend(arrays)


def checkpoint(what: str, at: str = "", facts: Mapping[str, str] | None = None) -> None:
    """An agreement inside a collective call, before work that every process must join
    (a collective program): returns when every process got this far with the same
    ``at`` and ``facts``.

    Raises:
      PeerFailure: another process failed (it posted its failure).
      PlanError: the processes disagree on ``facts`` (every process raises it, naming
        each fact and every process's value), or arrived at different agreements.
    """
    call = _call.get()
    client = _multi()
    if call is None or client is None:
        return
    _meet(client, call, at or what, dict(facts or {}))


def digest(items: Sequence[Any]) -> str:
    """A short fingerprint of ``items`` (their reprs, which name meshes by device ids),
    with their count: a fact that processes compare where the values are long."""
    text = "\n".join(map(repr, items))
    return f"{len(items)} items, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def agree(what: str, error: BaseException | None) -> None:
    """The end of a collective call, on this process: with ``error`` None, waits until
    every process ended it well (or one failed); else posts this process's failure for
    the others and returns (the caller raises ``error``, with a note naming the other
    processes' failures known so far).

    Every process calls it once per collective call; :func:`collective` does, once per
    outermost call.

    Raises:
      PeerFailure: this process succeeded and another failed; the message names each
        failed process and its error.
    """
    call = _call.get()
    client = _multi()
    if call is None or client is None:
        return
    if error is None:
        _meet(client, call, "end", {})
        return
    _post_failure(client, call, error)
    others = _failures(client, call)
    if others:
        error.add_note(f"meshinit: other processes of this {what}: {_summary(others)}")


def left_collectives(error: BaseException) -> None:
    """This process could not finish a collective that its peers are in (it could not
    start one, or one failed under it): its failure says so, so that peers waiting
    in that collective stop waiting, and every later collective call raises
    (:func:`broken`)."""
    call = _call.get()
    if call is not None:
        call.left = True
    _break(f"{type(error).__name__}: {_first_line(error)}")


def broken() -> str | None:
    """Why this process's collectives can no longer be trusted, or None."""
    return _broken[0] if _broken else None


def settle(made: jax.Array, at: str) -> None:
    """Waits for ``made``, the output of a collective program, watching the store: it
    returns once the program has finished well. If the program fails (a peer died: gloo
    says "connection closed by peer"), or a peer posts that it left its collectives
    unfinished, this raises :class:`~meshinit.PeerFailure` naming the failed and the
    silent processes, and the job's collectives are broken (:func:`left_collectives`).

    Where one process's peer died, gloo tells at once only the processes that talk to
    it directly; the others would wait until their own neighbours close their
    connections (process 0 waited 30 s). Watching the store, they learn of it from the
    first process that did."""
    client = _multi()
    call = _call.get()
    if client is None or call is None:
        made.block_until_ready()
        return
    delay, checked = 0.0005, time.monotonic()
    pending: Any = made  # jax.Array.is_ready: in jax's arrays, not in its type stubs
    while not pending.is_ready():
        time.sleep(delay)
        delay = min(2 * delay, 0.01)
        if time.monotonic() - checked > 0.05:
            checked = time.monotonic()
            failed = _failures(client, call)
            if any(f["left"] for f in failed.values()):
                error = PeerFailure(_stranded(call, at, failed))
                left_collectives(error)
                raise error
    try:
        made.block_until_ready()
    except Exception as e:
        left_collectives(e)
        _post_failure(client, call, e, secondary=True)  # the cause is another process
        failed = _others_for(client, call, time.monotonic() + PEERS_S)
        raise PeerFailure(_stranded(call, at, failed, e)) from e


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Ctrl-C (SIGINT) is held back inside the block, and delivered when it ends: a
    batch of collectives that every process agreed to run is run whole, so that no
    peer is left waiting in one that this process never enters. Off the main thread
    (where Python delivers no signal) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[Any] = []
    try:
        before = signal.signal(signal.SIGINT, lambda signum, frame: got.append(frame))
    except ValueError:  # an embedding interpreter that owns the signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if before is None else before)
        if got:
            if callable(before):
                before(signal.SIGINT, got[0])
            elif before != signal.SIG_IGN:
                raise KeyboardInterrupt


# ---------------------------------------------------------------------------- the store


def _key(call: _Call, *parts: object) -> str:
    return "/".join((PREFIX, str(call.number), *map(str, parts)))


def _meet(client: Any, call: _Call, at: str, facts: dict[str, str]) -> None:
    """One agreement of ``call``: posts where this process is, waits for every other
    process's post there (or a failure), then compares them."""
    me, count = jax.process_index(), jax.process_count()
    k = call.agreed
    call.agreed += 1
    label = f"{call.what}: {at}"
    key = _key(call, k, me)
    client.key_value_set(key, json.dumps({"at": label, "facts": facts}))
    call.keys.append(key)
    posts: dict[int, dict[str, Any]] = {me: {"at": label, "facts": facts}}
    started = noticed = time.monotonic()
    delay = 0.0005
    while True:
        posts.update(_read(client, call, k))
        if len(posts) == count:  # a failure posted after this point is met at the next
            break
        failed = _failures(client, call)
        if failed:
            # A peer that failed after this agreement (a PlanError on its facts) saw every
            # post: posts read again after its failure are complete, and this process
            # compares them as it did, rather than naming its error second-hand.
            posts.update(_read(client, call, k))
            if len(posts) == count:
                break
            raise PeerFailure(
                f"meshinit: {call.what} failed on another process, so it fails on this one "
                f"too (process {me}) and returns nothing, its arrays deleted: "
                f"{_summary(failed)}"
            )
        if time.monotonic() - noticed > WAIT_NOTICE_S:
            noticed = time.monotonic()
            waiting = sorted(set(range(count)) - set(posts))
            _log.warning(
                "meshinit: %s has waited %.0f s for processes %s to reach %r; a process "
                "that died ends the job after jax.distributed's heartbeat_timeout_seconds",
                call.what,
                noticed - started,
                waiting,
                label,
            )
        time.sleep(delay)
        delay = min(2 * delay, _poll_s(count))
    if k == 0:
        _first_agreement(client, call)
    _compare(call, label, posts)


def _poll_s(count: int) -> float:
    """The longest pause between two reads of the store while waiting: 20 ms, longer in
    a large job, where every process reads it (about 800 reads a second in all)."""
    return 0.02 * max(1.0, count / 16)


def _first_agreement(client: Any, call: _Call) -> None:
    """Every process has reached this call: keys of earlier calls are read by none any
    more (this process's go), and a process whose collectives broke since stops all."""
    for key in _stale:
        with contextlib.suppress(Exception):
            client.key_value_delete(key)
    _stale.clear()
    marks = client.key_value_dir_get(f"{PREFIX}/broken/")
    if marks:
        key, why = sorted(marks)[0]
        raise PeerFailure(_broken_message(call.what, f"process {key.rsplit('/', 1)[-1]}: {why}"))


def _compare(call: _Call, label: str, posts: dict[int, dict[str, Any]]) -> None:
    count = len(posts)
    labels = {p: posts[p]["at"] for p in range(count)}
    if len(set(labels.values())) > 1:
        where = ", ".join(f"process {p} at {v!r}" for p, v in labels.items())
        raise PlanError(
            [Problem(call.what, f"the processes reached different agreements: {where}")],
            header=f"{call.what}: the processes run different calls, so none goes on "
            f"(call every collective function on every process, in the same order):",
        )
    problems = []
    names = dict.fromkeys(n for p in range(count) for n in posts[p]["facts"])
    for name in names:
        values = [posts[p]["facts"].get(name, "(not given)") for p in range(count)]
        if len(set(values)) > 1:
            each = ", ".join(f"process {p}: {v}" for p, v in enumerate(values))
            problems.append(Problem(name, f"differs between the processes: {each}"))
    if problems:
        raise PlanError(
            problems,
            header=f"{call.what}: the processes disagree on what shapes the collectives, "
            f"so none ran (pass every process the same arguments):",
        )


def _read(client: Any, call: _Call, where: object) -> dict[int, dict[str, Any]]:
    """The posts of agreement ``where`` of the call (or its failures: ``"failed"``), by
    process: one directory of the store, as many keys as processes at most."""
    out: dict[int, dict[str, Any]] = {}
    for key, value in client.key_value_dir_get(_key(call, where) + "/"):
        try:
            out[int(key.rsplit("/", 1)[1])] = json.loads(value)
        except ValueError:
            continue  # not meshinit's: never a key it reads
    return out


def _failures(client: Any, call: _Call) -> dict[int, dict[str, Any]]:
    me = jax.process_index()
    return {p: f for p, f in _read(client, call, "failed").items() if p != me}


def _others_for(client: Any, call: _Call, deadline: float) -> dict[int, dict[str, Any]]:
    """The other processes' failures once each has posted one, or at ``deadline``."""
    while True:
        failed = _failures(client, call)
        if len(failed) == jax.process_count() - 1 or time.monotonic() > deadline:
            return failed
        time.sleep(0.02)


def _post_failure(client: Any, call: _Call, error: BaseException, secondary: bool = False) -> None:
    """Posts this process's failure of ``call`` (once): ``peer`` where it followed
    another process's (named first in messages), ``left`` where this process left a
    collective unfinished."""
    if call.posted:
        return
    call.posted = True
    post = {
        "error": _outcome(error),
        "peer": secondary or isinstance(error, PeerFailure),
        "left": call.left,
    }
    key = _key(call, "failed", jax.process_index())
    client.key_value_set(key, json.dumps(post), allow_overwrite=True)
    call.keys.append(key)


def _break(why: str) -> None:
    if _broken:
        return
    _broken.append(why)
    client = _multi()
    if client is not None:
        with contextlib.suppress(Exception):
            client.key_value_set(f"{PREFIX}/broken/{jax.process_index()}", why, True)


def _broken_message(what: str, why: str) -> str:
    return (
        f"meshinit: {what} cannot run: an earlier collective call left a collective "
        f"unfinished ({why}), so the processes' collectives no longer pair up; restart "
        f"the job (every process)"
    )


def _stranded(
    call: _Call,
    at: str,
    failed: dict[int, dict[str, Any]],
    error: BaseException | None = None,
) -> str:
    me, count = jax.process_index(), jax.process_count()
    silent = [p for p in range(count) if p != me and p not in failed]
    said = [_summary(failed)] if failed else []
    if silent:
        which = ", ".join(map(str, silent))
        said.append(f"process {which} posted no outcome (killed, or hung)")
    own = f" ({type(error).__name__}: {_first_line(error)})" if error is not None else ""
    return (
        f"meshinit: {call.what} lost a peer inside a collective at {at}{own}, so it fails "
        f"on this one too (process {me}) and returns nothing, its arrays deleted: "
        f"{'; '.join(said)}. The job's collectives cannot be used again: restart it"
    )


def _summary(failed: dict[int, dict[str, Any]]) -> str:
    first = {p: f for p, f in failed.items() if not f.get("peer")} or failed
    return "; ".join(f"process {p} failed: {f['error']}" for p, f in sorted(first.items()))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else ""


def _outcome(error: BaseException) -> str:
    return f"{type(error).__name__}: {_first_line(error)}"[:2000]


def _delete(arrays: list[Any]) -> None:
    for array in arrays:
        if not array.is_deleted():
            array.delete()
    arrays.clear()
