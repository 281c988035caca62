"""safetensors files and folders, checked before a byte of data is read.

:func:`listing` finds a checkpoint's files (only those its index lists, where it has
one); :func:`check` opens each only once it is known to be a regular file, has
:mod:`.header` parse and check its header, then asks the ``safetensors`` package to
open it: it refuses exactly what the format refuses, and its word is final.
meshinit's own checks say precisely what is wrong, refuse a name given twice (the
format forbids it; ``safetensors`` keeps the last one silently), and make the offsets
meshinit reads by its own parse safe to read: the package does not expose offsets,
and the per-shard reads need them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import stat
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .._errors import Problem, printable
from . import header as _header
from . import remote as _remote
from .header import BITS as BITS
from .header import MAX_HEADER as MAX_HEADER
from .header import READABLE as READABLE
from .header import Stored as Stored
from .header import failed as failed

logger = logging.getLogger("meshinit")

INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Checked:
    """A file that passed every check: its tensors, and who it was when checked (a
    file replaced or rewritten since is refused when it is read)."""

    path: pathlib.Path | _remote.Remote
    identity: tuple[Any, ...]  # a file's device, inode, size and mtime; an object's ETag
    tensors: Mapping[str, Stored]


def identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Listing(NamedTuple):
    """The files to check, and what the folder's listing found."""

    paths: list[pathlib.Path | _remote.Remote]
    problems: list[Problem]
    directory: str | None = None  # the folder (a path or URL) ``files`` named
    weight_map: dict[str, str] | None = None  # its index's, where it has one
    # where the checkpoint's config.json is: a file or object the listing saw, the
    # URL of one beside a file URL (asked only when a load needs it), or None
    config: pathlib.Path | _remote.Remote | str | None = None


def listing(files: Any, options: Mapping[str, Any] | None = None) -> Listing:
    """The files of ``files``, and the problems of a folder's listing: a path or URL,
    a sequence of them, or a folder (a directory, or a URL of object storage or the
    Hub, listed with ``options``). A folder's ``*.safetensors`` entries are taken and
    hidden ones (macOS's ``._x`` AppleDouble files, editors' swap files) skipped;
    where its ``model.safetensors.index.json`` is, only the files the index lists (as
    transformers reads a sharded checkpoint), the others left with a warning.
    Directories in a directory are passed over; any other entry that is not a regular
    file (a dangling link, a FIFO) stays in the list for :func:`check` to name: no
    weight file is left out without a word."""
    if _remote.is_url(files):
        folder = _remote.listing(files, options)
        weight_map, problems = None, list(folder.problems)
        if folder.index is not None:
            weight_map, problems = _remote_index(folder.index)
        found = _indexed(folder.objects, weight_map, problems, folder.index)
        config: Any = folder.config
        if config is None and files.split("?", 1)[0].endswith(".safetensors"):
            config = files  # one file named: its folder's config.json, looked up on need
        return Listing(found, problems, files.rstrip("/"), weight_map, config)
    if isinstance(files, str | os.PathLike):
        path = pathlib.Path(files)
        if not path.is_dir():
            return Listing([path], [], config=path.parent / _remote.CONFIG)
        try:
            with os.scandir(path) as entries:
                names = sorted(
                    e.name for e in entries if e.name.endswith(".safetensors") and not e.is_dir()
                )
        except OSError as e:
            why = e.strerror or str(e)
            fix = "give this process read access to it"
            return Listing([], [Problem(str(path), f"cannot be listed ({why}); {fix}")], str(path))
        for name in names:
            if name.startswith("."):
                logger.debug("meshinit.safetensors: skipped the hidden file %s", path / name)
        weight_map, problems = _index(path)
        local = [path / name for name in names if not name.startswith(".")]
        found = _indexed(local, weight_map, problems, path / INDEX)
        if not found and not problems and weight_map is None:
            raise FileNotFoundError(f"no *.safetensors file in the directory {path}")
        return Listing(found, problems, str(path), weight_map, path / _remote.CONFIG)
    if isinstance(files, Sequence) and not isinstance(files, bytes) and files:
        if all(isinstance(f, str | os.PathLike) for f in files):
            out: dict[str, pathlib.Path | _remote.Remote] = {}  # one file named twice: once
            problems = []
            for f in files:
                if _remote.is_url(f):
                    folder = _remote.listing(f, options)
                    problems += folder.problems
                    out.update((str(o), o) for o in folder.objects)
                else:
                    out.setdefault(os.path.realpath(f), pathlib.Path(f))
            first = files[0]
            config = first if _remote.is_url(first) else pathlib.Path(first).parent / _remote.CONFIG
            return Listing(list(out.values()), list(dict.fromkeys(problems)), config=config)
    raise TypeError(
        f"files must be a path or URL, a list of them, or a folder of *.safetensors "
        f"files, got {files!r}"
    )


def _indexed(found: list[Any], weight_map: Any, problems: list[Problem], index: Any) -> list[Any]:
    """``found``, less the files a sound index does not list (named in a warning)."""
    if weight_map is None or problems:
        return found
    listed = set(weight_map.values())
    unlisted = [p.name for p in found if p.name not in listed]
    if unlisted:
        warnings.warn(
            f"meshinit.safetensors: {index} does not list {', '.join(map(repr, unlisted))}: "
            f"left unread, as transformers leaves them (a stale shard of an earlier "
            f"download?). Remove them, or give the files as a list to read them",
            stacklevel=4,
        )
    return [p for p in found if p.name in listed]


MAX_CONFIG = 16 << 20
"""The most bytes a ``config.json`` is read from: the largest on the Hub are a few
hundred KiB (vision towers included)."""


