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
    groups: tuple[int, ...] | None = None  # out_shape: how many view axes each axis merges

    @property
    def view(self) -> tuple[int, ...]:
        """The shape of the transposed view, before ``out_shape`` merges its axes."""
        return tuple(self.shape[a] for a in self.order)

    @property
    def result(self) -> tuple[int, ...]:
        return self.tensor.out_shape if self.groups is not None else self.view  # type: ignore[return-value]


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
            odd = _odd(nodes, shapes, str)
            raise Refused(f"{label}Stack parts give different shapes: {odd}")
        result = (*first[:axis], len(nodes), *first[axis:])
        starts = tuple(range(len(nodes)))
    else:
        # what must agree: the rank, and every size but the axis's
        cut = [(len(s), s[:axis] + s[axis + 1 :]) for s in shapes]
        if any(c != cut[0] for c in cut):
            odd = _odd(nodes, cut, lambda c: _free(shapes[cut.index(c)], axis))
            raise Refused(f"{label}Concat parts must agree on every axis but {axis}: {odd}")
        sizes = [s[axis] for s in shapes]
        starts = tuple(int(x) for x in np.cumsum([0, *sizes[:-1]]))
        result = (*first[:axis], sum(sizes), *first[axis + 1 :])
    return Joined(tuple(nodes), axis, stacked, result, starts)


