"""A checkpoint's file on a local disk: the :class:`~meshinit._checkpoint.store.source.Source` that
is
opened only once it is known to be a regular file, checked, and mapped again (known to
be the file checked) for each parameter that reads it."""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import stat
from typing import Any

from ..._errors import PlanError, Problem
from . import header as _header
from .source import Source, Stored


@dataclasses.dataclass(frozen=True)
class LocalFile(Source):
    """A file on a local disk, known by its path; who it was when checked is its
    device, inode, size and modification time."""

    path: pathlib.Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def shown(self) -> pathlib.Path:
        return self.path

    def __str__(self) -> str:
        return str(self.path)

    def check(self) -> tuple[Any, dict[str, Stored], list[str]]:
        path = self.path
        f, st, why = open_regular(path)
        if why is not None:
            return None, {}, [why]
        assert f is not None and st is not None
        with f:  # closed before the package opens the file: one descriptor at a time
            tensors, problems = _header.parse(f, st.st_size, self)
        if not problems:
            problems = _header.package_agrees(path, tensors)
            if not problems and identity(os.stat(path)) != identity(st):
                problems = ["changed while it was being checked; load it again once it is written"]
        if problems:
            return None, {}, problems
        return identity(st), tensors, []

    def contents(self, limit: int, what: str) -> tuple[bytes | None, str | None]:
        f, st, why = open_regular(self.path)
        if why is not None:
            if not self.path.exists() and not self.path.is_symlink():
                return None, None
            return None, why
        assert f is not None and st is not None
        with f:
            if st.st_size > limit:
                return None, f"is over {limit} bytes: not {what}"
            return f.read(limit + 1), None

    def changed(self, checked: Any) -> str | None:
        try:
            now = identity(os.stat(self.path))
        except OSError:
            now = None
        return None if now == checked else "changed since it was checked; load again"

    def mapping(self, checked: Any, start: int, end: int) -> Any:
        try:
            with self._reopen(checked) as f:
                return mmap.mmap(f.fileno(), end - start, access=mmap.ACCESS_READ, offset=start)
        except OSError as e:
            raise PlanError([Problem(str(self), _header.failed(e))], header=_OPEN_HEADER) from e

    def _reopen(self, checked: Any) -> Any:
        """The file opened again, known to be the file that was checked."""
        f, st, why = open_regular(self.path)
        if f is not None and st is not None and identity(st) == checked:
            return f
        if f is not None:
            f.close()
        raise PlanError(
            [Problem(str(self), why or "changed since it was checked; load again")],
            header="meshinit.safetensors.load: a file changed while it was read (nothing loaded):",
        )


_OPEN_HEADER = "meshinit.safetensors.load: a file could not be mapped (nothing loaded):"


def identity(st: os.stat_result) -> tuple[int, ...]:
    """Who a file is: its device, inode, size and modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: pathlib.Path) -> tuple[Any, os.stat_result | None, str | None]:
    """``path`` opened for reading if it is a regular file: ``(file, its stat, None)``,
    else ``(None, None, why)``. Its type is known before it is opened (opening a FIFO
    blocks until a writer comes), and it is opened without blocking and checked again,
    in case it was replaced in between."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            target = os.readlink(path)
            return (
                None,
                None,
                f"is a link to {target}, which does not exist: an incomplete download "
                f"(the Hugging Face cache links each file to a blob)? Download it again",
            )
        return None, None, "cannot be opened: No such file or directory"
    except OSError as e:
        return None, None, f"cannot be opened: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return None, None, f"is {_kind_of(st.st_mode)}, not a regular file"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        return None, None, _header.failed(e)
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        return None, None, f"is {_kind_of(st.st_mode)}, not a regular file"
    return f, st, None
