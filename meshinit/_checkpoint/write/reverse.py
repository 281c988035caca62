"""``names=`` read in reverse: each stored tensor of an export made from the parameters
that the loader would fill from it (:func:`recipes`).

The loader fills a parameter from its target (:mod:`..layout.parts`); the export walks
the same target from the parameter down to each stored tensor it reads, undoing each
step on the devices:

- a :class:`Tensor`'s ``out_shape``, ``permute`` and ``shape`` are undone in reverse
  order, and its ``index`` places the result in its slice of the stored tensor;
- a :class:`Stack` gives one part per index of its axis (taken at run time, so every
  layer of a scanned parameter shares one program); a :class:`Concat` its parts, each
  its slice of the joined axis; a :class:`Pad` its part, the padding dropped; a
  :class:`Fill` nothing.

A join's parts and a pad's part must say their shapes where the parameter does not:
each of a :class:`Concat`'s parts but one its length along the joined axis, a
:class:`Pad`'s part its shape (a ``-1`` in it an axis the pad does not pad), each as a
:class:`Tensor` with ``shape=``; an ``out_shape`` the axes it merged.

What the parameters do not say is not guessed:

- **The stored shape of a reshape.** The loader reshapes the stored tensor (or its
  slice) to ``shape``; the export reads ``shape`` as the maps write it, as splits of
  stored axes: each run of given sizes is one stored axis, split, and each ``-1`` one
  stored axis kept whole (``shape=(heads, head_dim, -1)`` of a ``(heads * head_dim,
  d)`` weight). A map whose reshape is another one (a ``(heads, head_dim * d)``
  tensor reshaped to ``(heads, head_dim, -1)``) writes a tensor of another shape, with
  the same bytes in the same order: give such a tensor its stored shape as a
  :class:`Tensor` without ``shape``, and the parameter's own reshape elsewhere.
- **A stored tensor's extent.** Each axis is as long as the slices of the parameters
  that write it reach; then each slice is resolved against that shape as the loader
  resolves it, and the slices must tile the stored tensor exactly, once each.

Every problem names the stored tensor or the plan path, and the whole export is
refused before a byte is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..._errors import Problem
from ..layout.parts import Concat, Fill, Pad, Stack, Target, Tensor
from ..layout.recipe import Recipe
from ..layout.reshape import runs
from .assemble import Leaf, Op, recipe


class _Refused(Exception):
    """A target the export cannot undo; its message says why."""


def recipes(
    table: Mapping[str, Target | None], planned: Mapping[str, tuple[tuple[int, ...], Any]]
) -> tuple[list[Recipe], list[Problem]]:
    """The export's stored tensors, in the order of the plan paths that write them first,
    from each path's target in ``table`` (a path it lacks is not written; None and
    :class:`Fill` write nothing), and every problem, each naming a path or a stored
    tensor."""
    problems: list[Problem] = []
    leaves: dict[str, list[Leaf]] = {}
    for path, (shape, _) in planned.items():
        target = table.get(path)
        if target is None:
            continue
        try:
            for leaf in _walk(target, path, tuple(shape), (), (), path):
                leaves.setdefault(leaf.tensor.name, []).append(leaf)
        except _Refused as e:
            problems.append(Problem(path, str(e)))
    made = []
    for name, writers in leaves.items():
        one = recipe(name, writers, planned, problems)
        if one is not None:
            made.append(one)
    return made, problems


# --------------------------------------------------------------- from a target down


def _walk(
    target: Target,
    path: str,
    shape: tuple[int, ...],
    ops: tuple[Op, ...],
    at: tuple[int, ...],
    origin: str,
) -> list[Leaf]:
    """The leaves of ``target``, a part of shape ``shape`` reached from the parameter
    by ``ops``."""
    if isinstance(target, Fill):
        return []
    if isinstance(target, Tensor):
        return [_tensor(target, path, shape, ops, at, origin)]
    if isinstance(target, Pad):
        inner = _own_shape(target.part, None)
        if inner is not None and len(inner) == len(shape):  # a -1: an axis it does not pad
            inner = tuple(shape[a] if n is None else n for a, n in enumerate(inner))
        if inner is None or len(inner) != len(shape):
            raise _Refused(
                f"its Pad's part {_said(target.part)} has no shape the export can know "
                f"(give it a Tensor with shape=, or a Stack or Concat of such parts)"
            )
        steps = tuple(("slice", a, 0, n) for a, n in enumerate(inner) if n != shape[a])
        return _walk(target.part, path, inner, ops + steps, at, origin)
    assert isinstance(target, Stack | Concat)
    joined = _unjoin(target, shape)
    ops = ops + joined
    pre = _apply_shape(shape, joined)
    n = len(target.parts)
    axis = target.axis + (len(pre) if target.axis < 0 else 0)
    leaves = []
    if isinstance(target, Stack):
        part_shape = pre[:axis] + pre[axis + 1 :]
        for i, part in enumerate(target.parts):
            leaves += _walk(
                part, path, part_shape, (*ops, ("take", axis)), (*at, i), f"{origin}[{i}]"
            )
        return leaves
    sizes = _concat_sizes(target, pre, axis)
    start = 0
    for i, (part, size) in enumerate(zip(target.parts, sizes, strict=True)):
        part_shape = pre[:axis] + (size,) + pre[axis + 1 :]
        step = ("slice", axis, start, size)
        leaves += _walk(part, path, part_shape, (*ops, step), at, f"{origin}[{i}]")
        start += size
    assert n == len(sizes)
    return leaves


def _unjoin(target: Stack | Concat, shape: tuple[int, ...]) -> tuple[Op, ...]:
    """The steps that undo a join's ``permute`` and ``out_shape``: to the joined shape."""
    steps: list[Op] = []
    if target.permute is not None:
        order = _order(target.permute, len(shape))
        steps.append(("T", tuple(np.argsort(order))))
        shape = tuple(shape[a] for a in np.argsort(order))
    if target.out_shape is not None:
        if tuple(target.out_shape) != shape:
            raise _Refused(
                f"its {type(target).__name__}'s out_shape {target.out_shape} is not the "
                f"parameter's shape {shape}"
            )
        pre = _joined_shape(target, math.prod(shape))
        if pre is None:
            raise _Refused(
                f"its {type(target).__name__} has out_shape={target.out_shape}, and its parts "
                f"do not say which axes it merged (give each part a Tensor with shape=)"
            )
        steps.append(("R", pre))
    return tuple(steps)


