"""What every destination of an export shares: :class:`Upload`, a file written front
to back (a local file, :mod:`.sink_local`; a multipart upload, :mod:`.sink_bucket`),
and how their failures are said."""

from __future__ import annotations

import abc
import errno
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._errors import PlanError, Problem
from .source import INDEX

logger = logging.getLogger("meshinit")


def is_checkpoint_file(name: str) -> bool:
    """Whether a loader takes ``name`` as part of a checkpoint (hidden files aside)."""
    return not name.startswith(".") and (name.endswith(".safetensors") or name == INDEX)


class Upload(abc.ABC):
    """One file being written front to back; a context manager that closes it, or
    aborts it where the block or the close raised. One thread at a time uses it:
    abort it from another thread only once the writing thread has stopped.

    Attributes:
      written: the bytes written so far.
    """

    def __init__(self, where: str) -> None:
        self._where = where
        self._state = "open"  # then "closed", "failed" or "aborted"
        self.written = 0

    def __str__(self) -> str:
        return self._where

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:
            self.abort()
            raise

    def write(self, data: Any) -> None:
        """Append ``data``'s raw bytes: bytes, a memoryview, or a C-contiguous numpy
        array (any dtype; no copy is made). Blocks while :data:`CONCURRENCY` parts are
        being sent. In a bucket the bytes are sent later, from ``data`` itself: leave
        it unchanged until :meth:`close` or :meth:`abort` returns.

        Raises:
          TypeError: ``data`` has no buffer.
          ValueError: ``data`` is not contiguous, or the upload is closed, aborted or
            failed.
          PlanError: it could not be written (a network error or a 5xx after the
            client's retries, access denied, a full disk, the deadline), naming it.
        """
        self._usable("write to")
        view = raw(data)
        if view.nbytes:
            self._guarded(self._send, view)
            self.written += view.nbytes

    def close(self) -> int:
        """Finish the file (on a disk: fsync; in a bucket: the last parts sent and
        the upload completed): it exists under its name from now on. Calling it again
        does nothing.

        Returns:
          The bytes written.

        Raises:
          ValueError: the upload was aborted or failed.
          PlanError: it could not be finished, naming it and why.
        """
        if self._state == "closed":
            return self.written
        self._usable("close")
        self._guarded(self._finish)
        self._state = "closed"
        return self.written

    def abort(self) -> None:
        """After a failure: remove what the upload left (the partial file; the
        multipart upload's parts). Does nothing after :meth:`close` or a first abort;
        never raises (what it could not remove is logged)."""
        if self._state in ("closed", "aborted"):
            return
        self._state = "aborted"
        try:
            self._discard()
        except Exception as e:  # noqa: BLE001 - best effort, by contract
            logger.warning("meshinit.safetensors.save: could not remove %s: %s", self, e)

    def _usable(self, doing: str) -> None:
        if self._state != "open":
            fix = "; abort() it" if self._state == "failed" else ""
            raise ValueError(f"cannot {doing} {self}: the upload is {self._state}{fix}")

    def _guarded(self, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
        except BaseException:
            self._state = "failed"
            raise

    @abc.abstractmethod
    def _send(self, view: memoryview) -> None:
        """Writes ``view``'s bytes after those written before."""

    @abc.abstractmethod
    def _finish(self) -> None:
        """Makes the file what was written (a local file synced; an upload completed)."""

    @abc.abstractmethod
    def _discard(self) -> None:
        """Removes what was written (the partial file; the upload's parts)."""


def plain(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"a file's name in an export is a plain name (no '/'), got {name!r}")
    return name


def raw(data: Any) -> memoryview:
    """``data``'s bytes as a flat byte view, not copied."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError(
                f"a {data.dtype} array of shape {data.shape} is not C-contiguous (its buffer "
                f"is not its values in order): pass np.ascontiguousarray(x)"
            )
        return data.reshape(-1).view(np.uint8).data
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(
            f"an export writes bytes, a memoryview or a numpy array, got {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("a memoryview that is not C-contiguous: pass a contiguous copy")
    return view if (view.format, view.ndim) == ("B", 1) else view.cast("B")


def failed(where: str, why: str, what: str = "a file could not be written") -> PlanError:
    return PlanError([Problem(where, why)], header=f"meshinit.safetensors.save: {what}:")


# --- a local folder -----------------------------------------------------------------


def oserror(e: OSError) -> str:
    """What an ``OSError`` while writing means, and the fix."""
    said = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ({said}): free space or write elsewhere"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{said}: give this process write access to the folder, or write elsewhere"
    return said
