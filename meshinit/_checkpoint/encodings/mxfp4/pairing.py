"""MXFP4 weights (gpt-oss's experts), read dequantized on the device.

gpt-oss publishes each expert weight ``X`` as two tensors, and says so in
``config.json`` (``quantization_config: {quant_method: "mxfp4"}``):

- ``X_blocks``, uint8 ``[E, R, G, B]``: two fp4 (e2m1) values a byte, the low nibble
  first, in groups of ``2B`` values (32);
- ``X_scales``, uint8 ``[E, R, G]``: one e8m0 exponent a group.

transformers' ``convert_moe_packed_tensors`` makes of them the tensor ``X`` of shape
``[E, G * 2B, R]`` (its rows and groups transposed)::

    X[e, k, r] = ldexp(FP4[nibble(blocks[e, r, k // 2B, k % 2B // 2], k % 2)],
                       scales[e, r, k // 2B] - 127)

:func:`virtual` offers that tensor under the name ``X``, so ``names=``, a ``Stack``
and MaxText's map name it as they name a dequantized checkpoint's tensor. A block of
a parameter that reads it is read as the bytes and exponents of every group it
reaches, whole (:class:`MxParts`); both go to the device that holds the block, and
one compiled program per signature unpacks, scales and cuts the block out there.
Each value is a table value times a power of two: exact in float32 and in bfloat16,
rounded once to a narrower planned dtype, as transformers' table and ``ldexp`` in
that dtype round it.

Refused before a byte is read: a config that does not declare ``mxfp4`` (or that
cannot be read, or whose ``quantization_config`` is of the wrong kind), a planned
dtype that is not a float of two bytes or more, a view that reshapes the tensor or
steps along its groups, a join other than a ``Stack`` of equal views, a remote file.
Refused as the exponents are read: byte 255 (NaN in the format), bytes 0 and 1 under
a non-zero value (a float32 subnormal, which the device flushes to zero), and an
exponent that would overflow the planned dtype.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ...._errors import PlanError, Problem, printable
from ...layout import blocks as _blocks
from ...layout import host as _host
from ...store.source import Stored
from .. import base as _base
from .. import config as _quant_config
from . import packed as _packed
from .packed import stacked
from .program import checked, planned_as, program, spanned

DTYPE = "MXFP4"
"""The dtype of a virtual stored tensor (:func:`virtual`): its values are exact in
bfloat16, the dtype transformers dequantizes to."""

SUFFIXES = ("_blocks", "_scales")


@dataclasses.dataclass(frozen=True)
class Mx:
    """The stored pair behind a virtual tensor."""

    blocks: Stored
    scales: Stored

    @property
    def group(self) -> int:
        return 2 * self.blocks.shape[-1]


def virtual(
    index: Mapping[str, Stored],
) -> tuple[dict[str, Stored], dict[str, Mx], dict[str, str]]:
    """A virtual tensor ``X`` for each ``X_blocks`` (uint8 ``[E, R, G, B]``) beside an
    ``X_scales`` (uint8 ``[E, R, G]``) where no ``X`` is stored itself, the pair
    behind each, and why no ``X`` is made of an ``X_blocks`` or an ``X_scales`` that
    forms no such pair (for the message of a path that reads ``X``)."""
    stored, pairs, unpaired = {}, {}, {}
    for name in index:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        base = name[: -len(suffix)] if suffix else name
        if suffix is None or base in index or base in stored or base in unpaired:
            continue
        blocks, scales = index.get(base + SUFFIXES[0]), index.get(base + SUFFIXES[1])
        why = _unpaired(base, blocks, scales)
        if why is not None:
            unpaired[base] = why
            continue
        assert blocks is not None and scales is not None
        e, r, g, b = blocks.shape
        shape = (e, g * 2 * b, r)
        stored[base] = Stored(blocks.file, base, DTYPE, shape, blocks.start, blocks.nbytes)
        pairs[base] = Mx(blocks, scales)
    return stored, pairs, unpaired


def _unpaired(base: str, blocks: Stored | None, scales: Stored | None) -> str | None:
    """Why ``blocks`` and ``scales`` (either may be absent) form no MXFP4 pair, naming
    both with their dtypes and shapes; None where they form one."""

    def shown(held: Stored) -> str:
        return f"{printable(held.name)!r} ({held.dtype} {tuple(held.shape)})"

    fix = (
        f"a damaged or partial download, or not gpt-oss's MXFP4: download or convert it "
        f"again, or plan {printable(base + SUFFIXES[0])!r} and "
        f"{printable(base + SUFFIXES[1])!r} as parameters of their own to load them as stored"
    )
    if blocks is None or scales is None:
        held = blocks or scales
        assert held is not None
        other = base + (SUFFIXES[1] if scales is None else SUFFIXES[0])
        return (
            f"{shown(held)} has no {printable(other)!r} beside it: an MXFP4 tensor is read "
            f"from both; {fix}"
        )
    why = None
    if (blocks.dtype, scales.dtype) != ("U8", "U8"):
        wrong = [
            f"the {what} here as {held.dtype}"
            for what, held in (("blocks", blocks), ("scales", scales))
            if held.dtype != "U8"
        ]
        why = f"both are stored as U8 (gpt-oss's bytes), {' and '.join(wrong)}"
    elif len(blocks.shape) != 4:
        why = f"the blocks are 4-D ([experts, rows, groups, bytes]), these {len(blocks.shape)}-D"
    elif tuple(scales.shape) != tuple(blocks.shape[:-1]):
        why = (
            f"the scales' shape is not the blocks' without its last axis, "
            f"{tuple(blocks.shape[:-1])}"
        )
    if why is None:
        return None
    return f"{shown(blocks)} and {shown(scales)} do not form an MXFP4 pair: {why}; {fix}"


def why_not(planned: np.dtype) -> str | None:
    """Why a virtual tensor cannot be read into ``planned``, or None."""
    if jax.dtypes.issubdtype(planned, np.floating) and planned.itemsize >= 2:
        return None
    return (
        f"is MXFP4 (its _blocks and _scales), planned {planned.name}: it is read dequantized "
        f"into a float of two bytes or more; plan bfloat16, float16 or float32, or plan "
        f"its _blocks and _scales as uint8 parameters to load them as stored"
    )


def paired(
    jobs: Sequence[Any],
    pairs: Mapping[str, Mx],
    config: Callable[[], tuple[dict[str, Any] | None, str, list[Problem]]],
) -> tuple[list[Any], list[Problem], dict[str, str]]:
    """``jobs`` with every one that reads a virtual tensor read dequantized
    (:class:`MxParts`), the problems of those that cannot be, and plan path -> what
    it is dequantized with (the inventory's). The config is read at the first such
    job; where it cannot be read (:mod:`..config`), its problems stand for them."""
    out, problems, dequantized = [], [], {}
    declared: list[Any] = []  # [Declared, the config's problems], once read
    undeclared = []  # (path, tensor, key, file): one problem for every layer alike
    for job in jobs:
        held = list(dict.fromkeys(leaf.stored for leaf in _blocks.leaves(job.node)))
        if not any(h.dtype == DTYPE for h in held):
            out.append(job)
            continue
        if not declared:
            settings, where, found = config()
            stated, wrong = _quant_config.declared(settings, where)
            declared[:] = [stated, found + wrong]
        if declared[1]:  # a config that cannot be read: its problems say what to fix first
            out.append(job)
            continue
        if declared[0].method != "mxfp4":
            first = pairs[next(h.name for h in held if h.dtype == DTYPE)].blocks
            undeclared.append((job.entry.path, first.name, (), str(first.file.name)))
            out.append(job)
            continue
        try:
            if len(held) != sum(h.dtype == DTYPE for h in held):
                raise _blocks.Refused(
                    f"it reads MXFP4 tensors ({_names(held)}) with other tensors: a "
                    f"dequantized parameter reads MXFP4 tensors only; plan them apart"
                )
            node = _attached(job.node, pairs)
        except _blocks.Refused as refused:
            problems.append(Problem(job.entry.path, refused.message))
            out.append(job)
            continue
        out.append(dataclasses.replace(job, node=node, parts=MxParts))
        mx = pairs[held[0].name]
        more = f" and {len(held) - 1} more" if len(held) > 1 else ""
        dequantized[job.entry.path] = (
            f"MXFP4 {printable(mx.blocks.name)!r} x {printable(mx.scales.name)!r}{more} "
            f"(e2m1 x e8m0, groups of {mx.group}) -> {np.dtype(job.entry.spec.dtype).name}"
        )
    for path, tensor, _, file in _base.collapsed(undeclared):
        method, where = declared[0].method, declared[0].where
        said = f"says quant_method {method!r}" if method else "declares no quantization"
        problems.append(
            Problem(
                path,
                f"it reads the MXFP4 tensor {printable(tensor)!r} in {file}, and {where} "
                f"{said}: meshinit reads _blocks/_scales pairs dequantized where the config "
                f'declares quantization_config.quant_method "mxfp4"; add it, or plan the '
                f"_blocks and _scales as uint8 parameters",
            )
        )
    return out, (declared[1] if declared else []) + problems, dequantized


def claimed(pairs: Mapping[str, Mx]) -> dict[str, tuple[str, ...]]:
    """Each virtual tensor's stored tensors, for the accounting of unused ones."""
    return {name: (mx.blocks.name, mx.scales.name) for name, mx in pairs.items()}


def _names(held: list[Stored]) -> str:
    shown = [repr(printable(h.name)) for h in held[:3]]
    return ", ".join(shown) + (f" and {len(held) - 3} more" if len(held) > 3 else "")


def _attached(node: _blocks.Node, pairs: Mapping[str, Mx]) -> _blocks.Node:
    """``node`` with each leaf's :class:`Mx`; :class:`~.blocks.Refused` where it is
    not read dequantized (v1): a reshape, a step along the groups' axis, a scale or
    offset, an out_shape, a remote file, a join other than a Stack of equal views."""
    if isinstance(node, _blocks.Leaf):
        held, tensor = node.stored, node.tensor
        mx = pairs[held.name]
        what = f"{node.label}tensor {printable(held.name)!r} (MXFP4, dequantized)"
        if not tensor.dequantize:
            raise _blocks.Refused(
                f"{node.label}tensor {printable(held.name)!r} is MXFP4 (its _blocks and "
                f"_scales), read with dequantize=False: MXFP4 has no plain cast; drop "
                f"dequantize=False to read it dequantized, or plan its _blocks and _scales "
                f"as uint8 parameters to load them as stored"
            )
        index = _index(node)
        indexed = tuple(len(range(*s.indices(n))) for s, n in zip(index, held.shape, strict=True))
        why = None
        if node.groups is not None:
            why = f"out_shape={tensor.out_shape}"
        elif tensor.scale is not None or tensor.offset is not None:
            why = "a scale= or offset="
        elif (index[1].step or 1) != 1:
            why = "a slice that steps along its groups' axis (axis 1)"
        elif any((s.step or 1) < 0 for s in index):
            why = "a slice of negative step"
        elif tuple(node.shape) != indexed:
            why = f"a reshape to {node.shape}"
        elif held.file.fetched or mx.scales.file.fetched:
            why = "a remote object (download the files first)"
        if why is not None:
            raise _blocks.Refused(f"{what} is not read dequantized through {why} yet; {_FIX}")
        return dataclasses.replace(node, quant=mx)
    if isinstance(node, _blocks.Joined) and node.stacked and node.groups is None:
        if node.order is None:
            parts = [_attached(p, pairs) for p in node.parts]
            if len({_key(p) for p in parts}) == 1:
                return dataclasses.replace(node, parts=tuple(parts))
    raise _blocks.Refused(
        f"{node.label}a join of MXFP4 tensors read dequantized is read as a Stack of equal "
        f"views only (their shape, slice and permute); {_FIX}"
    )


_FIX = (
    "plan the _blocks and _scales as uint8 parameters to load them as stored, or convert "
    "the checkpoint to the planned dtype first"
)


def _key(node: _blocks.Node) -> Any:
    if isinstance(node, _blocks.Leaf):
        index = tuple((s.start, s.stop, s.step) for s in node.index)
        mx = node.quant
        held = (mx.blocks.shape, mx.scales.shape, node.tensor.compute_dtype)
        return (node.stored.shape, index, node.shape, node.order, held)
    assert isinstance(node, _blocks.Joined)
    return (node.axis, len(node.parts), _key(node.parts[0]))


@dataclasses.dataclass
class Raw:
    """A block as the device program takes it."""

    key: tuple[tuple[int, int], ...]
    blocks: np.ndarray  # uint8 [leaves, E', R', groups, B]
    scales: np.ndarray  # uint8 [leaves, E', R', groups]
    offset: int  # the block's first k within the groups read
    signature: tuple[Any, ...]


class MxParts(_host.Parts):
    """:class:`~meshinit._checkpoint.layout.host.Parts` of a parameter read from MXFP4 tensors: a
    block is the bytes of the groups it reaches (placed on the devices that hold it,
    as any block is), and :meth:`whole` runs one program over them all, each device
    dequantizing its own block with its own exponents and offset. Fan-out stages its
    stored bytes as an array of their own (:mod:`.packed`)."""

    stages = True  # fan-out may stage it (read.staging.staged), as its image:
    stage_of = staticmethod(_packed.stage_of)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._counted = args[2] if len(args) > 2 else kwargs["total"]
        self._held: dict[Any, Raw] = {}
        self._maps: dict[str, np.ndarray] = {}
        self._count: int | None = None

    def _tensor(self, held: Stored) -> np.ndarray:
        """A stored uint8 tensor as a view of its file (pages read as touched)."""
        if held.name not in self._maps:
            if held.nbytes == 0:
                self._maps[held.name] = np.zeros(held.shape, np.uint8)
            else:
                base = held.start - held.start % mmap.ALLOCATIONGRANULARITY
                mapped = held.file.mapping(
                    self._checked[held.file].identity, base, held.start + held.nbytes
                )
                flat = np.frombuffer(mapped, np.uint8, held.nbytes, held.start - base)
                self._maps[held.name] = flat.reshape(held.shape)
        return self._maps[held.name]

    def block(self, index: tuple[slice, ...]) -> np.ndarray:
        """The bytes of the groups the block reaches, ``[1, leaves, E', R', groups,
        B]`` (its row of :meth:`whole`'s array of bytes); its exponents and offset
        are kept for :meth:`whole`. An empty block: zeros of the planned dtype.
        Staged: the block of its image (:func:`.packed.block`)."""
        if self.job.stage is not None:
            return _packed.block(self, index)
        sizes = tuple(max(0, s.stop - s.start) for s in index)
        if not math.prod(sizes):
            return np.zeros(sizes, self.job.entry.spec.dtype)
        found = self._of(index)
        self._held[found.key] = found
        return found.blocks[None]

    def _picked(self, index: tuple[slice, ...]) -> list[tuple[int, int, int]]:
        """(first, count, step) on each axis of the stored tensor X ``[E, K, R]`` of
        the block at ``index``: every leaf the block reaches reads the same."""
        leaf, at = _blocks.reached(self.job.node, index)[0]
        out = []
        for axis, whole in enumerate(_index(leaf)):
            start, _, step = whole.indices(leaf.stored.shape[axis])
            got = at[leaf.order.index(axis)]
            out.append((start + got.start * step, max(0, got.stop - got.start), step))
        return out

    def _groups(self) -> int:
        """How many groups every block reads: the most any block of the parameter
        reaches (one count, so that every device runs one program)."""
        if self._count is None:
            entry = self.job.entry
            leaf, _ = stacked(self.job.node, len(entry.spec.shape))
            group = leaf.quant.group
            counts = [0]
            shape = entry.spec.shape
            for index in entry.sharding.devices_indices_map(shape).values():
                assert index is not None
                index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
                if all(s.stop > s.start for s in index):
                    _, (k0, nk, _), _ = self._picked(index)
                    counts.append(-(-(k0 + nk) // group) - k0 // group)
            self._count = max(counts)
        return self._count

    def _of(self, index: tuple[slice, ...]) -> Raw:
        node, entry = self.job.node, self.job.entry
        key = tuple((s.start, s.stop) for s in index)
        sizes = tuple(s.stop - s.start for s in index)
        reached = _blocks.reached(node, index)
        leaf, across = stacked(node, len(sizes))
        view = [k for k in range(len(sizes)) if k not in across]
        (e0, ne, es), (k0, nk, _), (r0, nr, rs) = self._picked(index)
        mx: Mx = leaf.quant
        group, groups = mx.group, self._groups()
        g0 = max(0, min(k0 // group, mx.blocks.shape[2] - groups))
        cut = (slice(e0, e0 + ne * es, es), slice(r0, r0 + nr * rs, rs), slice(g0, g0 + groups))
        b = mx.blocks.shape[3]
        raw = np.empty((len(reached), ne, nr, groups, b), np.uint8)
        exps = np.empty((len(reached), ne, nr, groups), np.uint8)
        for k, (part, _) in enumerate(reached):  # copied once, out of the files' pages
            pair: Mx = part.quant
            raw[k], exps[k] = self._tensor(pair.blocks)[cut], self._tensor(pair.scales)[cut]
        self._counted[0] += raw.nbytes + exps.nbytes
        self._tally[0] += raw.nbytes + exps.nbytes
        planned = np.dtype(entry.spec.dtype)
        work = np.dtype(leaf.tensor.compute_dtype or planned)
        read, read_exps = spanned(raw, exps, k0 - g0 * group, nk, group)
        checked(read, read_exps, (work, planned), entry.path, reached)
        shapes = (tuple(sizes[k] for k in across), tuple(sizes[k] for k in view))
        signature = (raw.shape, nk, leaf.order, tuple(across), shapes, work, planned)
        return Raw(key, raw, exps, k0 - g0 * group, signature)

    def whole(self, shape: Any, sharding: Any, shards: list[jax.Array]) -> _host.Made:
        """The parameter: one program over every device's bytes, exponents and offset.
        Staged: its image to gather first (:func:`.packed.gathered`)."""
        entry, stage = self.job.entry, self.job.stage
        if stage is not None:
            return _packed.gathered(self, shape, sharding, shards)
        planned = np.dtype(entry.spec.dtype)
        if not shards or not math.prod(shape):
            return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=planned)
        blocks = _base.by_device(self._held, entry, stage)
        made = list(blocks.values())
        signature = made[0].signature
        if any(b.signature != signature for b in made):
            raise PlanError(
                [Problem(entry.path, f"its shards differ in shape ({_shapes(made)}); {_EVEN}")],
                header="meshinit.safetensors.load: an MXFP4 parameter cannot be read:",
            )
        mesh, spec = sharding.mesh, sharding.spec
        names = tuple(mesh.axis_names)
        n = math.prod(mesh.devices.shape)
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(names))
        raw = jax.make_array_from_single_device_arrays((n, *made[0].blocks.shape), rows, shards)
        exps = _base.per_device([(d, b.scales) for d, b in blocks.items()], n, rows)
        offsets = _base.per_device(
            [(d, np.array([b.offset], np.int32)) for d, b in blocks.items()], n, rows
        )
        run = program(signature, mesh, spec, names)
        self._held.clear()

        def finish() -> jax.Array:  # on a worker thread (.ahead): compiles while reading
            got = _base.run(run, mesh, raw, exps, offsets)
            return planned_as(got, shape, sharding)

        return finish

    def close(self) -> None:
        super().close()
        self._maps.clear()


def _index(leaf: _blocks.Leaf) -> tuple[slice, ...]:
    """The leaf's slice of the stored tensor, one per axis."""
    return leaf.index or tuple(slice(None) for _ in leaf.stored.shape)


_EVEN = "plan a sharding that splits its axes evenly, or convert the checkpoint first"


def _shapes(made: list[Raw]) -> str:
    return ", ".join(sorted({str(b.blocks.shape[1:]) for b in made}))


def _offered(stored: Mapping[str, Stored]) -> _base.Offered:
    tensors, pairs, unpaired = virtual(stored)
    return _base.Offered(tensors, claimed(pairs), pairs, unpaired)


def _paired_jobs(
    jobs: list[_host.Job],
    stored: Mapping[str, Stored],
    offered: _base.Offered,
    config: _base.Config,
) -> _base.Paired:
    return paired(jobs, offered.pairs, config)


ENCODING = _base.Encoding(
    name="mxfp4",
    pair=_paired_jobs,
    # its values are exact in bfloat16, as transformers makes them
    virtual=_base.Virtual(dtype=DTYPE, seen_as="BF16", offer=_offered, why_not=why_not),
)
"""MXFP4, as the registry lists it: its virtual tensors offered, paired, their stored
pairs claimed."""
