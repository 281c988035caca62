"""The geometry of a float8 weight's view (:func:`geometry`): each axis of a leaf's
transposed view moves ``dr`` stored rows or ``dc`` stored columns per step (an axis
that does both, a merge of rows into columns, is refused at plan time). A Stack of
such leaves with equal geometry adds axes that move between leaves (:func:`axes`):
every leaf a block reaches is read at the same index, so one origin serves them all.
"""

from __future__ import annotations

import math

import numpy as np

from ...layout import blocks as _blocks

Axis = tuple[int, int, int]  # per step: leaves, stored rows, stored columns


def geometry(leaf: _blocks.Leaf) -> tuple[tuple[int, int], list[tuple[int, int]]] | str:
    """The stored (row, column) of the view's first element and, per axis of the
    transposed view, the (rows, columns) one step moves; or why the view mixes rows
    and columns in one axis. Worked out on a strided stand-in: no memory is read."""
    rows, cols = leaf.stored.shape
    base = np.zeros(1, np.uint8)
    fake = np.lib.stride_tricks.as_strided(base, (rows, cols), (cols, 1), writeable=False)
    view = fake[leaf.index] if leaf.index else fake
    try:
        shaped = _viewed(view, leaf.shape)  # a view or an error, never a copy
    except (AttributeError, ValueError):
        return "its reshape cannot be followed as a view"
    shaped = shaped.transpose(leaf.order)
    start = shaped.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    origin = (start // cols, start % cols) if cols else (0, 0)
    steps, low, high = [], origin[1], origin[1]
    for n, stride in zip(shaped.shape, shaped.strides, strict=True):
        if n == 1 or cols == 0:
            steps.append((0, 0))
        elif stride % cols == 0:
            steps.append((stride // cols, 0))
        else:
            steps.append((0, stride))
            low, high = low + min(0, (n - 1) * stride), high + max(0, (n - 1) * stride)
    if low < 0 or high >= max(cols, 1):
        return "an axis of its view steps across stored rows and columns at once (a merge)"
    return origin, steps


def _viewed(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return array.reshape(shape, copy=False)  # type: ignore[call-overload,unused-ignore]
    except TypeError:  # numpy < 2.1: setting the shape never copies either
        shaped = array.view()
        shaped.shape = shape
        return shaped


def axes(node: _blocks.Node, sizes: tuple[int, ...]) -> tuple[_blocks.Leaf, list[Axis]]:
    """A leaf of ``node`` (all have its geometry) and each axis of a block of ``sizes``
    as (leaves, rows, columns) per step, leaves counted in :func:`blocks.reached`'s
    order."""
    if isinstance(node, _blocks.Leaf):
        got = geometry(node)
        assert not isinstance(got, str)  # refused at plan time
        return node, [(0, dr, dc) for dr, dc in got[1]]
    assert isinstance(node, _blocks.Joined) and node.stacked  # refused at plan time
    inner = sizes[: node.axis] + sizes[node.axis + 1 :]
    leaf, found = axes(node.parts[0], inner)
    per = math.prod(inner[k] for k, a in enumerate(found) if a[0]) or 1
    found.insert(node.axis, (per, 0, 0))
    return leaf, found
