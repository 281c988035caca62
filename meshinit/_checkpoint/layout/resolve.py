"""A plan path's target resolved against the checked files: the parts of
:mod:`.blocks` that a device's block is read from.

:func:`resolve` checks a target (a :class:`~meshinit.safetensors.Tensor`, a
:class:`~meshinit.safetensors.Stack` or :class:`~meshinit.safetensors.Concat` of parts,
a :class:`~meshinit.safetensors.Fill`, a :class:`~meshinit.safetensors.Pad`) against
the stored tensors before anything is read: every part is in the files, of a kind the
planned dtype can hold, sliced, reshaped and transposed as numpy would, every constant
fits the planned dtype, and the parts fit together into the planned shape. Each
problem names the part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ..._errors import printable
from ..store.header import READABLE
from ..store.source import Stored
from .blocks import Const, Joined, Leaf, Node, Padded, Refused, constant, leaves
from .blocks import check as check
from .blocks import merging as merging
from .parts import Concat, Fill, Pad, Stack, Target, Tensor, length
from .reshape import merges, viewable

__all__ = ["Leaf", "Node", "Refused", "check", "describe", "leaves", "merging", "resolve"]


def resolve(
    target: Target,
    stored: Mapping[str, Stored],
    why_not: Callable[[Stored], str | None],
    shape: tuple[int, ...] | None = None,
    dtype: Any = None,
) -> Node:
    """``target`` checked against the stored tensors; :class:`Refused` saying why not.

    ``why_not(stored)`` says why a stored tensor's dtype cannot be read into the
    planned one (None: it can). ``shape`` and ``dtype`` are the planned ones: the shape
    of a whole-target :class:`Fill` or :class:`Pad` without one, the dtype every
    constant must fit (None: not checked). Absent tensors are gathered from every part,
    so that one message names them all."""
    missing: list[tuple[str, str]] = []
    node = _resolve(target, stored, why_not, "", missing, shape, dtype)
    if missing:
        names = ", ".join(f"{label}{name!r}".strip() for label, name in missing)
        raise Refused(f"not in the files: {names}", missing)
    assert node is not None
    return node


def _resolve(
    target: Target,
    stored: Mapping[str, Stored],
    why_not: Callable[[Stored], str | None],
    label: str,
    missing: list[tuple[str, str]],
    planned: tuple[int, ...] | None,
    dtype: Any,
) -> Node | None:
    if isinstance(target, Tensor):
        held = stored.get(target.name)
        if held is None:
            missing.append((label, target.name))
            return None
        return _leaf(target, held, why_not, label)
    if isinstance(target, Fill | Pad):
        shape = planned if target.shape is None else target.shape
        kind = type(target).__name__
        if shape is None:  # the parts refuse it nested: a whole target without a plan
            raise Refused(f"{label}{kind} with shape=None takes the planned shape; give it one")
        why = None if dtype is None else constant(target.value, dtype)[1]
        if why is not None:
            raise Refused(f"{label}{kind} value {target.value!r} {why}; plan a wider dtype")
        if isinstance(target, Fill):
            return Const(target.value, shape, label)
        part = _resolve(target.part, stored, why_not, f"{label}Pad part ", missing, None, dtype)
        if part is None:
            return None
        rank = len(shape) == len(part.result)
        if not rank or any(s < n for s, n in zip(shape, part.result, strict=True)):
            how = "is smaller than" if rank else "has another rank than"
            raise Refused(
                f"{label}Pad shape={shape} {how} its part {_named(part)}, which gives "
                f"{part.result}; a Pad only adds after the part, on each axis"
            )
        return Padded(part, shape, target.value, label)
    return _join(target, stored, why_not, label, missing, dtype)


def _join(
    target: Stack | Concat,
    stored: Mapping[str, Stored],
    why_not: Callable[[Stored], str | None],
    label: str,
    missing: list[tuple[str, str]],
    dtype: Any,
) -> Joined | None:
    kind = type(target).__name__
    parts = [
        _resolve(part, stored, why_not, f"{label}{kind} part [{i}] ", missing, None, dtype)
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
        shape = (*first[:axis], len(nodes), *first[axis:])
        starts = tuple(range(len(nodes)))
    else:
        # what must agree: the rank, and every size but the axis's
        cut = [(len(s), s[:axis] + s[axis + 1 :]) for s in shapes]
        if any(c != cut[0] for c in cut):
            odd = _odd(nodes, cut, lambda c: _free(shapes[cut.index(c)], axis))
            raise Refused(f"{label}Concat parts must agree on every axis but {axis}: {odd}")
        sizes = [s[axis] for s in shapes]
        starts = tuple(int(x) for x in np.cumsum([0, *sizes[:-1]]))
        shape = (*first[:axis], sum(sizes), *first[axis + 1 :])
    groups = order = None
    merged = shape
    if target.out_shape is not None:
        groups = merges(shape, target.out_shape)
        if groups is None:
            raise Refused(
                f"{label}{kind} out_shape={target.out_shape} does not merge side-by-side "
                f"axes of the joined shape {shape}"
            )
        merged = target.out_shape
    if target.permute is not None:
        n = len(merged)
        order = tuple(a + n if a < 0 else a for a in target.permute)
        if sorted(order) != list(range(n)):
            raise Refused(
                f"{label}{kind} permute={target.permute} is not an order of the {n} axes of "
                f"{merged}"
            )
    return Joined(
        tuple(nodes), axis, stacked, shape, starts, label, target.out_shape, groups, order
    )


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
    the transforms change it), its constant, or the tensors a nested Stack, Concat or
    Pad reads."""
    if isinstance(node, Leaf):
        held = node.stored
        stored = held.dtype if held.shape == node.result else f"stored {held.dtype} {held.shape}"
        return f"tensor {printable(held.name)!r} ({stored})"
    if isinstance(node, Const):
        return f"Fill({node.value!r})"
    names = [repr(printable(leaf.stored.name)) for leaf in leaves(node)]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    kind = "Pad" if isinstance(node, Padded) else node.kind
    return f"({kind} of {', '.join(names[:most]) or 'no stored tensor'}{more})"


