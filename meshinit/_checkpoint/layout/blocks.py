"""A path's resolved parts (:mod:`.layout` resolves them), and the blocks of them that
devices hold: which stored tensors a block reaches, at which index of each
(:func:`reached`, :func:`check`: dry runs), and the block's values (:func:`block`).

A part is a stored tensor's view (:class:`Leaf`), a constant (:class:`Const`), a part
padded with a constant (:class:`Padded`) or parts stacked or concatenated, then merged
and transposed (:class:`Joined`). A block asks each part only for the part of the block
that part holds, so a device reads the bytes of its own shard of each part and nothing
else, and a part that the block does not reach is not read at all (a constant, or a
pad's padding, never is).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ..store.source import Stored
from .parts import Tensor
from .reshape import unmerge


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stored tensor as a part: ``stored[index].reshape(shape).transpose(order)``."""

    tensor: Tensor
    stored: Stored
    index: tuple[slice, ...]
    shape: tuple[int, ...]
    order: tuple[int, ...]
    label: str  # how messages name the part: "" for a whole parameter, "Stack part [3] "
    groups: tuple[int, ...] | None = None  # out_shape: how many view axes each axis merges
    quant: Any = None  # a float8 weight read with its block scales (quantized.Quant)

    @property
    def view(self) -> tuple[int, ...]:
        """The shape of the transposed view, before ``out_shape`` merges its axes."""
        return tuple(self.shape[a] for a in self.order)

    @property
    def result(self) -> tuple[int, ...]:
        return self.tensor.out_shape if self.groups is not None else self.view  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Const:
    """A part full of ``value`` (a :class:`~meshinit.safetensors.Fill`): read from no file."""

    value: bool | int | float
    result: tuple[int, ...]
    label: str


@dataclasses.dataclass(frozen=True)
class Padded:
    """``part`` at the origin of ``result``, the rest ``value`` (a
    :class:`~meshinit.safetensors.Pad`): the padding is read from no file."""

    part: Node
    result: tuple[int, ...]
    value: bool | int | float
    label: str


@dataclasses.dataclass(frozen=True)
class Joined:
    """Parts stacked along a new axis (``stacked``) or concatenated along an existing one
    into ``shape``, then merged into the target's ``out_shape`` (``groups``) and
    transposed (``order``)."""

    parts: tuple[Node, ...]
    axis: int
    stacked: bool
    shape: tuple[int, ...]  # the joined parts'
    starts: tuple[int, ...]  # each part's first index along ``axis`` (concatenated)
    label: str = ""
    out_shape: tuple[int, ...] | None = None
    groups: tuple[int, ...] | None = None  # how many joined axes each out_shape axis merges
    order: tuple[int, ...] | None = None  # the permute, resolved

    @property
    def merged(self) -> tuple[int, ...]:
        """The shape before the transpose: ``out_shape``, or the joined parts'."""
        return self.shape if self.out_shape is None else self.out_shape

    @property
    def result(self) -> tuple[int, ...]:
        merged = self.merged
        return merged if self.order is None else tuple(merged[a] for a in self.order)

    @property
    def kind(self) -> str:
        return "Stack" if self.stacked else "Concat"


Node = Leaf | Const | Padded | Joined


def leaves(node: Node) -> list[Leaf]:
    """Every stored tensor ``node`` reads, in order (a constant reads none)."""
    if isinstance(node, Leaf):
        return [node]
    if isinstance(node, Const):
        return []
    if isinstance(node, Padded):
        return leaves(node.part)
    return [leaf for part in node.parts for leaf in leaves(part)]


def merging(node: Node) -> bool:
    """Whether some part of ``node`` merges axes (an ``out_shape``): only such a node
    can refuse a block (:func:`check`)."""
    if isinstance(node, Leaf):
        return node.groups is not None
    if isinstance(node, Const):
        return False
    if isinstance(node, Padded):
        return merging(node.part)
    return node.groups is not None or any(merging(p) for p in node.parts)


