"""Agreement between processes: a collective call succeeds everywhere or nowhere.

Under ``jax.distributed`` every process runs the same ``materialize``, each making its
own shards. If one process fails (a bad local memory check, an out-of-memory, a
compile error) and the others return, their arrays lack the failed process's shards,
and the next collective hangs until gloo's or NCCL's deadline, saying nothing of the
cause. So each call ends with :func:`agree`: every process posts its outcome to the
distributed runtime's key-value store and reads every other's, with a bound on the
wait, and a failure anywhere is raised everywhere, naming the process and its error.

The store is jax's own distributed client (``jax._src.distributed``, the one private
jax name meshinit reads, as ``jax.experimental.multihost_utils`` does): device
collectives could not be used, since a process that failed may never reach one.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import jax

from ._errors import PeerFailure

TIMEOUT_ENV = "MESHINIT_AGREE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # a slow peer (a larger compile, a loaded host) is not a dead one

_counter = itertools.count()
_counter_lock = threading.Lock()


def _client() -> Any:
    try:
        from jax._src import distributed
    except ImportError:  # another jax: no agreement, as before
        return None
    return distributed.global_state.client


def timeout_s() -> float:
    """How long a process waits for the others' outcome (``MESHINIT_AGREE_TIMEOUT_S``)."""
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _outcome(error: BaseException | None) -> str:
    if error is None:
        return "ok"
    text = str(error).strip().splitlines()
    return f"error: {type(error).__name__}: {text[0] if text else ''}"[:500]


def agree(what: str, error: BaseException | None) -> None:
    """Posts this process's outcome of a collective call and checks every other's.

    Every process must call it once per collective call, in the same order, whether the
    call succeeded (``error`` None) or failed. Returns when every process succeeded.

    Raises:
      PeerFailure: this process succeeded and another failed or did not report within
        :func:`timeout_s`; the message names each such process and its error. When
        this process failed itself, nothing is raised here; the caller re-raises its
        own error, to which a note naming the other failures is added.
    """
    if jax.process_count() == 1:
        return
    client = _client()
    if client is None:
        return
    with _counter_lock:
        n = next(_counter)
    me = jax.process_index()
    prefix = f"meshinit/{what}"
    client.key_value_set(f"{prefix}/{n}/{me}", _outcome(error))
    if n >= 2:  # every process has read call n-2 by now: it reached call n-1's agreement
        try:
            client.key_value_delete(f"{prefix}/{n - 2}/{me}")
        except Exception:  # the store is best effort; the outcome is what matters
            pass
    # A process that failed only reads what is there already, for its note: it raises
    # its own error at once, and the others learn of it from its post.
    wait_ms = int(timeout_s() * 1000) if error is None else 2000
    failures = []
    for p in range(jax.process_count()):
        if p == me:
            continue
        try:
            outcome = client.blocking_key_value_get(f"{prefix}/{n}/{p}", wait_ms)
        except Exception:
            if error is None:
                failures.append(
                    f"process {p} did not report within {timeout_s():.0f} s (it died, hung, "
                    f"or runs other calls; {TIMEOUT_ENV} sets the wait)"
                )
            continue
        if outcome != "ok":
            failures.append(f"process {p} failed: {outcome.removeprefix('error: ')}")
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
