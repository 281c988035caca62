"""An export's ``s3://`` or ``gs://`` prefix (:class:`Bucket`) and its objects
(:class:`ObjectUpload`, a multipart upload through obstore's buffered writer), every
request on :mod:`.aio`'s loop within the sink's deadline."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..._errors import PlanError, Problem
from . import aio as _aio
from . import clients as _clients
from .upload import Upload, failed, is_checkpoint_file

T = TypeVar("T")

SCHEMES = {"s3": "s3", "gs": "gcs"}  # scheme -> the extra that installs its client

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


class Bucket:
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
            raise failed(url, _said(e), "nothing was written") from e

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
            raise failed(str(self), why, "a folder could not be listed") from e
        skip = len(self.prefix) + 1 if self.prefix else 0
        return [n for m in listed["objects"] if is_checkpoint_file(n := str(m["path"])[skip:])]

    def open(self, name: str, size: int | None) -> Upload:
        part = max(PART_SIZE, -(-(size or 0) // MAX_PARTS))
        return ObjectUpload(self, name, part)

    def put(self, name: str, data: memoryview) -> None:
        import obstore

        try:
            self.run(lambda: obstore.put_async(self.store, self.key(name), data,
                                               chunk_size=PART_SIZE))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the client's own error, named
            raise failed(self.url(name), f"cannot be written: {_cause(e, self.timeout)}") from e

    def rename(self, src: str, dst: str) -> None:
        import obstore

        try:
            self.run(lambda: obstore.rename_async(self.store, self.key(src), self.key(dst)))
        except Exception as e:  # noqa: BLE001 - the client's own error, named
            why = f"cannot be renamed to {self.url(dst)}: {_cause(e, self.timeout)}"
            raise failed(self.url(src), why, "a file could not be renamed") from e

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


class ObjectUpload(Upload):
    """A multipart upload through obstore's buffered writer: an object smaller than
    one part is sent in one request when closed; a larger one in parts, sent as they
    fill, at most :data:`CONCURRENCY` at once."""

    def __init__(self, bucket: Bucket, name: str, part: int) -> None:
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
            raise failed(str(self), why) from e

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
            raise failed(str(self), e.problems[0].message + _MAY_REMAIN) from e

    def _discard(self) -> None:
        if self.file is None:
            return  # consumed by a close that failed, which said what may remain
        failed = RuntimeError("meshinit: upload aborted")
        # the writer's __aexit__ with an exception aborts its multipart upload
        self._call(lambda: self.file.__aexit__(RuntimeError, failed, None), "aborted")