def describe(node: Node) -> str:
    """How a message about the planned shape names what a target gives: a Stack or
    Concat by its parts and transforms, a constant or a pad by what it holds."""
    if isinstance(node, Joined):
        how = [f"{node.kind} of {len(node.parts)} parts along axis {node.axis}"]
        if node.out_shape is not None:
            how.append(f"out_shape={node.out_shape}")
        if node.order is not None:
            how.append(f"permute={node.order}")
        return ", ".join(how)
    if isinstance(node, Padded):
        return f"Pad of {_named(node.part)}"
    if isinstance(node, Const):
        return f"Fill({node.value!r})"
    return _named(node)


def _leaf(
    tensor: Tensor,
    held: Stored,
    why_not: Callable[[Stored], str | None],
    label: str,
) -> Leaf:
    why = why_not(held)
    index: tuple[slice, ...] = ()
    shape: tuple[int, ...] = ()
    order: tuple[int, ...] = ()
    floating = jax.dtypes.issubdtype(READABLE.get(held.dtype, np.int8), np.floating)
    for what, done in (("scale", "scaled"), ("offset", "offset")):
        if why is None and getattr(tensor, what) is not None and not floating:
            why = f"cannot be {done}: {what}= is for floating-point tensors"
    if why is None:
        try:
            index = tensor.sliced(held.shape)
            shape, order = tensor.transformed(tuple(length(s) for s in index))
        except ValueError as e:
            why = str(e)
        else:
            if tensor.index is not None and not viewable(held.shape, index, shape):
                why = (
                    f"index={tensor.index} then shape={tensor.shape}: the slice cannot be "
                    f"reshaped without a copy of all of it (the reshape merges a sliced or "
                    f"stepped axis); slice a whole row range instead, or reshape without index"
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
