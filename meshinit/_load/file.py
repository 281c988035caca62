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
from .header import BITS as BITS
from .header import MAX_HEADER as MAX_HEADER
from .header import READABLE as READABLE
from .header import Stored as Stored

logger = logging.getLogger("meshinit")

INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Checked:
    """A file that passed every check: its tensors, and who it was when checked (a
    file replaced or rewritten since is refused when it is read)."""

    path: pathlib.Path
    identity: tuple[int, ...]
    tensors: Mapping[str, Stored]


def identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Listing(NamedTuple):
    """The files to check, and what the folder's listing found."""

    paths: list[pathlib.Path]
    problems: list[Problem]
    directory: pathlib.Path | None = None  # where ``files`` named a folder
    weight_map: dict[str, str] | None = None  # its index's, where it has one


def listing(files: Any) -> Listing:
    """The files of ``files``, and the problems of a folder's listing: a path, a
    sequence of paths, or a directory. A directory's ``*.safetensors`` entries are
    taken and hidden ones (macOS's ``._x`` AppleDouble files, editors' swap files)
    skipped; where its ``model.safetensors.index.json`` is, only the files the index
    lists (as transformers reads a sharded checkpoint), the others left with a warning.
    Folders are passed over; any other entry that is not a regular file (a dangling
    link, a FIFO) stays in the list for :func:`check` to name: no weight file is left
    out without a word."""
    if isinstance(files, str | os.PathLike):
        path = pathlib.Path(files)
        if not path.is_dir():
            return Listing([path], [])
        try:
            with os.scandir(path) as entries:
                names = sorted(
                    e.name for e in entries if e.name.endswith(".safetensors") and not e.is_dir()
                )
        except OSError as e:
            why = e.strerror or str(e)
            fix = "give this process read access to it"
            return Listing([], [Problem(str(path), f"cannot be listed ({why}); {fix}")], path)
        for name in names:
            if name.startswith("."):
                logger.debug("meshinit.safetensors: skipped the hidden file %s", path / name)
        found = [path / name for name in names if not name.startswith(".")]
        weight_map, problems = _index(path)
        if weight_map is not None and not problems:
            listed = set(weight_map.values())
            unlisted = [p.name for p in found if p.name not in listed]
            if unlisted:
                warnings.warn(
                    f"meshinit.safetensors: {path / INDEX} does not list "
                    f"{', '.join(map(repr, unlisted))}: left unread, as transformers leaves "
                    f"them (a stale shard of an earlier download?). Remove them, or give "
                    f"the files as a list to read them",
                    stacklevel=3,
                )
            found = [p for p in found if p.name in listed]
        if not found and not problems and weight_map is None:
            raise FileNotFoundError(f"no *.safetensors file in the directory {path}")
        return Listing(found, problems, path, weight_map)
    if isinstance(files, Sequence) and not isinstance(files, bytes) and files:
        if all(isinstance(f, str | os.PathLike) for f in files):
            out: dict[str, pathlib.Path] = {}  # one file named twice is read once
            for f in files:
                out.setdefault(os.path.realpath(f), pathlib.Path(f))
            return Listing(list(out.values()), [])
    raise TypeError(
        f"files must be a path, a list of paths or a directory of *.safetensors files, "
        f"got {files!r}"
    )


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
        return None, None, f"cannot be opened: {e.strerror or e}"
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        return None, None, f"is {_kind_of(st.st_mode)}, not a regular file"
    return f, st, None


def check(path: pathlib.Path) -> tuple[Checked | None, list[Problem]]:
    """``path`` checked as the format requires, or every problem found in it."""
    where = str(path)
    f, st, why = open_regular(path)
    if why is not None:
        return None, [Problem(where, why)]
    assert f is not None and st is not None
    with f:
        tensors, problems = _header.parse(f, st.st_size, path)
        if not problems:
            problems = _package_agrees(path, tensors)
        if not problems and identity(os.stat(path)) != identity(st):
            problems = ["changed while it was being checked; load it again once it is written"]
    if problems:
        return None, [Problem(where, p) for p in problems]
    return Checked(path, identity(st), tensors), []


def _package_agrees(path: pathlib.Path, tensors: Mapping[str, Stored]) -> list[str]:
    """The ``safetensors`` package's own verdict on the file, and its names, which must
    be meshinit's. Its dtypes and shapes are not read back one by one: both parsers
    are strict JSON, each refuses what the other might read two ways (a key twice
    inside an entry: the package; a name twice: meshinit), and each checks that the
    entries tile the data section, so the same names mean the same entries. The
    read-back cost a call per tensor, each linear in the header's size before
    safetensors 0.7: hours for a header of 200,000 entries."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(
            "meshinit.safetensors checks every file with the safetensors package: "
            "pip install 'meshinit[safetensors]'"
        ) from e

    try:
        f: Any = safe_open(str(path), framework="numpy")  # its mapping goes with f
        seen = f.keys()
        del f
    except Exception as e:  # SafetensorError, or the package's own limits
        return [f"the safetensors package refuses it: {str(e)[:300]}"]
    if len(seen) != len(tensors) or not tensors.keys() >= set(seen):
        odd = sorted(set(seen) ^ tensors.keys())[:3]
        return [f"the safetensors package reads other tensor names in it: {odd}"]
    return []


def _index(directory: pathlib.Path) -> tuple[dict[str, str] | None, list[Problem]]:
    """A sharded checkpoint's weight map (tensor name to file name), None where the
    folder has no index, or the index's problems."""
    index = directory / INDEX
    if not index.is_file():
        return None, []
    where = str(index)
    if index.stat().st_size > MAX_HEADER:
        return {}, [Problem(where, f"is over {MAX_HEADER} bytes: not a checkpoint index")]
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8")).get("weight_map")
    except (ValueError, AttributeError, RecursionError) as e:
        return {}, [Problem(where, f"is not a JSON object with a weight_map ({str(e)[:200]})")]
    except OSError as e:
        return {}, [Problem(where, f"cannot be read ({e.strerror or e})")]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return {}, [
            Problem(where, "its weight_map must be an object of tensor names to file names")
        ]
    return weight_map, []


def read_index(listed: Listing, checked: Iterable[Checked]) -> list[Problem]:
    """Problems of a sharded checkpoint's ``model.safetensors.index.json``, where there
    is one: a shard it names that is absent (an incomplete download), or a tensor in
    another file than it says."""
    directory, weight_map = listed.directory, listed.weight_map
    if directory is None or not weight_map:
        return []
    where = str(directory / INDEX)
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