def _odd(nodes: list[Node], keys: list[Any], shown: Callable[[Any], str], most: int = 5) -> str:
    """The parts whose ``keys`` (what must agree) differ from the most common one: that
    one, with how many parts give it, then each other part (its index, its stored
    tensors, what it gives), at most ``most`` of them. Of a Stack of 64 layers, the two
    that differ, not 64 shapes."""
    counts: dict[Any, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    common = max(counts, key=lambda k: counts[k])  # the first of the most common
    odd = [i for i, k in enumerate(keys) if k != common]
    listed = ", ".join(f"part [{i}] {_named(nodes[i])} gives {nodes[i].result}" for i in odd[:most])
    more = f" and {len(odd) - most} more" if len(odd) > most else ""
    n = counts[common]
    return (
        f"{n} of {len(keys)} give{'s' * (n == 1)} {shown(common)}, but {listed}{more}; "
        f"fix those parts' names or transforms"
    )


def _free(shape: tuple[int, ...], axis: int) -> str:
    """``shape`` with a ``*`` for the size along ``axis``, which parts of a Concat may
    differ in."""
    return f"({', '.join('*' if i == axis else str(d) for i, d in enumerate(shape))})"


def _named(node: Node, most: int = 3) -> str:
    """A part as a message names it: its stored tensor (dtype, and the stored shape where
    the transforms change it), or the tensors a nested Stack or Concat reads."""
    if isinstance(node, Leaf):
        held = node.stored
        stored = held.dtype if held.shape == node.result else f"stored {held.dtype} {held.shape}"
        return f"tensor {printable(held.name)!r} ({stored})"
    names = [repr(printable(leaf.stored.name)) for leaf in leaves(node)]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"({'Stack' if node.stacked else 'Concat'} of {', '.join(names[:most])}{more})"


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
    groups = None
    if why is None and tensor.out_shape is not None:
        view = tuple(shape[a] for a in order)
        groups = merges(view, tensor.out_shape)
        if groups is None:
            why = (
                f"out_shape={tensor.out_shape} does not merge side-by-side axes of the "
                f"transposed view {view}"
            )
    if why is not None:
        raise Refused(
            f"{label}tensor {printable(tensor.name)!r} in {held.file.name}, stored "
            f"{held.dtype} {held.shape}, {why}"
        )
    return Leaf(tensor, held, index, shape, order, label, groups)


def merges(view: tuple[int, ...], out: tuple[int, ...]) -> tuple[int, ...] | None:
    """How many axes of ``view`` each axis of ``out`` merges (an axis of size 1 may
    merge none), or None where ``out`` is no such merge of ``view``."""
    if 0 in view or 0 in out:
        return tuple([1] * len(view)) if view == out else None
    groups, k = [], 0
    for n in out:
        size, start = 1, k
        while size < n and k < len(view):
            size, k = size * view[k], k + 1
        if size != n:
            return None
        groups.append(k - start)
    while k < len(view) and view[k] == 1:  # trailing axes of size 1 join the last group
        k += 1
        if groups:
            groups[-1] += 1
    return tuple(groups) if k == len(view) and groups else None


def unmerge(
    index: tuple[slice, ...], groups: tuple[int, ...], view: tuple[int, ...]
) -> tuple[slice, ...] | None:
    """The slices of the view that a block at ``index`` of the merged shape covers, or
    None where the block is no rectangle of the view (it cuts a merged axis within an
    inner row)."""
    out: list[slice] = []
    k = 0
    for s, g in zip(index, groups, strict=True):
        dims = view[k : k + g]
        k += g
        part = _split(s.start, s.stop, dims)
        if part is None:
            return None
        out += part
    return tuple(out)


def _split(a: int, b: int, dims: tuple[int, ...]) -> list[slice] | None:
    if not dims:
        return []
    if b <= a:
        return [slice(0, 0)] + [slice(0, d) for d in dims[1:]]
    if len(dims) == 1:
        return [slice(a, b)]
    inner = math.prod(dims[1:])
    if a % inner == 0 and b % inner == 0:
        return [slice(a // inner, b // inner)] + [slice(0, d) for d in dims[1:]]
    row = a // inner
    if row == (b - 1) // inner:
        rest = _split(a - row * inner, b - row * inner, dims[1:])
        return None if rest is None else [slice(row, row + 1), *rest]
    return None


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


def _leaf_index(node: Leaf, index: tuple[slice, ...]) -> tuple[slice, ...]:
    """The index of the leaf's transposed view that a block at ``index`` of its result
    covers; :class:`Refused` where the block cuts a merged axis inside a row."""
    if node.groups is None:
        return index
    at = unmerge(index, node.groups, node.view)
    if at is None:
        bounds = ", ".join(f"{s.start}:{s.stop}" for s in index)
        raise Refused(
            f"{node.label}out_shape={node.tensor.out_shape}: the block [{bounds}] cuts "
            f"a merged axis within a row of the view {node.view}; shard the merged "
            f"axis into whole rows, or not at all"
        )
    return at


def _parts(
    node: Joined, index: tuple[slice, ...]
) -> list[tuple[Node, tuple[slice, ...], tuple[Any, ...]]]:
    """The parts a block at ``index`` reaches: each with its own index and where its
    block goes in the joined block."""
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


def block(
    node: Node, index: tuple[slice, ...], read: Callable[[Leaf, tuple], Any], dtype: Any
) -> Any:
    """The parameter's block at ``index`` (slices with resolved bounds, one per axis of
    ``node.result``), in ``dtype``, asking ``read(leaf, index)`` for each stored tensor's
    part of it (at an index of its transposed view): parts the block does not reach are
    never asked. Where it joins several parts, each part's block is written into the
    joined block as soon as it is read (its bytes, and its file, are not needed after);
    where it reaches one, that part's block is returned as it is (a view: no copy)."""
    if isinstance(node, Leaf):
        got = read(node, _leaf_index(node, index))
        return got if node.groups is None else got.reshape(tuple(s.stop - s.start for s in index))
    parts = _parts(node, index)
    if len(parts) == 1:
        part, sub, _ = parts[0]
        got = block(part, sub, read, dtype)
        return np.expand_dims(got, node.axis) if node.stacked else got
    out = np.empty(tuple(max(0, s.stop - s.start) for s in index), dtype)
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
    return [found for part, sub, _ in _parts(node, index) for found in reached(part, sub)]


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
