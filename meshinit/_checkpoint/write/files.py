"""The files of an export, as Hugging Face writes them: the stored tensors cut into
files of at most ``max_shard_size`` bytes, in order, each file given to one writing
process, and the bytes of each header and of the index (:func:`plan`).

Every process computes the same plan from the same recipes, so no process needs
another's: a file's writer writes its header and its tensors front to back, and the
index lists every file before any is written.

A file's tensors are all held by its writer's devices once gathered, so a file only
holds tensors whose writers may be the same process (their parameters share a set of
processes); files are given to writers by the largest first, each to the least loaded
process that may write it (balance within the writers' shares).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..store.header import READABLE

FORMAT = {"format": "pt"}
"""The ``__metadata__`` transformers writes (and asks for: it refuses other formats)."""

LONE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD = 5 * 10**9
"""transformers' default ``max_shard_size`` ("5GB")."""
SHARES = 4
"""With several processes, the default file size leaves each writer about this many
files (at most 5 GB each), so that the files can be shared out evenly."""

_NAMES = {np.dtype(v): k for k, v in reversed(list(READABLE.items()))}


def dtype_name(dtype: Any) -> str:
    """The safetensors name of a numpy dtype (``BF16``, ``F8_E4M3``)."""
    return _NAMES[np.dtype(dtype)]


def shard_size(size: Any) -> int:
    """``max_shard_size`` as bytes: an int, or a string as transformers reads it
    (``"5GB"`` 5 * 10**9, ``"5GiB"`` 5 * 2**30, ``"500MB"``, ``"100KiB"``; a lowercase
    ``b`` counts bits: ``"5Gb"`` is 5 * 10**9 / 8)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    if not isinstance(size, str):
        raise TypeError(
            f'max_shard_size must be bytes as an int, or a string like "5GB", got {size!r}'
        )
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]i?[Bb])\s*", size, re.IGNORECASE)
    if m is None:
        raise ValueError(f'max_shard_size {size!r}: give bytes as "5GB", "500MB", "2GiB" or an int')
    number, unit = int(m.group(1)), m.group(2)
    power = "KMGT".index(unit[0].upper()) + 1
    scale = (2 ** (10 * power)) if unit[1].lower() == "i" else 10 ** (3 * power)
    out = number * scale // (8 if unit.endswith("b") else 1)
    if out <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return out


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor of the files: its name, dtype, shape, and which processes may write
    it (those whose devices hold it once gathered)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    writers: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class File:
    """One file: its name, its writer, its tensors in order with their offsets in the
    data, and its header's bytes (length, JSON, padding)."""

    name: str
    writer: int
    tensors: tuple[Stored, ...]
    offsets: tuple[int, ...]
    header: bytes

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class Files:
    files: tuple[File, ...]
    index: bytes | None  # model.safetensors.index.json, None for a lone file

    def written_by(self, process: int) -> list[File]:
        return [f for f in self.files if f.writer == process]

    def bytes_by_process(self, count: int) -> list[int]:
        out = [0] * count
        for f in self.files:
            out[f.writer] += f.size
        return out


def plan(stored: Sequence[Stored], max_shard_size: int | None, processes: int) -> Files:
    """The files of an export of ``stored`` (in order): each file within
    ``max_shard_size`` bytes of tensors unless one tensor is larger (None: 5 GB, and
    with several processes small enough that each has about :data:`SHARES` files), a
    lone ``model.safetensors`` where one file holds them all, else
    ``model-0000i-of-0000N.safetensors`` and the index."""
    total = sum(t.nbytes for t in stored)
    if max_shard_size is None:
        max_shard_size = DEFAULT_SHARD
        if processes > 1:
            max_shard_size = min(max_shard_size, max(1, -(-total // (SHARES * processes))))
    groups: dict[tuple[int, ...], list[Stored]] = {}
    for t in stored:  # a file's tensors share their writers
        groups.setdefault(t.writers, []).append(t)
    cut: list[tuple[tuple[int, ...], list[Stored]]] = []
    for writers, tensors in groups.items():
        current: list[Stored] = []
        size = 0
        for t in tensors:
            if current and size + t.nbytes > max_shard_size:
                cut.append((writers, current))
                current, size = [], 0
            current.append(t)
            size += t.nbytes
        if current or not cut:
            cut.append((writers, current))
    n = len(cut)
    names = [LONE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    load = [0] * processes
    writer_of = [0] * n
    for i in sorted(range(n), key=lambda i: -sum(t.nbytes for t in cut[i][1])):
        writers, tensors = cut[i]
        chosen = min(writers, key=lambda p: (load[p], p))
        writer_of[i] = chosen
        load[chosen] += sum(t.nbytes for t in tensors)
    files = []
    for i, (_, tensors) in enumerate(cut):
        header, offsets = _header(tensors)
        files.append(File(names[i], writer_of[i], tuple(tensors), offsets, header))
    index = None if n == 1 else _index(files)
    return Files(tuple(files), index)


def _header(tensors: Sequence[Stored]) -> tuple[bytes, tuple[int, ...]]:
    """A safetensors header (8-byte length, JSON, padded with spaces to 8 bytes, as the
    safetensors package writes it) and each tensor's offset in the data."""
    entries: dict[str, Any] = {"__metadata__": FORMAT}
    offsets = []
    at = 0
    for t in tensors:
        entries[t.name] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [at, at + t.nbytes],
        }
        offsets.append(at)
        at += t.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, tuple(offsets)


def _index(files: Sequence[File]) -> bytes:
    weight_map = {t.name: f.name for f in files for t in f.tensors}
    total = sum(t.nbytes for f in files for t in f.tensors)
    count = sum(math.prod(t.shape) for f in files for t in f.tensors)
    index = {
        "metadata": {"total_size": total, "total_parameters": count},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return (json.dumps(index, indent=2) + "\n").encode()
