"""safetensors files, checked as the format requires before a byte of data is read.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON
(``{name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}``), then the data
section, which the tensors' ``data_offsets`` (relative to its start) tile exactly:
from byte 0, with no gap and no overlap, to its end.

:func:`check` reads the header only after its length is known to fit the file and the
format's cap, checks every entry against those rules (naming the tensor), then asks
the ``safetensors`` package to open the file: it refuses exactly what the format
refuses, and its word is final. meshinit's own checks say precisely what is wrong,
refuse a name given twice (the format forbids it; ``safetensors`` keeps the last one
silently), and make the offsets meshinit reads by its own parse safe to read: the
package does not expose offsets, and the per-shard reads need them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import stat
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .._errors import Problem, printable

logger = logging.getLogger("meshinit")

MAX_HEADER = 100_000_000
"""The format's cap on the header's length in bytes (``safetensors``' own)."""

INDEX = "model.safetensors.index.json"

# Every dtype of the format (safetensors 0.8), in bits per element.
BITS: Mapping[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

# What meshinit reads, as numpy dtypes of the stored bytes (little-endian, as the
# format stores them). Sub-byte dtypes (F4, F6_*) are packed and not read.
_NUMPY: dict[str, Any] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": "<u2",
    "I16": "<i2",
    "U32": "<u4",
    "I32": "<i4",
    "U64": "<u8",
    "I64": "<i8",
    "F16": "<f2",
    "BF16": ml_dtypes.bfloat16,
    "F32": "<f4",
    "F64": "<f8",
    "C64": "<c8",
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):  # ml_dtypes >= 0.5
    _NUMPY["F8_E8M0"] = ml_dtypes.float8_e8m0fnu
READABLE: Mapping[str, np.dtype] = {k: np.dtype(v) for k, v in _NUMPY.items()}


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor of a checked file: where its bytes are."""

    file: pathlib.Path
    name: str
    dtype: str  # the format's name: "F32", "BF16", ...
    shape: tuple[int, ...]
    start: int  # of its first byte, from the start of the file
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Checked:
    """A file that passed every check: its tensors, and who it was when checked (a
    file replaced or rewritten since is refused when it is read)."""

    path: pathlib.Path
    identity: tuple[int, ...]
    tensors: Mapping[str, Stored]


def identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def listing(files: Any) -> list[pathlib.Path]:
    """The files of ``files``: a path, a sequence of paths, or a directory, whose
    ``*.safetensors`` regular files are taken and hidden ones (macOS's ``._x``
    AppleDouble files, editors' swap files) skipped."""
    if isinstance(files, str | os.PathLike):
        path = pathlib.Path(files)
        if not path.is_dir():
            return [path]
        found = []
        for p in sorted(path.glob("*.safetensors")):
            if p.name.startswith("."):
                logger.debug("meshinit.safetensors: skipped the hidden file %s", p)
            elif p.is_file():
                found.append(p)
        if not found:
            raise FileNotFoundError(f"no *.safetensors file in the directory {path}")
        return found
    if isinstance(files, Sequence) and not isinstance(files, bytes) and files:
        if all(isinstance(f, str | os.PathLike) for f in files):
            out: dict[str, pathlib.Path] = {}  # one file named twice is read once
            for f in files:
                out.setdefault(os.path.realpath(f), pathlib.Path(f))
            return list(out.values())
    raise TypeError(
        f"files must be a path, a list of paths or a directory of *.safetensors files, "
        f"got {files!r}"
    )


def check(path: pathlib.Path) -> tuple[Checked | None, list[Problem]]:
    """``path`` checked as the format requires, or every problem found in it."""
    where = str(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below, on every path)
    except OSError as e:
        return None, [Problem(where, f"cannot be opened: {e.strerror or e}")]
    with f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None, [Problem(where, "is not a regular file")]
        header, length, problems = _header(f, st.st_size)
        if problems:
            return None, [Problem(where, p) for p in problems]
        tensors, problems = _entries(path, header, 8 + length, st.st_size)
        if not problems:
            problems = _package_agrees(path, tensors)
        if not problems and identity(os.stat(path)) != identity(st):
            problems = ["changed while it was being checked; load it again once it is written"]
    if problems:
        return None, [Problem(where, p) for p in problems]
    return Checked(path, identity(st), tensors), []


def _header(f: Any, size: int) -> tuple[dict[str, Any], int, list[str]]:
    """The header's JSON object and length, read only once its length is known to fit."""
    if size < 8:
        return (
            {},
            0,
            [
                f"is {size} bytes: a safetensors file starts with an 8-byte header length "
                f"(an empty or truncated file?)"
            ],
        )
    (length,) = struct.unpack("<Q", f.read(8))
    if length > MAX_HEADER:
        return (
            {},
            0,
            [
                f"its header length field says {length} bytes, more than the format's cap "
                f"of {MAX_HEADER}: not a safetensors file, or a corrupt one"
            ],
        )
    if 8 + length > size:
        return (
            {},
            0,
            [
                f"its header length field says {length} bytes, but only {size - 8} follow "
                f"it: a truncated file, or not a safetensors file"
            ],
        )
    raw = f.read(length)
    if len(raw) != length:
        return {}, 0, [f"ended while its header was read ({len(raw)} of {length} bytes)"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return {}, 0, [f"its header is not UTF-8 (byte {e.start} of it): not a safetensors file"]
    twice: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for k, v in items:
            if k in seen:
                twice.append(k)
            seen[k] = v
        return seen

    try:
        header = json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as e:
        return {}, 0, [f"its header is not valid JSON ({str(e)[:200]}): not a safetensors file"]
    if not isinstance(header, dict):
        kind = type(header).__name__
        return {}, 0, [f"its header is a JSON {kind}, not an object of tensors"]
    # One name twice at the top level hides a tensor; a key twice inside an entry is
    # refused by the package's parser below.
    top = [k for k in dict.fromkeys(twice) if k in header]
    return (
        header,
        length,
        [f"names {_q(k)} twice in its header; the format allows each once" for k in top],
    )


def _q(name: str) -> str:
    return repr(printable(name))


def _count(shape: Any) -> int | None:
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        return None
    return math.prod(shape)


def _natural(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entries(
    path: pathlib.Path, header: dict[str, Any], data_start: int, size: int
) -> tuple[dict[str, Stored], list[str]]:
    """Every tensor entry checked, and the offsets checked to tile the data section."""
    problems: list[str] = []
    metadata = header.get("__metadata__")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        problems.append("its __metadata__ must be an object of strings to strings")
    tensors: dict[str, Stored] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        what = f"tensor {_q(name)}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            problems.append(f"{what}: its entry must be an object of dtype, shape and data_offsets")
            continue
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        count = _count(shape)
        bad = []
        if not isinstance(dtype, str) or dtype not in BITS:
            bad.append(f"dtype {dtype!r} is not one of the format's ({', '.join(BITS)})")
        if count is None:
            bad.append(f"shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))):
            bad.append(f"data_offsets {offsets!r} are not two non-negative integers")
        elif offsets[1] < offsets[0]:
            bad.append(f"data_offsets {offsets!r} end before they begin")
        if bad:
            problems.append(f"{what}: {'; '.join(bad)}")
            continue
        assert count is not None
        bits = count * BITS[dtype]
        begin, end = offsets
        if bits % 8 or end - begin != bits // 8:
            problems.append(
                f"{what}: {dtype} {tuple(shape)} is {bits / 8:g} bytes, but its data_offsets "
                f"[{begin}, {end}] hold {end - begin}"
            )
            continue
        tensors[name] = Stored(path, name, dtype, tuple(shape), data_start + begin, end - begin)
    if problems:
        return {}, problems
    return tensors, _tiling(list(tensors.values()), data_start, size - data_start)


def _tiling(tensors: list[Stored], data_start: int, data_size: int) -> list[str]:
    """The tensors must tile the data section: from byte 0, no gap, no overlap, to its end."""
    problems: list[str] = []
    at, previous = 0, None
    for t in sorted(tensors, key=lambda t: (t.start, t.nbytes)):
        begin, end = t.start - data_start, t.start - data_start + t.nbytes
        if begin < at:
            assert previous is not None
            problems.append(
                f"tensor {_q(t.name)}: its data_offsets [{begin}, {end}] overlap those of "
                f"{_q(previous.name)}, which end at {at}"
            )
        elif begin > at:
            problems.append(
                f"tensor {_q(t.name)}: its data_offsets begin at {begin}, but the tensors "
                f"before it end at {at}: the format leaves no gap"
            )
        if end >= at:
            at, previous = end, t
    if at > data_size:
        problems.append(
            f"its tensors end at byte {at} of the data section, which holds {data_size}: "
            f"a truncated file (an interrupted download?)"
        )
    elif at < data_size and not problems:
        problems.append(
            f"{data_size - at} bytes after its last tensor belong to no tensor: the format "
            f"leaves none"
        )
    return problems


def _package_agrees(path: pathlib.Path, tensors: Mapping[str, Stored]) -> list[str]:
    """The ``safetensors`` package's own verdict on the file, and its reading of the
    names, dtypes and shapes, which must be meshinit's."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(
            "meshinit.safetensors checks every file with the safetensors package: "
            "pip install 'meshinit[safetensors]'"
        ) from e

    try:
        f: Any = safe_open(str(path), framework="numpy")  # its mapping goes with f
        seen = {}
        for n in f.keys():
            part = f.get_slice(n)
            seen[n] = (part.get_dtype(), tuple(part.get_shape()))
        del f
    except Exception as e:  # SafetensorError, or the package's own limits
        return [f"the safetensors package refuses it: {str(e)[:300]}"]
    ours = {n: (t.dtype, t.shape) for n, t in tensors.items()}
    if seen != ours:
        odd = sorted(set(seen.items()) ^ set(ours.items()), key=str)[:3]
        return [f"the safetensors package reads its header differently: {odd}"]
    return []


def read_index(directory: pathlib.Path, checked: Iterable[Checked]) -> list[Problem]:
    """Problems of a sharded checkpoint's ``model.safetensors.index.json``, where there
    is one: a shard it names that is absent (an incomplete download), or a tensor in
    another file than it says."""
    index = directory / INDEX
    if not index.is_file():
        return []
    where = str(index)
    if index.stat().st_size > MAX_HEADER:
        return [Problem(where, f"is over {MAX_HEADER} bytes: not a checkpoint index")]
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8")).get("weight_map")
    except (ValueError, AttributeError, RecursionError) as e:
        return [Problem(where, f"is not a JSON object with a weight_map ({str(e)[:200]})")]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return [Problem(where, "its weight_map must be an object of tensor names to file names")]
    held = {name: c.path.name for c in checked for name in c.tensors}
    problems = []
    absent = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
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
        if f not in absent and held.get(name) != f:
            now = f"in {held[name]!r}" if name in held else "in no file"
            problems.append(Problem(where, f"puts tensor {_q(name)} in {f!r}, but it is {now}"))
    return problems