def _joined_shape(target: Stack | Concat, size: int) -> tuple[int, ...] | None:
    """The shape of a join before its ``out_shape``, from its parts' own shapes."""
    n = len(target.parts)
    if isinstance(target, Stack):
        if size % n:
            return None
        part = _own_shape(target.parts[0], size // n)
        if part is None or None in part:
            return None
        axis = target.axis + (len(part) + 1 if target.axis < 0 else 0)
        return part[:axis] + (n,) + part[axis:]
    shapes = [_own_shape(p, None) for p in target.parts]
    if any(s is None or None in s for s in shapes):
        return None  # (a part's -1 could be resolved from the others: not needed yet)
    first = shapes[0]
    assert first is not None
    axis = target.axis + (len(first) if target.axis < 0 else 0)
    total = sum(s[axis] for s in shapes if s is not None)
    return first[:axis] + (total,) + first[axis + 1 :]


def _own_shape(target: Target, size: int | None) -> tuple[Any, ...] | None:
    """A part's shape where the part itself says it (``size``: its element count where
    known; without it a Tensor's ``-1`` is None in the shape), else None."""
    if isinstance(target, Fill | Pad):
        return target.shape
    if isinstance(target, Tensor):
        if target.out_shape is not None:
            return tuple(target.out_shape)
        if target.shape is None:
            return None
        shape: tuple[Any, ...] = target.shape
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            if size is not None and (known == 0 or size % known):
                return None
            rest = None if size is None else size // known
            shape = tuple(rest if d == -1 else d for d in shape)
        order = _order(target.permute, len(shape)) if target.permute is not None else None
        return tuple(shape[a] for a in order) if order is not None else tuple(shape)
    assert isinstance(target, Stack | Concat)
    if target.out_shape is not None:
        pre: tuple[int, ...] | None = tuple(target.out_shape)
    else:
        pre = _joined_shape(target, size) if size is not None else _joined_shape_unsized(target)
    if pre is None or target.permute is None:
        return pre
    order = _order(target.permute, len(pre))
    return tuple(pre[a] for a in order)


def _joined_shape_unsized(target: Stack | Concat) -> tuple[int, ...] | None:
    if isinstance(target, Stack):
        part = _own_shape(target.parts[0], None)
        if part is None or None in part:
            return None
        axis = target.axis + (len(part) + 1 if target.axis < 0 else 0)
        return part[:axis] + (len(target.parts),) + part[axis:]
    return _joined_shape(target, 0)


def _concat_sizes(target: Concat, pre: tuple[int, ...], axis: int) -> list[int]:
    """Each part's length along a Concat's axis: from the parts' own shapes, one part
    that does not say taking what the others leave."""
    own = [_own_shape(p, None) for p in target.parts]
    sizes = [s[axis] if s is not None and len(s) == len(pre) else None for s in own]
    unknown = [i for i, s in enumerate(sizes) if s is None]
    if len(unknown) > 1:
        raise _Refused(
            f"its Concat's parts {[_said(target.parts[i]) for i in unknown]} do not say "
            f"their length along axis {target.axis} (give all but one a Tensor with shape=)"
        )
    given = sum(s for s in sizes if s is not None)
    if unknown:
        sizes[unknown[0]] = pre[axis] - given
    if any(s is None or s < 0 for s in sizes) or sum(s or 0 for s in sizes) != pre[axis]:
        raise _Refused(
            f"its Concat's parts are {sizes} long along axis {target.axis}, the parameter "
            f"{pre[axis]}"
        )
    return [s for s in sizes if s is not None]


def _tensor(
    t: Tensor,
    path: str,
    shape: tuple[int, ...],
    ops: tuple[Op, ...],
    at: tuple[int, ...],
    origin: str,
) -> Leaf:
    """The leaf of one :class:`Tensor` part of shape ``shape``: its steps undone."""
    if t.scale is not None or t.offset is not None:
        what = "scale" if t.scale is not None else "offset"
        raise _Refused(
            f"Tensor {t.name!r} has {what}={getattr(t, what)!r}, which has no saving hook: "
            f"export the parameter through a map that inverts it, or write it unscaled"
        )
    size = math.prod(shape)
    steps: list[Op] = []
    view = shape  # the loader's transposed view, before out_shape
    if t.out_shape is not None:
        if tuple(t.out_shape) != shape:
            raise _Refused(
                f"Tensor {t.name!r}: out_shape {t.out_shape} is not the part's shape {shape}"
            )
        if t.shape is None:
            raise _Refused(
                f"Tensor {t.name!r} has out_shape= without shape=: the axes it merged are not "
                f"known (give shape=)"
            )
    if t.shape is not None:
        known = math.prod(d for d in t.shape if d != -1)
        if (-1 in t.shape and (known == 0 or size % known)) or (
            -1 not in t.shape and known != size
        ):
            raise _Refused(f"Tensor {t.name!r}: shape={t.shape} does not hold {shape}")
        resolved = tuple(size // known if d == -1 else d for d in t.shape)
        order = _order(t.permute, len(resolved)) if t.permute is not None else None
        view = tuple(resolved[a] for a in order) if order is not None else resolved
        if t.out_shape is not None:
            steps.append(("R", view))
        elif view != shape:
            raise _Refused(
                f"Tensor {t.name!r}: shape={t.shape} permuted is {view}, the part {shape}"
            )
        if order is not None:
            steps.append(("T", tuple(int(a) for a in np.argsort(order))))
        region = runs(t.shape, resolved)
        steps.append(("R", region))
    else:
        if t.permute is not None:
            order = _order(t.permute, len(shape))
            inverse = tuple(int(a) for a in np.argsort(order))
            steps.append(("T", inverse))
            region = tuple(shape[a] for a in inverse)
        else:
            region = shape
    return Leaf(t, path, ops + tuple(steps), at, region, origin)


def _order(permute: Sequence[int], n: int) -> tuple[int, ...]:
    order = tuple(a + n if a < 0 else a for a in permute)
    if sorted(order) != list(range(n)):
        raise _Refused(f"permute={tuple(permute)} is not an order of {n} axes")
    return order


def _apply_shape(shape: tuple[int, ...], steps: tuple[Op, ...]) -> tuple[int, ...]:
    for step in steps:
        if step[0] == "T":
            shape = tuple(shape[a] for a in step[1])
        elif step[0] == "R":
            shape = tuple(step[1])
    return shape


def _said(target: Target) -> str:
    return repr(target.name) if isinstance(target, Tensor) else type(target).__name__
