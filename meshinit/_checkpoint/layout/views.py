"""A stored tensor's view as a framework's hook leaves it, in the normal form a
:class:`~meshinit.safetensors.Tensor` reads: ``stored[index]`` (basic slices, positive
steps), reshaped by splits only (:attr:`View.base`), permuted, then side-by-side axes
merged (:attr:`View.groups`), then a scale and an offset. :func:`reshaped` and
:func:`sliced` keep that form through a hook's reshapes and indexing, or raise
:class:`Inexpressible`. Used by :mod:`.trace`."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import parts as _names
from .reshape import viewable


class Inexpressible(Exception):
    """A hook asked for an operation no ``names=`` target can express."""


@dataclasses.dataclass
class View:
    """One stored tensor: ``stored[index]`` reshaped to ``base`` (only splits: each
    base axis is a piece of one sliced axis), its axes in the order of ``groups``
    flattened, each group merged into one result axis."""

    name: str
    stored: tuple[int, ...]
    index: list[slice]
    base: list[int]  # sizes, row-major in the sliced tensor
    origin: list[int | None]  # the stored axis a base axis is all of, None if split
    groups: list[list[int]]  # result axes: base positions
    scale: float | None = None
    offset: float | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod([self.base[b] for b in g]) for g in self.groups)

    def regrouped(self, groups: list[list[int]]) -> View:
        """This view with ``groups`` (its lists shared: a step copies what it changes)."""
        return View(
            self.name,
            self.stored,
            self.index,
            self.base,
            self.origin,
            groups,
            self.scale,
            self.offset,
        )

    def target(self) -> _names.Tensor:
        """The :class:`~.parts.Tensor` that reads this view, in its simplest form: base
        axes that a result axis merges and that lie side by side in the stored order
        are one axis of the reshape (``shape=(24,)``, not ``out_shape=(24,)``), which
        a sharding may cut anywhere."""
        whole = all(s == slice(0, n, 1) for s, n in zip(self.index, self.stored, strict=True))
        sliced = (
            self.stored
            if whole
            else tuple(
                len(range(*s.indices(n))) for s, n in zip(self.index, self.stored, strict=True)
            )
        )
        base, groups = _fewest(self, *_units_in_place(self.base, self.groups), whole)
        order = [b for g in groups for b in g]
        merged = any(len(g) != 1 for g in groups)
        return _names.Tensor(
            self.name,
            index=None if whole else tuple(self.index),
            shape=None if tuple(base) == sliced else tuple(base),
            permute=None if order == sorted(order) else tuple(order),
            out_shape=self.shape if merged else None,
            scale=self.scale,
            offset=self.offset,
        )


def _units_in_place(base: list[int], groups: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """``base`` and ``groups`` with each base axis of size 1 moved (which changes no
    value) to just after the one before it in the result: no permutation for them."""
    flat = [b for g in groups for b in g]
    units = {b for b in flat if base[b] == 1}
    if not units:
        return base, groups
    order = [b for b in range(len(base)) if b not in units]
    for i, b in enumerate(flat):
        if b in units:
            order.insert(order.index(flat[i - 1]) + 1 if i else 0, b)
    renumber = {b: k for k, b in enumerate(order)}
    return [base[b] for b in order], [[renumber[b] for b in g] for g in groups]


def _fewest(
    v: View, base: list[int], groups: list[list[int]], whole: bool
) -> tuple[list[int], list[list[int]]]:
    """``base`` and ``groups`` (``v``'s) with every pair of base axes ``b, b + 1``
    that one group holds in that order merged into one (where the sliced tensor still
    reshapes to it without a copy)."""
    base, groups = list(base), [list(g) for g in groups]
    merged = True
    while merged:
        merged = False
        for g in groups:
            for j, b in enumerate(g[:-1]):
                if g[j + 1] != b + 1:
                    continue
                fewer = [*base[:b], base[b] * base[b + 1], *base[b + 2 :]]
                if not (whole or viewable(v.stored, (*v.index,), (*fewer,))):
                    continue
                base, g[j : j + 2], merged = fewer, [b], True
                for h in groups:
                    h[:] = [x - 1 if x > b else x for x in h]
                break
            if merged:
                break
    return base, groups


def prod(xs: Sequence[int]) -> int:
    return math.prod(xs)


def resolved(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise Inexpressible(f"a reshape to {shape}")
    if -1 in shape:
        known = prod([d for d in shape if d != -1])
        if known == 0 or size % known:
            raise Inexpressible(f"a reshape of {size} elements to {shape}")
        shape = tuple(size // known if d == -1 else d for d in shape)
    if prod(shape) != size:
        raise Inexpressible(f"a reshape of {size} elements to {shape}")
    return shape


def reshaped(v: View, new: tuple[int, ...]) -> View:
    """``v`` reshaped to ``new``. The view's elements run row-major over its base
    axes in result order, so ``new``'s axes are runs of that sequence, a base axis
    split in two where a run ends inside it."""
    shape = v.shape
    if [d for d in shape if d != 1] == [d for d in new if d != 1]:
        return _units(v, shape, new)  # unit axes come or go (np.stack's expand_dims)
    v = View(
        v.name,
        v.stored,
        v.index,  # not changed here: shared
        list(v.base),
        list(v.origin),
        [list(g) for g in v.groups],  # split_axes renumbers them in place
        v.scale,
        v.offset,
    )
    seq = [b for g in v.groups for b in g if v.base[b] != 1]
    return _kept(v, split_axes(v, seq, new))


def _units(v: View, shape: tuple[int, ...], new: tuple[int, ...]) -> View:
    """``v`` reshaped to ``new``, which only adds or drops axes of size 1."""
    base, origin = list(v.base), list(v.origin)
    kept = iter([g for g, n in zip(v.groups, shape, strict=True) if n != 1])
    groups = []
    for d in new:
        if d == 1:
            base.append(1)
            origin.append(None)
        groups.append([len(base) - 1] if d == 1 else list(next(kept)))
    return _kept(View(v.name, v.stored, v.index, base, origin, groups, v.scale, v.offset), groups)


def _kept(v: View, groups: list[list[int]]) -> View:
    """``v`` with ``groups``, less the base axes (all of size 1) no group holds."""
    held = {b for g in groups for b in g}
    if len(held) == len(v.base):
        v.groups = groups
        return v
    keep = [b for b in range(len(v.base)) if b in held]
    renumber = {b: k for k, b in enumerate(keep)}
    v.base = [v.base[b] for b in keep]
    v.origin = [v.origin[b] for b in keep]
    v.groups = [[renumber[b] for b in g] for g in groups]
    return v


def split_axes(v: View, seq: list[int], sizes: tuple[int, ...]) -> list[list[int]]:
    """The base axes ``seq`` (in view order) cut into runs of ``sizes``, a base axis
    split where a run ends inside it (it must divide); a size-1 axis gets a base axis
    of its own."""
    out: list[list[int]] = []
    seq = list(seq)
    k = 0
    for n in sizes:
        group: list[int] = []
        size = 1
        while size < n:
            if k >= len(seq):
                raise Inexpressible(f"a reshape to {sizes}")
            b = seq[k]
            if n % size:
                raise Inexpressible(f"a reshape to {sizes} that cuts an axis unevenly")
            if size * v.base[b] <= n:
                group.append(b)
                size *= v.base[b]
                k += 1
                continue
            need = n // size
            if v.base[b] % need:
                raise Inexpressible(f"a reshape to {sizes} that cuts an axis unevenly")
            # base axis b becomes (need, rest): rest is a new base axis right after it
            v.base[b : b + 1] = [need, v.base[b] // need]
            v.origin[b : b + 1] = [None, None]
            shift = functools.partial(after, b)
            for g in (*v.groups, *out):
                g[:] = map(shift, g)
            group = [*map(shift, group), b]
            seq = [*map(shift, seq[: k + 1]), b + 1, *map(shift, seq[k + 1 :])]
            seq.pop(k)  # b itself is in the group now; b + 1 comes next
            k_next = k
            size *= need
            k = k_next
        if size != n:
            raise Inexpressible(f"a reshape to {sizes} that cuts an axis unevenly")
        if not group:  # an axis of size 1
            v.base.append(1)
            v.origin.append(None)
            group = [len(v.base) - 1]
        out.append(group)
    if k != len(seq):
        raise Inexpressible(f"a reshape to {sizes}")
    return out


def after(b: int, x: int) -> int:
    """Base position ``x`` once base axis ``b`` is split in two."""
    return x + 1 if x > b else x


def sliced(v: View, key: Any) -> View:
    """``v[key]``: basic slices (with a positive step) and ints of result axes that are
    whole stored axes, pushed into the stored index; None adds an axis of size 1."""
    key = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise Inexpressible(f"an index {key}")
    real = sum(k is not None and k is not Ellipsis for k in key)
    if Ellipsis in key:
        e = key.index(Ellipsis)
        key = key[:e] + (slice(None),) * (len(v.groups) - real) + key[e + 1 :]
    key = key + (slice(None),) * (len(v.groups) - sum(k is not None for k in key))
    original = [list(g) for g in v.groups]
    v = dataclasses.replace(v, base=list(v.base), origin=list(v.origin), index=list(v.index))
    groups: list[list[int]] = []
    axis = 0
    for k in key:
        if k is None:
            v.base.append(1)
            v.origin.append(None)
            groups.append([len(v.base) - 1])
            continue
        g = original[axis]
        n = prod([v.base[b] for b in g])
        axis += 1
        if isinstance(k, slice) and k.indices(n) == (0, n, 1):
            groups.append(g)
            continue
        drop = False
        if isinstance(k, int | np.integer) and not isinstance(k, bool):
            i = operator.index(k)
            if not -n <= i < n:
                raise Inexpressible(f"index {i} of an axis of {n}")
            k, drop = slice(i % n, i % n + 1), True
        elif not isinstance(k, slice):
            raise Inexpressible(f"an index by {type(k).__name__}")
        if len(g) != 1 or v.origin[g[0]] is None:
            raise Inexpressible("a slice of an axis that a reshape split or merged")
        b = g[0]
        a = v.origin[b]
        assert a is not None
        start, stop, step = k.indices(n)
        if step <= 0:
            raise Inexpressible("a slice with a negative step")
        count = len(range(start, stop, step))
        s0, _, st0 = v.index[a].indices(v.stored[a])
        first, stride = s0 + start * st0, st0 * step
        v.index[a] = slice(first, first + (count - 1) * stride + 1 if count else first, stride)
        v.base[b] = count
        if not drop:
            groups.append(g)
    held = {b for g in groups for b in g}
    keep = [b for b in range(len(v.base)) if b in held]  # the rest: size 1, dropped
    renumber = {b: k for k, b in enumerate(keep)}
    v.base = [v.base[b] for b in keep]
    v.origin = [v.origin[b] for b in keep]
    v.groups = [[renumber[b] for b in g] for g in groups]
    return v


@dataclasses.dataclass(frozen=True)
class Pending:
    """A slice of one result axis that no stored index can take (the axis was split
    out of a stored one): only a join of all of that axis's equal slices, in order,
    can use it (as a split of the axis)."""

    view: View
    axis: int
    start: int
    stop: int


def pending(v: View, key: Any) -> Pending | None:
    key = key if isinstance(key, tuple) else (key,)
    if Ellipsis in key:
        e = key.index(Ellipsis)
        key = key[:e] + (slice(None),) * (len(v.groups) - len(key) + 1) + key[e + 1 :]
    if len(key) > len(v.groups) or not all(isinstance(k, slice) for k in key):
        return None
    shape = v.shape
    cut = [
        (a, k.indices(shape[a]))
        for a, k in enumerate(key)
        if k.indices(shape[a]) != (0, shape[a], 1)
    ]
    if len(cut) != 1 or cut[0][1][2] != 1:
        return None
    a, (start, stop, _) = cut[0]
    return Pending(v, a, start, stop) if stop > start else None


def equal_slices(nodes: Sequence[Any]) -> tuple[View, int] | None:
    """Where ``nodes`` are consecutive equal slices of one axis of one view, in order
    (HF's rotary halves of a head's dims, say): that view, sliced to their span, and
    the axis; else None. A join of them is a split of that axis."""
    if len(nodes) < 2:
        return None
    if all(isinstance(n, Pending) for n in nodes):
        return _halves(nodes)
    if not all(isinstance(n, View) for n in nodes):
        return None
    first = nodes[0]
    if any(v.name != first.name for v in nodes):
        return None
    differ = [a for a in range(len(first.stored)) if len({str(v.index[a]) for v in nodes}) > 1]
    if len(differ) != 1:
        return None
    a = differ[0]

    def same(v: View) -> bool:
        return (v.scale, v.offset) == (first.scale, first.offset)

    bounds = [v.index[a].indices(v.stored[a]) for v in nodes]
    size = bounds[0][1] - bounds[0][0]
    # the same view but for the one slice: the same axes, split, ordered and merged alike
    ok = all(
        same(v) and (v.groups, v.origin, v.base) == (first.groups, first.origin, first.base)
        for v in nodes
    )
    ok = ok and all(
        b[2] == 1 and b[1] - b[0] == size and b[0] == bounds[0][0] + k * size
        for k, b in enumerate(bounds)
    )
    axis = [i for i, g in enumerate(first.groups) if len(g) == 1 and first.origin[g[0]] == a]
    if not ok or len(axis) != 1:
        return None
    whole = dataclasses.replace(first, index=list(first.index), base=list(first.base))
    whole.index[a] = slice(bounds[0][0], bounds[0][0] + size * len(nodes), 1)
    whole.base[first.groups[axis[0]][0]] = size * len(nodes)
    return whole, axis[0]


def _halves(nodes: Sequence[Pending]) -> tuple[View, int] | None:
    """Where ``nodes`` are all the equal slices of one split axis of a view, in order:
    the view and the axis."""
    first = nodes[0]
    size = first.stop - first.start
    ok = size * len(nodes) == first.view.shape[first.axis] and all(
        (n.view, n.axis, n.start, n.stop) == (first.view, first.axis, k * size, (k + 1) * size)
        for k, n in enumerate(nodes)
    )
    return (first.view, first.axis) if ok else None
