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

import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from .sink_bucket import SCHEMES, Bucket
from .sink_local import Folder
from .upload import Upload, plain, raw


class Sink:
    """Where an export goes: a local folder (created at the first write) or an ``s3://`` or
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
      >>> with sink.open("model-00001-of-00002.safetensors", size=n) as f:  # doctest: +SKIP
      ...     f.write(header)
      ...     f.write(array)  # its raw bytes
      >>> sink.put("model.safetensors.index.json", index_bytes)  # doctest: +SKIP

      (A bucket to write to: not run in the tests.)
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
            self._to: Folder | Bucket = Bucket(dest, scheme, dict(storage_options or {}))
        elif isinstance(dest, str | os.PathLike):
            self._to = Folder(pathlib.Path(dest), storage_options)
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

    @property
    def renames_atomically(self) -> bool:
        """Whether :meth:`rename` is atomic and copies nothing (a folder: ``os.replace``);
        in a bucket it is a server-side copy, then a delete, and an object appears only
        once its upload is closed, so a file meant to appear last is closed last."""
        return isinstance(self._to, Folder)

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
        return self._to.open(plain(name), size)

    def put(self, name: str, data: Any) -> None:
        """Write the small file ``name`` (an index, ``config.json``) at once: ``data``
        is bytes, a memoryview or a C-contiguous numpy array.

        Raises:
          ValueError: ``name`` is not a plain file name, or ``data`` not contiguous.
          TypeError: ``data`` has no buffer.
          PlanError: it could not be written (on a disk, the partial file is removed).
        """
        self._to.put(plain(name), raw(data))

    def rename(self, src: str, dst: str) -> None:
        """Give the file ``src`` the name ``dst``, replacing any file of that name: on
        a disk ``os.replace`` (atomic), in a bucket a server-side copy, then a delete
        of ``src`` (S3 copies at most 5 GiB in one request).

        Raises:
          ValueError: a name is not a plain file name.
          PlanError: it could not be renamed, naming both and why.
        """
        self._to.rename(plain(src), plain(dst))

    def delete(self, names: Iterable[str]) -> list[str]:
        """Delete the files ``names``, as many as can be; a name that does not exist
        is no problem. Never raises for a failure to delete.

        Returns:
          One line per file that could not be deleted, naming it and why.

        Raises:
          ValueError: a name is not a plain file name (nothing is deleted).
        """
        return self._to.delete([plain(n) for n in names])
