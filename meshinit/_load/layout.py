"""A plan path's target resolved against the checked files, and a device's block of the
parameter read from its parts.

:func:`resolve` checks a target (a :class:`~meshinit.safetensors.Tensor`, or a
:class:`~meshinit.safetensors.Stack` or :class:`~meshinit.safetensors.Concat` of parts)
against the stored tensors before anything is read: every part is in the files, of a
kind the planned dtype can hold, sliced, reshaped and transposed as numpy would, and
the parts fit together into the planned shape. Each problem names the part.

:func:`block` then reads one block of the parameter (the index of one device's shard):
it asks each part only for the part of the block that part holds, so a device reads
the bytes of its own shard of each part and nothing else, and a part that the block
does not reach is not read at all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .._errors import printable
from . import file as _file
from .names import Stack, Target, Tensor


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stored tensor as a part: ``stored[index].reshape(shape).transpose(order)``."""

    tensor: Tensor
    stored: _file.Stored
    index: tuple[slice, ...]
    shape: tuple[int, ...]
    order: tuple[int, ...]
    label: str  # how messages name the part: "" for a whole parameter, "Stack part [3] "

    @property
    def result(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.order)


@dataclasses.dataclass(frozen=True)
class Joined:
    """Parts stacked along a new axis (``stacked``) or concatenated along an existing one."""

    parts: tuple[Leaf | Joined, ...]
    axis: int
    stacked: bool
    result: tuple[int, ...]
    starts: tuple[int, ...]  # each part's first index along ``axis`` (concatenated)


Node = Leaf | Joined


def leaves(node: Node) -> list[Leaf]:
    """Every stored tensor ``node`` reads, in order."""
    if isinstance(node, Leaf):
        return [node]
    return [leaf for part in node.parts for leaf in leaves(part)]


