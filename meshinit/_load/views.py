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
        return tuple(math.prod(self.base[b] for b in g) for g in self.groups)

    def target(self) -> _names.Tensor:
        sliced = tuple(
            len(range(*s.indices(n))) for s, n in zip(self.index, self.stored, strict=True)
        )
        order = [b for g in self.groups for b in g]
        merged = any(len(g) != 1 for g in self.groups)
        whole = all(s == slice(0, n, 1) for s, n in zip(self.index, self.stored, strict=True))
        return _names.Tensor(
            self.name,
            index=None if whole else tuple(self.index),
            shape=None if tuple(self.base) == sliced else tuple(self.base),
            permute=None if order == sorted(order) else tuple(order),
            out_shape=self.shape if merged else None,
            scale=self.scale,
            **({} if self.offset is None else {"offset": self.offset}),
        )


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
    v = dataclasses.replace(v, base=list(v.base), origin=list(v.origin), index=list(v.index))
    seq = [b for g in v.groups for b in g if v.base[b] != 1]
    groups = split_axes(v, seq, new)
    held = {b for g in groups for b in g}
    keep = [b for b in range(len(v.base)) if b in held]  # the rest: size 1, dropped
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
