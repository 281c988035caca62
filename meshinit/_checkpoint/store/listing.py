"""A checkpoint's files, found and checked before a byte of data is read.

:func:`listing` is the one place that tells a path from a URL: it turns ``files=``
into sources (:class:`~meshinit._checkpoint.store.local.LocalFile`,
:class:`~meshinit._checkpoint.store.remote.Remote`), only those the checkpoint's index lists where
it has one. :func:`check` has each source check itself: a local file is opened only
once it is known to be a regular file, :mod:`.header` parses and checks its header,
then the ``safetensors`` package opens it: it refuses exactly what the format
refuses, and its word is final.
meshinit's own checks say precisely what is wrong, refuse a name given twice (the
format forbids it; ``safetensors`` keeps the last one silently), and make the offsets
meshinit reads by its own parse safe to read: the package does not expose offsets,
and the per-shard reads need them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ... import _patterns
from ..._errors import Problem, printable
from . import remote as _remote
from .header import MAX_HEADER
from .local import LocalFile
from .source import CONFIG, INDEX, Source, Stored

logger = logging.getLogger("meshinit")


@dataclasses.dataclass(frozen=True)
class Checked:
    """A file that passed every check: its tensors, and who it was when checked (a
    file replaced or rewritten since is refused when it is read)."""

    source: Source
    identity: Any  # a file's device, inode, size and mtime; an object's ETag
    tensors: Mapping[str, Stored]


class Listing(NamedTuple):
    """The files to check, and what the folder's listing found."""

    sources: list[Source]
    problems: list[Problem]
    directory: str | None = None  # the folder (a path or URL) ``files`` named
    weight_map: dict[str, str] | None = None  # its index's, where it has one
    # the checkpoint's config.json, found when a load needs it (a file or object the
    # listing saw, or one beside a file URL, asked then): None where there is none;
    # the names of the place it is looked for and the object's, for messages
    config: Callable[[], Source | None] | None = None
    config_near: str = ""


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
        found: list[Source] = _indexed(folder.objects, weight_map, problems, folder.index)
        config, near = _seen(folder.config), ""
        if folder.config is None and files.split("?", 1)[0].endswith(".safetensors"):
            # one file named: its folder's config.json, looked up on need
            config, near = _beside(files, options), files
        return Listing(found, problems, files.rstrip("/"), weight_map, config, near)
    if isinstance(files, str | os.PathLike):
        path = pathlib.Path(files)
        if not path.is_dir():
            return Listing([LocalFile(path)], [], config=_seen(LocalFile(path.parent / CONFIG)))
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
        local = [LocalFile(path / name) for name in names if not name.startswith(".")]
        found = _indexed(local, weight_map, problems, path / INDEX)
        if not found and not problems and weight_map is None:
            raise FileNotFoundError(f"no *.safetensors file in the directory {path}")
        config = _seen(LocalFile(path / CONFIG))
        return Listing(found, problems, str(path), weight_map, config)
    if isinstance(files, Sequence) and not isinstance(files, bytes) and files:
        if all(isinstance(f, str | os.PathLike) for f in files):
            out: dict[str, Source] = {}  # one file named twice: once
            problems = []
            for f in files:
                if _remote.is_url(f):
                    folder = _remote.listing(f, options)
                    problems += folder.problems
                    out.update((str(o), o) for o in folder.objects)
                else:
                    out.setdefault(os.path.realpath(f), LocalFile(pathlib.Path(f)))
            first, near = files[0], ""
            if _remote.is_url(first):
                config, near = _beside(first, options), first
            else:
                config = _seen(LocalFile(pathlib.Path(first).parent / CONFIG))
            return Listing(
                list(out.values()), list(dict.fromkeys(problems)), config=config, config_near=near
            )
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
            stacklevel=_patterns.outside_stacklevel(),
        )
    return [p for p in found if p.name in listed]


def _seen(config: Source | None) -> Callable[[], Source | None] | None:
    """A config.json the listing saw (or that a local folder would hold), as found."""
    return None if config is None else lambda: config


def _beside(url: str, options: Mapping[str, Any] | None) -> Callable[[], Source | None]:
    """The config.json beside the file at ``url``, asked when it is needed."""
    return functools.partial(_remote.sibling, url, CONFIG, options)


MAX_CONFIG = 16 << 20
"""The most bytes a ``config.json`` is read from: the largest on the Hub are a few
hundred KiB (vision towers included)."""


def read_config(listed: Listing) -> tuple[dict[str, Any] | None, str, list[Problem]]:
    """The checkpoint's ``config.json`` beside its files (None where there is none),
    where it was looked for, and its problems: unreadable, too large, not JSON (a
    truncated download), not a JSON object. Whoever consults the config reports them,
    and never reads a config with problems as none: it is what says a checkpoint is
    quantized, and how."""
    if listed.config is None:
        return None, "", []
    near = listed.config_near
    try:
        config = listed.config()
    except _remote.Permanent as e:
        return None, near, [Problem(near, f"config.json: {e}")]
    if config is None:
        return None, near, []
    where = str(config)
    data, why = config.contents(MAX_CONFIG, "a config.json")
    if why is not None:
        return None, where, [Problem(where, why)]
    if data is None:
        return None, where, []
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        why = f"is not JSON ({str(e)[:200]}): a truncated or damaged copy? Download it again"
        return None, where, [Problem(where, why)]
    if not isinstance(parsed, dict):
        why = (
            f"holds a JSON {type(parsed).__name__}, not an object: not a model's "
            f"config.json; put the model's own beside its files"
        )
        return None, where, [Problem(where, why)]
    return parsed, where, []


def check(source: Source) -> tuple[Checked | None, list[Problem]]:
    """``source`` checked as the format requires, or every problem found in it."""
    identity, tensors, problems = source.check()
    if problems:
        return None, [Problem(str(source), p) for p in problems]
    return Checked(source, identity, tensors), []


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


def _remote_index(index: Source) -> tuple[dict[str, str], list[Problem]]:
    data, why = index.contents(MAX_HEADER, "a checkpoint index")
    if why is not None:
        return {}, [Problem(str(index), why)]
    return _weight_map(data or b"", str(index))


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
    held = {name: c.source.name for c in checked for name in c.tensors}
    problems = []
    present = {p.name for p in listed.sources}
    failed = present - {c.source.name for c in checked}  # their own problems say why
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