class Refused(Exception):
    """A target that cannot fill its path: ``message`` says why, naming the part."""

    def __init__(self, message: str, missing: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.message = message
        self.missing = missing or []  # (part label, tensor name) for each absent tensor


def resolve(
    target: Target,
    stored: Mapping[str, _file.Stored],
    why_not: Callable[[_file.Stored], str | None],
) -> Node:
    """``target`` checked against the stored tensors; :class:`Refused` saying why not.

    ``why_not(stored)`` says why a stored tensor's dtype cannot be read into the
    planned one (None: it can). Absent tensors are gathered from every part, so that
    one message names them all."""
    missing: list[tuple[str, str]] = []
    node = _resolve(target, stored, why_not, "", missing)
    if missing:
        names = ", ".join(f"{label}{name!r}".strip() for label, name in missing)
        raise Refused(f"not in the files: {names}", missing)
    assert node is not None
    return node


def _resolve(
    target: Target,
    stored: Mapping[str, _file.Stored],
    why_not: Callable[[_file.Stored], str | None],
    label: str,
    missing: list[tuple[str, str]],
) -> Node | None:
    if isinstance(target, Tensor):
        held = stored.get(target.name)
        if held is None:
            missing.append((label, target.name))
            return None
        return _leaf(target, held, why_not, label)
    kind = type(target).__name__
    parts = [
        _resolve(part, stored, why_not, f"{label}{kind} part [{i}] ", missing)
        for i, part in enumerate(target.parts)
    ]
    if missing:
        return None
    nodes = [p for p in parts if p is not None]
    shapes = [p.result for p in nodes]
    first = shapes[0]
    stacked = isinstance(target, Stack)
    ndim = len(first) + stacked
    axis = target.axis + ndim if target.axis < 0 else target.axis
    if not 0 <= axis < ndim:
        raise Refused(f"{label}{kind} axis {target.axis} is out of range for {ndim} axes")
    if stacked:
        if any(s != first for s in shapes):
            raise Refused(f"{label}Stack parts give different shapes: {_shapes(shapes)}")
        result = (*first[:axis], len(nodes), *first[axis:])
        starts = tuple(range(len(nodes)))
    else:
        cut = [s[:axis] + s[axis + 1 :] for s in shapes]
        if any(len(s) != len(first) for s in shapes) or any(c != cut[0] for c in cut):
            raise Refused(
                f"{label}Concat parts must agree on every axis but {axis}: {_shapes(shapes)}"
            )
        sizes = [s[axis] for s in shapes]
        starts = tuple(int(x) for x in np.cumsum([0, *sizes[:-1]]))
        result = (*first[:axis], sum(sizes), *first[axis + 1 :])
    return Joined(tuple(nodes), axis, stacked, result, starts)


def _shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join(f"[{i}] {s}" for i, s in enumerate(shapes))


def _leaf(
    tensor: Tensor,
    held: _file.Stored,
    why_not: Callable[[_file.Stored], str | None],
    label: str,
) -> Leaf:
    why = why_not(held)
    index: tuple[slice, ...] = ()
    shape: tuple[int, ...] = ()
    order: tuple[int, ...] = ()
    floating = jax.dtypes.issubdtype(_file.READABLE.get(held.dtype, np.int8), np.floating)
    if why is None and tensor.scale is not None and not floating:
        why = "cannot be scaled: scale= is for floating-point tensors"
    if why is None:
        try:
            index = tensor.sliced(held.shape)
            sliced = tuple(max(0, s.stop - s.start) for s in index)
            shape, order = tensor.transformed(sliced)
        except ValueError as e:
            why = str(e)
        else:
            if tensor.index is not None and not _views(held.shape, index, shape):
                why = (
                    f"index={tensor.index} then shape={tensor.shape}: the slice cannot be "
                    f"reshaped without a copy of all of it (the reshape merges a sliced "
                    f"axis); slice a whole row range instead, or reshape without index"
                )
    if why is not None:
        raise Refused(
            f"{label}tensor {printable(tensor.name)!r} in {held.file.name}, stored "
            f"{held.dtype} {held.shape}, {why}"
        )
    return Leaf(tensor, held, index, shape, order, label)


def _views(stored: tuple[int, ...], index: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``stored[index].reshape(shape)`` is a view: decided on strides alone, on a
    one-byte buffer that nothing ever reads (the reshape is asked never to copy)."""
    if 0 in stored:
        return True
    strides = tuple(int(math.prod(stored[k + 1 :])) for k in range(len(stored)))
    fake = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), stored, strides)[index]
    try:
        np.reshape(fake, shape, copy=False)
    except ValueError:
        return False
    except TypeError:  # numpy < 2.1 has no copy=; assigning the shape never copies
        view = fake.view()
        try:
            view.shape = shape
        except AttributeError:
            return False
    return True


def block(
    node: Node, index: tuple[slice, ...], read: Callable[[Leaf, tuple], Any], dtype: Any
) -> Any:
    """The parameter's block at ``index`` (slices with resolved bounds, one per axis of
    ``node.result``), in ``dtype``, asking ``read(leaf, index)`` for each stored tensor's
    part of it: parts the block does not reach are never asked."""
    if isinstance(node, Leaf):
        return read(node, index)
    axis, along = node.axis, index[node.axis]
    if along.stop <= along.start:  # an empty block reads nothing
        return np.zeros(tuple(max(0, s.stop - s.start) for s in index), dtype)
    rest = index[:axis] + index[axis + 1 :]
    if node.stacked:
        parts = range(along.start, along.stop)
        got = [block(node.parts[i], rest, read, dtype) for i in parts]
        if len(got) == 1:  # one layer: a view, no copy
            return np.expand_dims(got[0], axis)
        return np.stack(got, axis=axis)
    got = []
    for part, start in zip(node.parts, node.starts, strict=True):
        lo = max(along.start, start)
        hi = min(along.stop, start + part.result[axis])
        if lo < hi:
            sub = index[:axis] + (slice(lo - start, hi - start),) + index[axis + 1 :]
            got.append(block(part, sub, read, dtype))
    return got[0] if len(got) == 1 else np.concatenate(got, axis=axis)
