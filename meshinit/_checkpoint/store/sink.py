"""Where an export's files go: a local folder, or an ``s3://`` / ``gs://`` prefix.

A :class:`Sink` writes files by name into one place. :meth:`Sink.open` gives an
:class:`Upload`, a file written front to back: on a disk the file itself, fsynced on
:meth:`~Upload.close`; in a bucket a multipart upload (obstore's buffered writer, the
``object_store`` crate's ``BufWriter``) of parts of :data:`PART_SIZE` bytes, at most
:data:`CONCURRENCY` of them in flight, so that what an upload holds stays bounded
whatever the file's size (its parts refer to the written data; they do not copy it).
An object exists only once its upload completes: a reader never sees half of it.
:meth:`Upload.abort` removes what a failed upload left (the partial file; the
upload's parts).

Every request to a bucket runs on :mod:`.aio`'s loop within the deadline in force
where the sink was made (``aio.session(timeout)``), the client's retries included,
and is cancelled on Ctrl-C. A failure is a :class:`~meshinit.PlanError` naming the
file or object and the cause.

What the client cannot do, and what that means here:

- obstore's writer can be aborted only until it is closed. Before object_store
  0.14.2 (obstore 0.12), a part that failed *while* :meth:`Upload.close` sent the
  last ones left the parts already sent as an unfinished multipart upload, which
  nothing here can name afterwards (apache/arrow-rs-object-store#818); later
  versions abort it themselves. Close awaits the earlier parts first (all but
  ``CONCURRENCY - 1`` of them), where a failure can still be aborted; a bucket
  lifecycle rule (``AbortIncompleteMultipartUpload``) removes what may remain;
- a rename in a bucket is a server-side copy, then a delete: S3 copies at most
  5 GiB in one request, so a larger object cannot be renamed there. A multipart
  upload is already atomic: objects are best written under their final names.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import pathlib
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from ..._errors import PlanError, Problem
from . import aio as _aio
from . import clients as _clients
from .source import INDEX

T = TypeVar("T")

logger = logging.getLogger("meshinit")

PART_SIZE = 16 << 20
"""Bytes of each part of a multipart upload, the last one aside. S3 and GCS refuse
parts under 5 MiB; at :data:`MAX_PARTS` parts this size holds objects up to 160 GiB
(:meth:`Sink.open` takes larger parts for a larger ``size``)."""

MAX_PARTS = 10_000
"""The most parts one multipart upload may have (S3's and GCS's limit)."""

CONCURRENCY = 2
"""Parts of one upload in flight at once: :meth:`Upload.write` waits while as many
are being sent."""

DELETES = 16
"""Deletes in flight at once in :meth:`Sink.delete`."""

SCHEMES = {"s3": "s3", "gs": "gcs"}  # scheme -> the extra that installs its client

_MAY_REMAIN = (
    "; parts already sent may remain as an unfinished multipart upload (the client "
    "cannot abort it once closing failed): a lifecycle rule that aborts incomplete "
    "multipart uploads removes them"
)


def _close_aborts() -> bool:
    """Whether the installed client aborts a multipart upload whose last parts fail
    while it is closed (object_store 0.14.2, apache/arrow-rs-object-store#819)."""
    import obstore

    found = re.match(r"(\d+)\.(\d+)\.(\d+)", getattr(obstore, "_object_store_version", ""))
    return found is not None and tuple(map(int, found.groups())) >= (0, 14, 2)


def _is_checkpoint_file(name: str) -> bool:
    """Whether a loader takes ``name`` as part of a checkpoint (hidden files aside)."""
    return not name.startswith(".") and (name.endswith(".safetensors") or name == INDEX)


class Sink:
    """Where an export goes: a local folder (created if absent) or an ``s3://`` or
    ``gs://`` prefix, its files named as a checkpoint's are (no ``/`` in a name).

    Making one sends no request: ``storage_options`` are checked as
    :func:`meshinit.safetensors.load` checks them, against the options the installed
    ``obstore`` knows. Every later request is bounded by the deadline of the
    :func:`~meshinit._checkpoint.store.aio.session` this sink was made in (120 s by
    default), whichever thread makes it.

    Args:
      dest: a folder's path, or an ``s3://bucket[/prefix]`` or ``gs://...`` URL.
      storage_options: for a URL, the client's options (``endpoint``,
        ``access_key_id``, ``client_options``, ``retry_config``, ...); None for a
        folder.

    Raises:
      TypeError: ``dest`` is neither a path nor an ``s3://`` or ``gs://`` URL
        (``hf://`` and ``http(s)://`` included), or ``storage_options`` is not a
        mapping.
      PlanError: an option the client does not know, or one given for a folder; a
        URL that names no bucket or has an empty or ``..`` part; a folder that
        cannot be created.
      ImportError: ``obstore`` is not installed (``pip install 'meshinit[s3]'``).

    Examples:
      >>> sink = Sink("s3://bucket/llama", {"region": "us-east-1"})
      >>> with sink.open("model-00001-of-00002.safetensors", size=n) as f:
      ...     f.write(header)
      ...     f.write(array)  # its raw bytes
      >>> sink.put("model.safetensors.index.json", index_bytes)
    """

    def __init__(self, dest: str | os.PathLike, storage_options: Mapping[str, Any] | None = None):
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping or None, got {storage_options!r}")
        if isinstance(dest, str) and "://" in dest:
            scheme = dest.split("://", 1)[0].lower()
            if scheme not in SCHEMES:
                raise TypeError(
                    f"meshinit.safetensors.save writes to a local folder, s3:// or gs://, "
                    f"not {scheme}:// ({dest}): write to a folder, then upload it "
                    f"(for the Hub, huggingface_hub's upload_folder)"
                )
            self._to: _Folder | _Bucket = _Bucket(dest, scheme, dict(storage_options or {}))
        elif isinstance(dest, str | os.PathLike):
            self._to = _Folder(pathlib.Path(dest), storage_options)
        else:
            raise TypeError(f"dest must be a folder's path or an s3:// or gs:// URL, got {dest!r}")

    def __str__(self) -> str:
        return str(self._to)

    def checkpoint_files(self) -> list[str]:
        """The names in the folder (not in sub-folders) that a loader would take as a
        checkpoint's: every ``*.safetensors`` that is not hidden (``.x``), and
        ``model.safetensors.index.json``; sorted. One listing request for a bucket.

        Raises:
          PlanError: the folder or prefix cannot be listed, naming it and why.
        """
        return sorted(self._to.names())

    def open(self, name: str, *, size: int | None = None) -> Upload:
        """The file ``name``, to be written front to back (replacing any file of that
        name once closed; at once, on a disk).

        Args:
          name: the file's name in the folder.
          size: the bytes it will hold, where known: a bucket's parts then grow past
            :data:`PART_SIZE` where the object needs more than :data:`MAX_PARTS`.

        Raises:
          ValueError: ``name`` is not a plain file name, or ``size`` not a count.
          PlanError: a local file that cannot be created.
        """
        if size is not None and (not isinstance(size, int) or size < 0):
            raise ValueError(f"size is the file's bytes (an int >= 0) or None, got {size!r}")
        return self._to.open(_plain(name), size)

    def put(self, name: str, data: Any) -> None:
        """Write the small file ``name`` (an index, ``config.json``) at once: ``data``
        is bytes, a memoryview or a C-contiguous numpy array.

        Raises:
          ValueError: ``name`` is not a plain file name, or ``data`` not contiguous.
          TypeError: ``data`` has no buffer.
          PlanError: it could not be written (on a disk, the partial file is removed).
        """
        self._to.put(_plain(name), _raw(data))

    def rename(self, src: str, dst: str) -> None:
        """Give the file ``src`` the name ``dst``, replacing any file of that name: on
        a disk ``os.replace`` (atomic), in a bucket a server-side copy, then a delete
        of ``src`` (S3 copies at most 5 GiB in one request).

        Raises:
          ValueError: a name is not a plain file name.
          PlanError: it could not be renamed, naming both and why.
        """
        self._to.rename(_plain(src), _plain(dst))

    def delete(self, names: Iterable[str]) -> list[str]:
        """Delete the files ``names``, as many as can be; a name that does not exist
        is no problem. Never raises for a failure to delete.

        Returns:
          One line per file that could not be deleted, naming it and why.

        Raises:
          ValueError: a name is not a plain file name (nothing is deleted).
        """
        return self._to.delete([_plain(n) for n in names])


class Upload:
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
        view = _raw(data)
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

    def _send(self, view: memoryview) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _discard(self) -> None:
        raise NotImplementedError


def _plain(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"a file's name in an export is a plain name (no '/'), got {name!r}")
    return name


def _raw(data: Any) -> memoryview:
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


def _failed(where: str, why: str, what: str = "a file could not be written") -> PlanError:
    return PlanError([Problem(where, why)], header=f"meshinit.safetensors.save: {what}:")


# --- a local folder -----------------------------------------------------------------


def _oserror(e: OSError) -> str:
    """What an ``OSError`` while writing means, and the fix."""
    said = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ({said}): free space or write elsewhere"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{said}: give this process write access to the folder, or write elsewhere"
    return said


def _sync_folder(path: pathlib.Path) -> None:
    """The folder's entries made durable (a new or renamed file's name); best effort
    where the file system cannot sync a directory."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Folder:
    def __init__(self, path: pathlib.Path, options: Mapping[str, Any] | None) -> None:
        self.path = path
        if options:
            keys = ", ".join(map(str, options))  # not their values: keys may be secret
            why = f"storage_options ({keys}) are for s3:// and gs:// URLs; a folder takes none"
            raise _failed(str(path), why, "nothing was written")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = "is not a folder" if path.exists() else f"cannot be created: {_oserror(e)}"
            raise _failed(str(path), why, "nothing was written") from e

    def __str__(self) -> str:
        return str(self.path)

    def names(self) -> list[str]:
        try:
            with os.scandir(self.path) as entries:
                return [e.name for e in entries if _is_checkpoint_file(e.name) and not e.is_dir()]
        except OSError as e:
            why = f"cannot be listed: {_oserror(e)}"
            raise _failed(str(self.path), why, "a folder could not be listed") from e

    def open(self, name: str, size: int | None) -> Upload:
        return _FileUpload(self.path / name)

    def put(self, name: str, data: memoryview) -> None:
        upload = _FileUpload(self.path / name)
        try:
            upload.write(data)
            upload.close()
        except BaseException:
            upload.abort()
            raise

    def rename(self, src: str, dst: str) -> None:
        try:
            os.replace(self.path / src, self.path / dst)
        except OSError as e:
            why = f"cannot be renamed to {dst}: {_oserror(e)}"
            raise _failed(str(self.path / src), why, "a file could not be renamed") from e
        _sync_folder(self.path)

    def delete(self, names: list[str]) -> list[str]:
        problems = []
        for name in names:
            try:
                os.unlink(self.path / name)
            except FileNotFoundError:
                pass
            except OSError as e:
                problems.append(f"{self.path / name}: cannot be deleted: {_oserror(e)}")
        return problems


class _FileUpload(Upload):
    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(str(path))
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd: int | None = os.open(path, flags, 0o666)
        except OSError as e:
            raise _failed(str(path), f"cannot be created: {_oserror(e)}") from e

    def _send(self, view: memoryview) -> None:
        assert self.fd is not None
        done = 0
        try:
            while done < view.nbytes:  # os.write may write less than asked
                done += os.write(self.fd, view[done:])
        except OSError as e:
            raise _failed(str(self.path), f"cannot be written: {_oserror(e)}") from e

    def _finish(self) -> None:
        assert self.fd is not None
        fd, self.fd = self.fd, None
        failure: OSError | None = None
        for step in (os.fsync, os.close):  # close too may report a failed write (NFS)
            try:
                step(fd)
            except OSError as e:
                failure = failure or e
        if failure is not None:
            raise _failed(str(self.path), f"cannot be written: {_oserror(failure)}") from failure
        _sync_folder(self.path.parent)

    def _discard(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# --- a bucket -----------------------------------------------------------------------


def _said(e: BaseException) -> str:
    """The client's message, without the debug dump obstore appends, the store's
    error body cut to its code and message."""
    text = " ".join(str(e).split("Debug source:", 1)[0].split())
    head, xml, body = text.partition("<?xml")
    code = re.search(r"<Code>([^<]*)</Code>", body)
    if xml and code:
        message = re.search(r"<Message>(?:<!\[CDATA\[)?(.*?)(?:\]\]>)?</Message>", body)
        head = head if len(head) <= 300 else f"{head[:300]}..."
        text = f"{head} {code[1]}" + (f": {message[1][:200]}" if message else "")
    return f"{type(e).__name__}: {text[:500]}"


def _cause(e: BaseException, timeout: float | None) -> str:
    """What a client's error while writing means for the user, and the fix."""
    from obstore import exceptions as ox

    if isinstance(e, _aio.TimedOut):
        return (
            f"no complete answer within {timeout:g} s (retries included); a slower store "
            f"needs a larger timeout"
        )
    if any(m in str(e) for m in ("169.254.169.254", "latest/api/token", "metadata.google")):
        return (
            f"no credentials were found (the environment, then the instance metadata "
            f"service): set them as the client reads them, or give them in "
            f"storage_options= ({_said(e)[:160]})"
        )
    if isinstance(e, ox.PermissionDeniedError | ox.UnauthenticatedError):
        return (
            f"access is denied: give credentials that may write here, as the client reads "
            f"them (environment, config files) or in storage_options= ({_said(e)})"
        )
    if isinstance(e, ox.NotFoundError):
        return f"does not exist (404): check the bucket and the name ({_said(e)})"
    return _said(e)


class _Bucket:
    def __init__(self, url: str, scheme: str, options: dict[str, Any]) -> None:
        try:
            import obstore  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"meshinit.safetensors.save writes {scheme}:// URLs with obstore: "
                f"pip install 'meshinit[{SCHEMES[scheme]}]'"
            ) from e
        _, bucket, prefix = _clients.split(url)
        self.prefix = prefix.strip("/")
        self.root = f"{scheme}://{bucket}"
        self.timeout = _aio.deadline()
        wrong = _clients.problems(scheme, options)
        parts = self.prefix.split("/") if self.prefix else []
        if not bucket:
            wrong.append(f"names no bucket: {scheme}://bucket[/prefix]")
        elif any(p in ("", ".", "..") for p in parts):
            wrong.append("has an empty, '.' or '..' part in its prefix")
        if wrong:
            raise PlanError(
                [Problem(url, f"{w} (nothing was requested)") for w in wrong],
                header="meshinit.safetensors.save: nothing was written:",
            )
        try:
            self.store = _clients.bucket(scheme, bucket, options)
        except Exception as e:  # noqa: BLE001 - a value the client refuses, named
            raise _failed(url, _said(e), "nothing was written") from e

    def __str__(self) -> str:
        return f"{self.root}/{self.prefix}" if self.prefix else self.root

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str) -> str:
        return f"{self.root}/{self.key(name)}"

    def run(self, make: Callable[[], Awaitable[T]]) -> T:
        """``make()`` awaited on the loop within this sink's deadline."""

        async def call() -> T:
            return await make()

        with _aio.session(self.timeout):
            return _aio.run(call)

    def names(self) -> list[str]:
        import obstore

        try:
            listed = self.run(
                lambda: obstore.list_with_delimiter_async(self.store, self.prefix or None)
            )
        except Exception as e:  # noqa: BLE001 - the client's own error, named
            why = f"cannot be listed: {_cause(e, self.timeout)}"
            raise _failed(str(self), why, "a folder could not be listed") from e
        skip = len(self.prefix) + 1 if self.prefix else 0
        return [n for m in listed["objects"] if _is_checkpoint_file(n := str(m["path"])[skip:])]

    def open(self, name: str, size: int | None) -> Upload:
        part = max(PART_SIZE, -(-(size or 0) // MAX_PARTS))
        return _ObjectUpload(self, name, part)

    def put(self, name: str, data: memoryview) -> None:
        import obstore

        try:
            self.run(lambda: obstore.put_async(self.store, self.key(name), data,
                                               chunk_size=PART_SIZE))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the client's own error, named
            raise _failed(self.url(name), f"cannot be written: {_cause(e, self.timeout)}") from e

    def rename(self, src: str, dst: str) -> None:
        import obstore

        try:
            self.run(lambda: obstore.rename_async(self.store, self.key(src), self.key(dst)))
        except Exception as e:  # noqa: BLE001 - the client's own error, named
            why = f"cannot be renamed to {self.url(dst)}: {_cause(e, self.timeout)}"
            raise _failed(self.url(src), why, "a file could not be renamed") from e

    def delete(self, names: list[str]) -> list[str]:
        import obstore
        from obstore import exceptions as ox

        async def one(name: str, slots: asyncio.Semaphore) -> str | None:
            async with slots:
                try:
                    work = obstore.delete_async(self.store, self.key(name))
                    await _aio.bounded(work, self.timeout)
                except ox.NotFoundError:
                    return None
                except Exception as e:  # noqa: BLE001 - reported, by contract
                    return f"{self.url(name)}: cannot be deleted: {_cause(e, self.timeout)}"
                return None

        async def every() -> list[str | None]:
            slots = asyncio.Semaphore(DELETES)
            return await asyncio.gather(*(one(n, slots) for n in names))

        if not names:
            return []
        with _aio.session(None):  # each delete has its own deadline
            return [p for p in _aio.run(every) if p is not None]


class _ObjectUpload(Upload):
    """A multipart upload through obstore's buffered writer: an object smaller than
    one part is sent in one request when closed; a larger one in parts, sent as they
    fill, at most :data:`CONCURRENCY` at once."""

    def __init__(self, bucket: _Bucket, name: str, part: int) -> None:
        import obstore

        super().__init__(bucket.url(name))
        self.bucket = bucket
        self.part = part
        # no request yet: the upload starts once a part fills
        self.file: Any = obstore.open_writer_async(
            bucket.store, bucket.key(name), buffer_size=part, max_concurrency=CONCURRENCY
        )

    def _call(self, make: Callable[[], Awaitable[Any]], doing: str = "written") -> None:
        try:
            self.bucket.run(make)
        except Exception as e:  # noqa: BLE001 - the client's own error, named
            why = f"cannot be {doing}: {_cause(e, self.bucket.timeout)}"
            raise _failed(str(self), why) from e

    def _send(self, view: memoryview) -> None:
        # one part at most per call: each call waits for a free slot, within its deadline
        for start in range(0, view.nbytes, self.part):
            piece = view[start : start + self.part]
            self._call(functools.partial(self.file.write, piece))

    def _finish(self) -> None:
        # the parts sent so far awaited first (all but CONCURRENCY - 1): a failure there
        # leaves the writer open, for abort() to remove the upload
        self._call(lambda: self.file.write(b""))
        file, self.file = self.file, None  # closing consumes the writer, failed or not
        try:
            self._call(file.close)
        except PlanError as e:
            if _close_aborts() and not isinstance(e.__cause__, _aio.TimedOut):
                raise
            raise _failed(str(self), e.problems[0].message + _MAY_REMAIN) from e

    def _discard(self) -> None:
        if self.file is None:
            return  # consumed by a close that failed, which said what may remain
        failed = RuntimeError("meshinit: upload aborted")
        # the writer's __aexit__ with an exception aborts its multipart upload
        self._call(lambda: self.file.__aexit__(RuntimeError, failed, None), "aborted")
