"""What every encoding shares, so that none imports another: the one protocol each
implements (:class:`Encoding`, found through :mod:`.registry`), how a decoding program
is compiled (:func:`run`: as every compile of meshinit's, once when several threads
reach it), the per-device arguments of a program that decodes each device's own block
(:func:`by_device`, :func:`per_device`), and a refusal of repeated layers as one
(:func:`collapsed`).

An encoding is how stored bytes encode a parameter's values (float8 with block scales,
MXFP4). The read flow never names one: it asks each in the registry's order, at plan
time, to offer virtual stored tensors (:class:`Virtual`), to pair the jobs it reads
(:attr:`Encoding.pair`, which gives a paired job the ``Parts`` that decodes it on the
devices), and to claim the stored tensors read beside them (:attr:`Encoding.claimed`).
The protocol decodes only. The export's one encoder, float8 (:mod:`.fp8.encode`), is
named by the export itself, as ``quantize="fp8"`` names it; a second encoding on export
would make ``encode`` a method of this protocol, found through the registry as the
decoders are.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ... import _caches
from ..._errors import Problem
from ..._format import index_ranges, some
from ..._run import compile as _compile
from ..layout import host as _host
from ..store.source import Stored

Config = Callable[[], tuple[dict[str, Any] | None, str, list[Problem]]]
"""The checkpoint's ``config.json``, read once where something first calls it: its
settings (None where there are none), where it is, and the problems of reading it."""


@dataclasses.dataclass(frozen=True)
class Offered:
    """What an encoding offers of a checkpoint's stored tensors before any plan path is
    resolved against them.

    Attributes:
      tensors: virtual tensor name -> its :class:`Stored` (what a ``names=`` target
        names, as it names a stored one).
      behind: virtual tensor name -> the stored tensors it is read from: claimed where
        it is, never reported unused.
      pairs: virtual tensor name -> the encoding's own record of it, handed back to its
        :attr:`Encoding.pair`.
      unpaired: a name it would offer -> why it does not (its stored tensors are
        there but form no pair): what a path that reads that name is told.
    """

    tensors: Mapping[str, Stored] = dataclasses.field(default_factory=dict)
    behind: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    pairs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    unpaired: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Virtual:
    """An encoding's tensors that no file stores as such (MXFP4's ``X`` of
    ``X_blocks`` and ``X_scales``).

    Attributes:
      dtype: the dtype its virtual tensors carry (a name no file's header uses).
      seen_as: the stored dtype a framework's map is shown for one (its values' exact
        dtype).
      offer: the virtual tensors of a checkpoint's stored tensors.
      why_not: why one cannot be read into a planned dtype, or None.
    """

    dtype: str
    seen_as: str
    offer: Callable[[Mapping[str, Stored]], Offered]
    why_not: Callable[[np.dtype], str | None]


Paired = tuple[list[_host.Job], list[Problem], dict[str, str]]
"""The jobs, each the encoding reads now carrying its ``Parts`` (``job.parts``), the
problems of those it cannot read, and plan path -> what it is decoded from (the
inventory's ``dequantized``)."""


def _nothing_claimed(jobs: Sequence[_host.Job], stored: Mapping[str, Stored]) -> set[str]:
    return set()


@dataclasses.dataclass(frozen=True)
class Encoding:
    """One encoding of stored bytes, as the read flow asks it at plan time.

    Attributes:
      name: how it is known (``"fp8"``).
      pair: ``pair(jobs, stored, offered, config)``: every job that reads this
        encoding's tensors paired (its ``Parts`` set), given the stored tensors, what
        :attr:`virtual` offered and the checkpoint's config (:data:`Config`).
      claimed: ``claimed(jobs, stored)``: the stored tensors the paired jobs read
        beside their own (float8 block scales), never reported unused.
      virtual: the tensors it offers that no file stores as such, or None.
    """

    name: str
    pair: Callable[[list[_host.Job], Mapping[str, Stored], Offered, Config], Paired]
    claimed: Callable[[Sequence[_host.Job], Mapping[str, Stored]], set[str]] = _nothing_claimed
    virtual: Virtual | None = None

    def offer(self, stored: Mapping[str, Stored]) -> Offered:
        """What :attr:`virtual` offers of ``stored``: nothing where there is none."""
        return Offered() if self.virtual is None else self.virtual.offer(stored)


_ALONE: dict[int, threading.Lock] = {}
_ALONE_GUARD = threading.Lock()
_COMPILED_GUARD = threading.Lock()
_compiled = _caches.lru("compiled decoding programs", 256, _COMPILED_GUARD)


def alone(program: Any) -> threading.Lock:
    """A lock of ``program``'s own: its first call compiles it, and a second thread's
    call of the same program waits for that compile rather than compiling it again."""
    with _ALONE_GUARD:
        return _ALONE.setdefault(id(program), threading.Lock())


def run(program: Any, mesh: jax.sharding.Mesh, *args: Any) -> Any:
    """``program(*args)`` (a ``jax.jit`` of a decoding), compiled as every compile of
    meshinit's (:func:`meshinit._run.compile.compile_lowered`: the platform's options,
    or the caller's ``meshinit.options(compiler_options=...)``, and kept in jax's
    persistent compilation cache where one is set, so a restarted load reads it back),
    once per signature of its arguments, while other threads wait (:func:`alone`)."""
    leaves = jax.tree.leaves(args)
    key = _compile.full_key((program, tuple((a.shape, str(a.dtype), a.sharding) for a in leaves)))
    with alone(program):
        with _COMPILED_GUARD:
            found = _compiled.get(key)
        if found is None:
            found = _compile.compile_lowered(program.lower(*args), mesh)
            with _COMPILED_GUARD:
                _compiled.put(key, found)
    return found(*args)


def by_device(held: dict[Any, Any], entry: Any, stage: Any) -> dict[Any, Any]:
    """Each of this process's devices of the entry with what was kept for its block
    (``held``, by the block's bounds): the rows of a per-device argument."""
    blocks = {}
    for index, devices in _host.holders(entry, stage).values():
        for device in devices:
            blocks[device] = held[tuple((s.start, s.stop) for s in index)]
    return blocks


def per_device(values: list[tuple[Any, np.ndarray]], n: int, sharding: Any) -> jax.Array:
    """A global array of ``n`` rows, one per device of the mesh, from each addressable
    device's own row."""
    shape = (n, *values[0][1].shape)
    rows = [jax.device_put(v[None], d) for d, v in values]
    return jax.make_array_from_single_device_arrays(shape, sharding, rows)


def stored_as(raw: Any, stored: Any) -> Any:
    """``raw`` (in a decoding program) in the stored dtype: fan-out gathers a staged
    parameter's bytes as uint8, bit for bit its stored float8."""
    if raw.dtype == np.uint8 and np.dtype(stored) != np.uint8:
        return jax.lax.bitcast_convert_type(raw, stored)
    return raw


_INT = re.compile(r"(?<![^.])(0|[1-9][0-9]*)(?![^.])")  # a dot-separated integer component


def collapsed(
    rows: list[tuple[str, str, Any, str]],
) -> list[tuple[str, str, Any, str]]:
    """``(path, tensor, key, file)`` rows, those that differ only in the integer
    components of the path and the tensor's name (and the file) as one row each,
    ``layers.{0..60}.mlp.up``, where exactly the product of the integers shown is
    there; else each row as it is. Components that vary alike (the layer number of a
    path and of its tensor) vary together."""
    groups: dict[Any, list[tuple[str, str, Any, str]]] = {}
    for row in rows:
        path, tensor, key, _ = row
        groups.setdefault((_INT.sub("#", path), _INT.sub("#", tensor), key), []).append(row)
    out = []
    for (_, _, key), members in groups.items():
        points = [
            tuple(int(x) for x in (*_INT.findall(path), *_INT.findall(tensor)))
            for path, tensor, _, _ in members
        ]
        columns = list(zip(*points, strict=True)) if points[0] else []
        distinct = list(dict.fromkeys(columns))
        product = 1
        for column in distinct:
            product *= len(set(column))
        files = list(dict.fromkeys(f for *_, f in members))
        if len(members) == 1 or product != len(set(points)) or len(set(points)) != len(points):
            out += [(p, t, k, f) for p, t, k, f in members]
            continue
        shown = [index_ranges(set(column)) for column in columns]
        path, tensor = _filled(members[0][0], shown), _filled(members[0][1], shown)
        where = files[0] if len(files) == 1 else f"{len(files)} files ({some(files, 2)})"
        out.append((path, tensor, key, where))
    return out


def _filled(name: str, shown: list[str]) -> str:
    """``name`` with its integer components replaced by the next of ``shown`` (taken)."""
    parts = _INT.split(name)
    for k in range(1, len(parts), 2):
        parts[k] = shown.pop(0)
    return "".join(parts)