class Refused(Exception):
    """A target that cannot fill its path: ``message`` says why, naming the part."""

    def __init__(self, message: str, missing: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.message = message
        self.missing = missing or []  # (part label, tensor name) for each absent tensor


def constant(value: bool | int | float, dtype: Any) -> tuple[np.ndarray, str | None]:
    """``value`` as a 0-d array of ``dtype``, and why ``dtype`` cannot hold it (None:
    it can): an int out of range, a fraction for an integer dtype, a finite value that
    overflows a float, an infinity a float8 holds as NaN."""
    dtype = np.dtype(dtype)
    if jax.dtypes.issubdtype(dtype, np.bool_) or jax.dtypes.issubdtype(dtype, np.integer):
        exact = isinstance(value, bool | int) or float(value).is_integer()
        if not exact:
            return np.zeros((), dtype), f"is not an integer, planned {dtype.name}"
        info = (
            (0, 1)
            if dtype == np.bool_
            else (ml_dtypes.iinfo(dtype).min, ml_dtypes.iinfo(dtype).max)
        )
        if not info[0] <= int(value) <= info[1]:
            return np.zeros((), dtype), f"is outside {dtype.name}'s range"
        return np.array(int(value)).astype(dtype), None
    try:
        wide = float(value)
    except OverflowError:
        return np.zeros((), dtype), f"overflows {dtype.name}"
    with np.errstate(over="ignore", invalid="ignore"):
        got = np.array(wide).astype(dtype)
    if math.isfinite(wide) and not np.isfinite(got):
        return got, f"overflows {dtype.name}"
    if math.isinf(wide) and np.isnan(got):
        return got, f"is not held by {dtype.name}, which has no infinity"
    return got, None


def _spelled(index: tuple[slice, ...]) -> str:
    return f"[{', '.join(f'{s.start}:{s.stop}' for s in index)}]"


def _leaf_index(node: Leaf, index: tuple[slice, ...]) -> tuple[slice, ...]:
    """The index of the leaf's transposed view that a block at ``index`` of its result
    covers; :class:`Refused` where the block cuts a merged axis inside a row."""
    if node.groups is None:
        return index
    what = f"{node.label}out_shape={node.tensor.out_shape}"
    return _rows(index, index, node.groups, node.view, what, "the view")


def _unpermuted(node: Joined, index: tuple[slice, ...]) -> tuple[slice, ...]:
    """A block's ``index`` of the result as an index of ``node.merged`` (the transpose
    undone)."""
    if node.order is None:
        return index
    return tuple(index[node.order.index(a)] for a in range(len(index)))


def _unmerged(node: Joined, index: tuple[slice, ...]) -> tuple[slice, ...]:
    """The index of the joined parts that a block at ``index`` of the result covers
    (the transpose undone, then the merge); :class:`Refused` where the block cuts a
    merged axis inside a row."""
    merged = _unpermuted(node, index)
    if node.groups is None:
        return merged
    what = f"{node.label}{node.kind} out_shape={node.out_shape}"
    return _rows(merged, index, node.groups, node.shape, what, "the joined shape")


def _rows(
    at: tuple[slice, ...],
    block: tuple[slice, ...],
    groups: tuple[int, ...],
    shape: tuple[int, ...],
    what: str,
    of: str,
) -> tuple[slice, ...]:
    """``unmerge(at, groups, shape)``; :class:`Refused` naming ``what`` where the block
    (``block``, as the result indexes it) cuts a merged axis inside a row."""
    found = unmerge(at, groups, shape)
    if found is None:
        raise Refused(
            f"{what}: the block {_spelled(block)} cuts a merged axis within a row of "
            f"{of} {shape}; shard the merged axis into whole rows, or not at all"
        )
    return found


def _within(
    node: Padded, index: tuple[slice, ...]
) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """The index of the pad's part that a block at ``index`` reaches, and where that
    goes in the block; None where the block lies wholly in the padding."""
    inner, where = [], []
    for s, n in zip(index, node.part.result, strict=True):
        stop = min(s.stop, n)
        if stop <= s.start:
            return None
        inner.append(slice(s.start, stop))
        where.append(slice(0, stop - s.start))
    return tuple(inner), tuple(where)


def _parts(
    node: Joined, index: tuple[slice, ...]
) -> list[tuple[Node, tuple[slice, ...], tuple[Any, ...]]]:
    """The parts a block at ``index`` (of the joined parts) reaches: each with its own
    index and where its block goes in the joined block."""
    axis, along = node.axis, index[node.axis]
    if along.stop <= along.start:  # an empty block reaches nothing
        return []
    before = (slice(None),) * axis
    rest = index[:axis] + index[axis + 1 :]
    if node.stacked:
        return [
            (node.parts[i], rest, (*before, i - along.start))
            for i in range(along.start, along.stop)
        ]
    out = []
    for part, start in zip(node.parts, node.starts, strict=True):
        lo = max(along.start, start)
        hi = min(along.stop, start + part.result[axis])
        if lo < hi:
            sub = index[:axis] + (slice(lo - start, hi - start),) + index[axis + 1 :]
            out.append((part, sub, (*before, slice(lo - along.start, hi - along.start))))
    return out


def _sizes(index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(max(0, s.stop - s.start) for s in index)


def block(
    node: Node, index: tuple[slice, ...], read: Callable[[Leaf, tuple], Any], dtype: Any
) -> Any:
    """The parameter's block at ``index`` (slices with resolved bounds, one per axis of
    ``node.result``), in ``dtype``, asking ``read(leaf, index)`` for each stored tensor's
    part of it (at an index of its transposed view): parts the block does not reach are
    never asked, nor is anything for a constant or a pad's padding. Where it joins
    several parts, each part's block is written into the joined block as soon as it is
    read (its bytes, and its file, are not needed after); where it reaches one, that
    part's block is returned as it is (a view: no copy)."""
    if isinstance(node, Leaf):
        got = read(node, _leaf_index(node, index))
        return got if node.groups is None else got.reshape(_sizes(index))
    if isinstance(node, Const):
        return np.full(_sizes(index), constant(node.value, dtype)[0], dtype)
    if isinstance(node, Padded):
        reached_ = _within(node, index)
        if reached_ is not None and _sizes(reached_[0]) == _sizes(index):
            return block(node.part, reached_[0], read, dtype)  # wholly in the part
        out = np.full(_sizes(index), constant(node.value, dtype)[0], dtype)
        if reached_ is not None:
            out[reached_[1]] = block(node.part, reached_[0], read, dtype)
        return out
    inner = _unmerged(node, index)
    got = _joined(node, inner, read, dtype)
    if node.groups is not None:
        got = got.reshape(_sizes(_unpermuted(node, index)))
    return got if node.order is None else got.transpose(node.order)


def _joined(
    node: Joined, index: tuple[slice, ...], read: Callable[[Leaf, tuple], Any], dtype: Any
) -> Any:
    parts = _parts(node, index)
    if len(parts) == 1:
        part, sub, _ = parts[0]
        got = block(part, sub, read, dtype)
        return np.expand_dims(got, node.axis) if node.stacked else got
    out = np.empty(_sizes(index), dtype)
    for part, sub, where in parts:
        out[where] = block(part, sub, read, dtype)
    return out


def at(view: Any, index: tuple[slice, ...]) -> Any:
    """``view[index]``, an array even where ``view`` is 0-d (numpy gives a scalar)."""
    return view[(*index, Ellipsis)]


def reached(node: Node, index: tuple[slice, ...]) -> list[tuple[Leaf, tuple[slice, ...]]]:
    """Each stored tensor a block at ``index`` reads, with the index of its transposed
    view it reads there, in the order :func:`block` reads them: a dry run that reads
    and allocates nothing (:class:`Refused` as :func:`block` would raise it)."""
    if isinstance(node, Leaf):
        return [(node, _leaf_index(node, index))]
    if isinstance(node, Const):
        return []
    if isinstance(node, Padded):
        inside = _within(node, index)
        return [] if inside is None else reached(node.part, inside[0])
    inner = _unmerged(node, index)
    return [found for part, sub, _ in _parts(node, inner) for found in reached(part, sub)]


def check(node: Node, indices: list[tuple[slice, ...]]) -> str | None:
    """Why some block at ``indices`` cannot be read as it is planned (an ``out_shape``
    whose merged axis the block cuts inside a row), or None: a dry run that reads and
    allocates nothing."""
    try:
        for index in indices:
            reached(node, index)
    except Refused as e:
        return e.message
    return None
