"""An export's local folder (:class:`Folder`) and its files (:class:`FileUpload`):
written in place, fsynced on close, the folder synced after each rename."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

from .upload import Upload, failed, is_checkpoint_file, oserror


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


class Folder:
    def __init__(self, path: pathlib.Path, options: Mapping[str, Any] | None) -> None:
        self.path = path
        if options:
            keys = ", ".join(map(str, options))  # not their values: keys may be secret
            why = f"storage_options ({keys}) are for s3:// and gs:// URLs; a folder takes none"
            raise failed(str(path), why, "nothing was written")
        if path.exists() and not path.is_dir():
            raise failed(str(path), "is not a folder", "nothing was written")

    def _made(self) -> None:
        """The folder, created at the first write (a refused export leaves none)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = "is not a folder" if self.path.exists() else f"cannot be created: {oserror(e)}"
            raise failed(str(self.path), why, "nothing was written") from e

    def __str__(self) -> str:
        return str(self.path)

    def names(self) -> list[str]:
        if not self.path.exists():
            return []
        try:
            with os.scandir(self.path) as entries:
                return [e.name for e in entries if is_checkpoint_file(e.name) and not e.is_dir()]
        except OSError as e:
            why = f"cannot be listed: {oserror(e)}"
            raise failed(str(self.path), why, "a folder could not be listed") from e

    def open(self, name: str, size: int | None) -> Upload:
        self._made()
        return FileUpload(self.path / name)

    def put(self, name: str, data: memoryview) -> None:
        self._made()
        upload = FileUpload(self.path / name)
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
            why = f"cannot be renamed to {dst}: {oserror(e)}"
            raise failed(str(self.path / src), why, "a file could not be renamed") from e
        _sync_folder(self.path)

    def delete(self, names: list[str]) -> list[str]:
        problems = []
        for name in names:
            try:
                os.unlink(self.path / name)
            except FileNotFoundError:
                pass
            except OSError as e:
                problems.append(f"{self.path / name}: cannot be deleted: {oserror(e)}")
        return problems


class FileUpload(Upload):
    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(str(path))
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd: int | None = os.open(path, flags, 0o666)
        except OSError as e:
            raise failed(str(path), f"cannot be created: {oserror(e)}") from e

    def _send(self, view: memoryview) -> None:
        assert self.fd is not None
        done = 0
        try:
            while done < view.nbytes:  # os.write may write less than asked
                done += os.write(self.fd, view[done:])
        except OSError as e:
            raise failed(str(self.path), f"cannot be written: {oserror(e)}") from e

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
            raise failed(str(self.path), f"cannot be written: {oserror(failure)}") from failure
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
