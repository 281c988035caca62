"""The safetensors format's header, parsed and checked before a byte of data is read.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON
(``{name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}``), then the data
section, which the tensors' ``data_offsets`` (relative to its start) tile exactly:
from byte 0, with no gap and no overlap, to its end.

:func:`parse` reads the header only after its length is known to fit the file and the
format's cap, and checks every entry against those rules, naming the tensor. A header
may hold hundreds of thousands of entries (the cap is 100 MB): the common entry is
checked in passes over all of them, and only a header with a problem is walked one
entry at a time, to say precisely what is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import itertools
import json
import math
import operator
import os
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from ..._errors import printable
from .source import Source, Stored

MAX_HEADER = 100_000_000
"""The format's cap on the header's length in bytes (``safetensors``' own)."""

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


def parse(f: Any, size: int, path: Source) -> tuple[dict[str, Stored], list[str]]:
    """The tensors of the open file ``f`` of ``size`` bytes, or every problem of its
    header."""
    with _no_collection():
        header, length, problems = _header(f, size)
        if problems:
            return {}, problems
        return _entries(path, header, 8 + length, size)


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """The cyclic collector held off while a header is parsed and its entries made:
    they are acyclic, and a header of 200,000 entries set off collections that each
    walked all of it (a quarter of the check's time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        return {}, 0, [f"its header is not valid JSON ({str(e)[:200]}): not a safetensors file"]
    if not isinstance(header, dict):
        kind = type(header).__name__
        return {}, 0, [f"its header is a JSON {kind}, not an object of tensors"]
    # A name given twice hides a tensor (a key twice inside an entry is refused by the
    # package's parser). The parse above keeps the last; a second parse in C counts
    # the header's members, and only where the counts differ does a hook in Python
    # name them: a header may hold hundreds of thousands.
    if json.loads(text, object_pairs_hook=len) == len(header):
        return header, length, []
    last: list[list[str]] = [[]]

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        last[0] = _twice(items)  # the whole header is the last object to close
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return (
        header,
        length,
        [f"names {_q(k)} twice in its header; the format allows each once" for k in last[0]],
    )


def _twice(items: list[tuple[str, Any]]) -> list[str]:
    seen: set[str] = set()
    twice: dict[str, None] = {}
    for k, _ in items:
        if k in seen:
            twice[k] = None
        seen.add(k)
    return list(twice)


def _q(name: str) -> str:
    return repr(printable(name))


def _count(shape: Any) -> int | None:
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        return None
    return math.prod(shape)


def _natural(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entries(
    path: Source, header: dict[str, Any], data_start: int, size: int
) -> tuple[dict[str, Stored], list[str]]:
    """Every tensor entry checked, and the offsets checked to tile the data section."""
    problems: list[str] = []
    metadata = header.get("__metadata__")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        problems.append("its __metadata__ must be an object of strings to strings")
    entries = {name: info for name, info in header.items() if name != "__metadata__"}
    tensors = _common(path, entries, data_start)
    if tensors is None:  # not all of the common kind: one by one, naming each problem
        tensors = {}
        for name, info in entries.items():
            found = _entry(path, name, info, data_start)
            if isinstance(found, str):
                problems.append(found)
            else:
                tensors[name] = found
    if problems:
        return {}, problems
    return tensors, _tiling(list(tensors.values()), data_start, size - data_start)


def _common(path: Source, entries: dict[str, Any], data_start: int) -> dict[str, Stored] | None:
    """The entries as :func:`_entry` takes them, checked all at once (a header may hold
    hundreds of thousands; each check is a pass in C over every entry's values), or
    None where any entry needs :func:`_entry`'s look."""
    infos = list(entries.values())
    if set(map(type, infos)) - {dict}:
        return None
    dtypes = [info.get("dtype") for info in infos]
    shapes = [info.get("shape") for info in infos]
    offsets = [info.get("data_offsets") for info in infos]
    if set(map(type, dtypes)) - {str} or set(dtypes) - BITS.keys():
        return None
    if set(map(type, shapes)) - {list} or set(map(type, offsets)) - {list}:
        return None
    if set(map(len, offsets)) - {2}:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    ends = list(itertools.chain.from_iterable(offsets))
    if set(map(type, dims)) - {int} or set(map(type, ends)) - {int}:
        return None  # bool is not int here, as in _natural
    if min(dims, default=0) < 0 or min(ends, default=0) < 0:
        return None
    begins, ends = ends[0::2], ends[1::2]
    nbytes = list(map(operator.sub, ends, begins))
    if min(nbytes, default=0) < 0:
        return None
    bits = map(operator.mul, map(math.prod, shapes), map(BITS.__getitem__, dtypes))
    if not all(map(operator.eq, bits, map((8).__mul__, nbytes))):
        return None
    starts = map(data_start.__add__, begins)
    made = map(Stored, itertools.repeat(path), entries, dtypes, map(tuple, shapes), starts, nbytes)
    return dict(zip(entries, made, strict=True))


def _entry(path: Source, name: str, info: Any, data_start: int) -> Stored | str:
    """A tensor's entry that the common check passed over: what is wrong with it."""
    what = f"tensor {_q(name)}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        return f"{what}: its entry must be an object of dtype, shape and data_offsets"
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
        return f"{what}: {'; '.join(bad)}"
    assert count is not None
    bits = count * BITS[dtype]
    begin, end = offsets
    if bits % 8 or end - begin != bits // 8:
        return (
            f"{what}: {dtype} {tuple(shape)} is {bits / 8:g} bytes, but its data_offsets "
            f"[{begin}, {end}] hold {end - begin}"
        )
    return Stored(path, name, dtype, tuple(shape), data_start + begin, end - begin)


def _tiling(tensors: list[Stored], data_start: int, data_size: int) -> list[str]:
    """The tensors must tile the data section: from byte 0, no gap, no overlap, to its end."""
    order = sorted(tensors, key=operator.itemgetter(4, 5))  # by start, then nbytes
    at = data_start
    for t in order:  # the common case, without a message in the making
        if t.start != at:
            break
        at += t.nbytes
    else:
        if at == data_start + data_size:
            return []
    problems: list[str] = []
    at, previous = 0, None
    for t in order:
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


def package_agrees(path: str | os.PathLike[str], tensors: Mapping[str, Stored]) -> list[str]:
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
        f: Any = safe_open(os.fspath(path), framework="numpy")  # its mapping goes with f
        seen = f.keys()
        del f
    except Exception as e:  # SafetensorError, or the package's own limits
        # the package says "No such file or directory" for any error opening the file
        # (a full descriptor table too): the OS's own answer, where it has one
        if isinstance(e, FileNotFoundError) and (why := _opens(path)) is not None:
            return [why]
        return [f"the safetensors package refuses it: {str(e)[:300]}"]
    if len(seen) != len(tensors) or not tensors.keys() >= set(seen):
        odd = sorted(set(seen) ^ tensors.keys())[:3]
        return [f"the safetensors package reads other tensor names in it: {odd}"]
    return []


def _opens(path: str | os.PathLike[str]) -> str | None:
    """Why the OS will not open ``path`` now, or None where it will."""
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))
    except OSError as e:
        return failed(e)
    return None


def failed(e: OSError) -> str:
    """What an ``OSError`` opening or mapping a file means, and the fix."""
    if e.errno in (errno.EMFILE, errno.ENFILE):
        try:
            import resource

            limit = f" (now {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
        except (ImportError, OSError, ValueError):
            limit = ""
        return (
            f"cannot be opened: this process has reached its limit of open files{limit}; "
            f"raise it (ulimit -n, or resource.setrlimit(RLIMIT_NOFILE)) or close files "
            f"this process holds ({e.strerror or e})"
        )
    if e.errno == errno.ENOMEM:
        return f"cannot be mapped: out of memory or mappings ({e.strerror or e})"
    return f"cannot be opened: {e.strerror or e}"