def read_config(
    listed: Listing, options: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any] | None, str, list[Problem]]:
    """The checkpoint's ``config.json`` beside its files (None where there is none),
    where it was looked for, and its problems: too large, not a JSON object."""
    config = listed.config
    if config is None:
        return None, "", []
    if isinstance(config, str):  # a file URL: its folder's config.json, asked now
        try:
            config = _remote.sibling(config, _remote.CONFIG, options)
        except _remote.Permanent as e:
            return None, str(listed.config), [Problem(str(listed.config), f"config.json: {e}")]
        if config is None:
            return None, str(listed.config), []
    where = str(config)
    if isinstance(config, _remote.Remote):
        if config.size > MAX_CONFIG:
            return None, where, [Problem(where, f"is over {MAX_CONFIG} bytes: not a config.json")]
        try:
            data = bytes(_remote.read(config, 0, config.size)) if config.size else b""
        except _remote.Permanent as e:
            return None, where, [Problem(where, str(e))]
    else:
        f, st, why = open_regular(config)
        if why is not None:
            if not config.exists() and not config.is_symlink():
                return None, where, []
            return None, where, [Problem(where, why)]
        assert f is not None and st is not None
        with f:
            if st.st_size > MAX_CONFIG:
                too_large = f"is over {MAX_CONFIG} bytes: not a config.json"
                return None, where, [Problem(where, too_large)]
            data = f.read(MAX_CONFIG + 1)
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        return None, where, [Problem(where, f"is not JSON ({str(e)[:200]})")]
    if not isinstance(parsed, dict):
        return None, where, [Problem(where, f"holds a JSON {type(parsed).__name__}, not an object")]
    return parsed, where, []


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
        return None, None, failed(e)
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        return None, None, f"is {_kind_of(st.st_mode)}, not a regular file"
    return f, st, None


def check(path: pathlib.Path | _remote.Remote) -> tuple[Checked | None, list[Problem]]:
    """``path`` checked as the format requires, or every problem found in it."""
    where = str(path)
    if isinstance(path, _remote.Remote):
        tensors, problems = _remote.check(path)
        if problems:
            return None, [Problem(where, p) for p in problems]
        return Checked(path, path.identity, tensors), []
    f, st, why = open_regular(path)
    if why is not None:
        return None, [Problem(where, why)]
    assert f is not None and st is not None
    with f:  # closed before the package opens the file: one descriptor at a time
        tensors, problems = _header.parse(f, st.st_size, path)
    if not problems:
        problems = _header.package_agrees(path, tensors)
        if not problems and identity(os.stat(path)) != identity(st):
            problems = ["changed while it was being checked; load it again once it is written"]
    if problems:
        return None, [Problem(where, p) for p in problems]
    return Checked(path, identity(st), tensors), []


def _index(directory: pathlib.Path) -> tuple[dict[str, str] | None, list[Problem]]:
    """A sharded checkpoint's weight map (tensor name to file name), None where the
    folder has no index, or the index's problems."""
    index = directory / INDEX
    if not index.is_file():
        return None, []
    if index.stat().st_size > MAX_HEADER:
        return {}, [Problem(str(index), f"is over {MAX_HEADER} bytes: not a checkpoint index")]
    try:
        data = index.read_bytes()
    except OSError as e:
        return {}, [Problem(str(index), f"cannot be read ({e.strerror or e})")]
    return _weight_map(data, str(index))


def _remote_index(index: _remote.Remote) -> tuple[dict[str, str], list[Problem]]:
    if index.size > MAX_HEADER:
        return {}, [Problem(index.url, f"is over {MAX_HEADER} bytes: not a checkpoint index")]
    try:
        data = bytes(_remote.read(index, 0, index.size)) if index.size else b""
    except _remote.Permanent as e:
        return {}, [Problem(index.url, str(e))]
    return _weight_map(data, index.url)


def _weight_map(data: bytes, where: str) -> tuple[dict[str, str], list[Problem]]:
    try:
        weight_map = json.loads(data.decode("utf-8")).get("weight_map")
    except (ValueError, AttributeError, RecursionError) as e:
        return {}, [Problem(where, f"is not a JSON object with a weight_map ({str(e)[:200]})")]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        why = "its weight_map must be an object of tensor names to file names"
        return {}, [Problem(where, why)]
    return weight_map, []


def read_index(listed: Listing, checked: Iterable[Checked]) -> list[Problem]:
    """Problems of a sharded checkpoint's ``model.safetensors.index.json``, where there
    is one: a shard it names that is absent (an incomplete download), or a tensor in
    another file than it says."""
    directory, weight_map = listed.directory, listed.weight_map
    if directory is None or not weight_map:
        return []
    where = f"{directory}/{INDEX}"
    checked = list(checked)
    held = {name: c.path.name for c in checked for name in c.tensors}
    problems = []
    present = {p.name for p in listed.paths}
    failed = present - {c.path.name for c in checked}  # their own problems say why
    absent = sorted({f for f in weight_map.values() if f not in present})
    for f in absent:
        n = sum(v == f for v in weight_map.values())
        problems.append(
            Problem(
                where,
                f"names the file {f!r} ({n} tensors), which is not in {directory}: "
                f"an incomplete download? Fetch it, or remove the index",
            )
        )
    for name, f in weight_map.items():
        if f not in absent and f not in failed and held.get(name) != f:
            now = f"in {held[name]!r}" if name in held else "in no file"
            said = f"puts tensor {printable(name)!r} in {f!r}, but it is {now}"
            problems.append(Problem(where, said))
    return problems
