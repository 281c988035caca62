"""Stored tensors followed without data, as :class:`Sym` stand-ins, turned into
``names=`` targets: the one normal form of a framework's layout code.

A :class:`Sym` is a stored tensor's name, shape and dtype and what was done to it so
far, kept as a :class:`~.views.View` that :class:`~meshinit.safetensors.Tensor` reads:
a slice, a reshape that only splits axes, a permutation, a merge of side-by-side axes,
a scale and an offset. Joins (:func:`stack`, :func:`concatenate`) become
:class:`~meshinit.safetensors.Stack` and :class:`~meshinit.safetensors.Concat`, zeros
:class:`~meshinit.safetensors.Fill`, zeros with the tensor written at their origin
:class:`~meshinit.safetensors.Pad`. Two front-ends drive it: MaxText's numpy hooks run
as written (:mod:`.hooks`), and jax code traced equation by equation (:mod:`.traced`).
An operation that reads values (a comparison, ``bool()``, a conversion to an array)
or has no form here raises :class:`Inexpressible` naming it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..layout import parts as _names
from ..layout.reshape import merges as _merges
from ..layout.views import Inexpressible as Inexpressible
from ..layout.views import Pending as _Pending
from ..layout.views import View as _View
from ..layout.views import equal_slices as _equal_slices
from ..layout.views import pending as _pending
from ..layout.views import prod as _prod
from ..layout.views import reshaped as _reshaped
from ..layout.views import resolved as _resolved
from ..layout.views import sliced as _sliced


class Sym:
    """A stand-in for an array a hook computes, without its values."""

    __array_priority__ = 1000
    stacked: tuple[tuple[Any, ...], int] | None = None  # what stack() made it of, and where

    def __init__(self, node: Any, shape: tuple[int, ...], dtype: Any, wide: Any = None):
        # a _View, a _Pending slice, a finished target (Stack, Concat, Pad, Fill), or
        # the Inexpressible that made it (raised when it is used: see refused())
        self.node = node
        self.shape = tuple([int(d) for d in shape])
        self.dtype = np.dtype(dtype)
        self.wide = None if wide is None else np.dtype(wide)  # astype'd wider, to come back

    # ------------------------------------------------------------- what it says
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return _prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Sym({self.shape}, {self.dtype})"

    def __bool__(self) -> bool:
        raise Inexpressible("a branch on the tensor's values")

    def __array__(self, *_: Any, **__: Any) -> Any:
        raise Inexpressible("the tensor's values as an array (a value-dependent step)")

    def __iter__(self) -> Any:
        raise Inexpressible("iterating over the tensor")

    def _view(self, what: str) -> _View:
        _unrefused(self)
        if not isinstance(self.node, _View):
            raise Inexpressible(f"{what} after a join, a pad or a fill")
        if self.wide is not None:
            raise Inexpressible(f"{what} in {self.wide.name} before casting back")
        return self.node

    def _with(self, view: _View, shape: tuple[int, ...] | None = None) -> Sym:
        out = object.__new__(Sym)  # what a Sym holds, as it is: one per step of a model
        out.node, out.shape = view, view.shape if shape is None else shape
        out.dtype, out.wide = self.dtype, self.wide
        return out

    # ------------------------------------------------------------- layout
    def transpose(self, *axes: Any) -> Sym:
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], Sequence)):
            axes = tuple(axes[0]) if axes[0] is not None else ()
        n = self.ndim
        order = [operator.index(a) for a in axes] if axes else list(range(n))[::-1]
        order = [a % n if -n <= a < n else n for a in order]
        if sorted(order) != list(range(n)):
            raise Inexpressible(f"transpose{tuple(axes)} of a {n}-d tensor")
        if not isinstance(self.node, _View):
            return self._joined_permute(order)
        v = self._view("a transpose")
        shape = tuple([self.shape[a] for a in order])
        return self._with(v.regrouped([v.groups[a] for a in order]), shape)

    @property
    def T(self) -> Sym:  # noqa: N802 - numpy's name
        return self.transpose()

    def swapaxes(self, a: int, b: int) -> Sym:
        order = list(range(self.ndim))
        order[a], order[b] = order[b], order[a]
        return self.transpose(order)

    def reshape(self, *shape: Any) -> Sym:
        if len(shape) == 1 and not isinstance(shape[0], int | np.integer):
            shape = tuple(shape[0])
        new = _resolved(tuple(operator.index(d) for d in shape), self.size)
        if new == self.shape:
            return self
        if not isinstance(self.node, _View):
            return self._joined_reshape(new)
        return self._with(_reshaped(self._view("a reshape"), new), new)

    def squeeze(self, axis: Any = None) -> Sym:
        if axis is None:
            return self.reshape(tuple(d for d in self.shape if d != 1))
        drop = {a % self.ndim for a in (axis if isinstance(axis, tuple) else (axis,))}
        return self.reshape(tuple(d for i, d in enumerate(self.shape) if i not in drop))

    def flatten(self) -> Sym:
        return self.reshape(-1)

    def __getitem__(self, key: Any) -> Sym:
        view = self._view("a slice")
        try:
            return self._with(_sliced(view, key))
        except Inexpressible:
            pending = _pending(view, key)
            if pending is None:
                raise
        shape = list(self.shape)
        shape[pending.axis] = pending.stop - pending.start
        return Sym(pending, tuple(shape), self.dtype)

    # ------------------------------------------------------------- values
    def astype(self, dtype: Any, **_: Any) -> Sym:
        dtype = np.dtype(dtype)
        if dtype == (self.wide or self.dtype):
            return self
        if dtype == self.dtype:  # back to the planned dtype: rounded, as a scale rounds
            return Sym(self.node, self.shape, self.dtype)
        if self.wide is None and dtype == _work(self.dtype):
            return Sym(self.node, self.shape, self.dtype, dtype)  # widened, to come back
        raise Inexpressible(f"a cast to {dtype.name} of a {self.dtype.name} tensor")

    def _arith(self, other: Any, op: str) -> Sym:
        if isinstance(other, Sym) or np.ndim(other) != 0:
            raise Inexpressible(f"{op} by another tensor")
        try:
            float(other)
        except (TypeError, ValueError):
            raise Inexpressible(f"{op} by {other!r}") from None
        # numpy's promotion of the two: meshinit computes in the planned dtype's
        # float32 (or float64) work dtype, which rounds as the planned dtype's own
        # arithmetic does (ml_dtypes computes bfloat16 in float32)
        out = np.result_type(np.zeros((), self.wide or self.dtype), other)
        if out not in (self.dtype, _work(self.dtype)):
            raise Inexpressible(f"{op} in {out.name} of a {self.dtype.name} tensor")
        exact = float(np.asarray(other, dtype=out))
        if isinstance(self.node, _names.Pad):
            return self._padded_arith(exact, op, out)
        if not isinstance(self.node, _View):
            raise Inexpressible(f"{op} after a join, a pad or a fill")
        v = dataclasses.replace(self.node)
        if op == "a scale":
            if v.scale is not None or v.offset is not None:
                raise Inexpressible("a second scale, or a scale after an offset")
            v.scale = exact
        else:
            if v.offset is not None:
                raise Inexpressible("a second offset")
            v.offset = exact if op == "an offset" else -exact
        return Sym(v, self.shape, self.dtype, out if out != self.dtype else None)

    def _padded_arith(self, exact: float, op: str, out: np.dtype) -> Sym:
        """A scale or offset of a padded tensor (Gemma 2's embedding, padded, then
        scaled): the tensor's own, and the padding's value computed as the hook
        computes it."""
        pad = self.node
        part = pad.part
        if not isinstance(part, _names.Tensor) or part.offset is not None:
            raise Inexpressible(f"{op} after a pad of a join, or of an offset tensor")
        if op == "a scale":
            if part.scale is not None:
                raise Inexpressible("a second scale")
            part = dataclasses.replace(part, scale=exact)
            value = np.asarray(pad.value, dtype=out) * np.asarray(exact, dtype=out)
        else:
            exact = exact if op == "an offset" else -exact
            part = dataclasses.replace(part, offset=exact)
            value = np.asarray(pad.value, dtype=out) + np.asarray(exact, dtype=out)
        padded = dataclasses.replace(pad, part=part, value=value.item())
        return Sym(padded, self.shape, self.dtype, out if out != self.dtype else None)

    def _reduced(self, *_: Any, **__: Any) -> Any:
        raise Inexpressible("a reduction over the tensor's values")

    sum = mean = max = min = any = all = prod = std = _reduced

    def _compared(self, *_: Any) -> Any:
        raise Inexpressible("a comparison of the tensor's values")

    __lt__ = __le__ = __gt__ = __ge__ = _compared

    def __mul__(self, other: Any) -> Sym:
        return self._arith(other, "a scale")

    __rmul__ = __mul__

    def __add__(self, other: Any) -> Sym:
        return self._arith(other, "an offset")

    __radd__ = __add__

    def __sub__(self, other: Any) -> Sym:
        return self._arith(other, "a negative offset")

    def __truediv__(self, other: Any) -> Sym:
        raise Inexpressible("a division (it does not round as a scale by the inverse does)")

    # ------------------------------------------------------------- after joins
    def _joined_reshape(self, new: tuple[int, ...]) -> Sym:
        node = _unrefused(self)
        if not isinstance(node, _names.Stack | _names.Concat) or node.permute:
            raise Inexpressible("a reshape after a pad, a fill, or a transposed join")
        # a merge of a merge is one: out_shape goes on from the join's own shape
        if _merges(self.shape, new) is None:
            raise Inexpressible(f"a reshape of joined parts from {self.shape} to {new}, no merge")
        return Sym(dataclasses.replace(node, out_shape=new), new, self.dtype)

    def _joined_permute(self, order: list[int]) -> Sym:
        node = _unrefused(self)
        if not isinstance(node, _names.Stack | _names.Concat):
            raise Inexpressible("a transpose after a pad or a fill")
        before = node.permute or tuple(range(len(order)))  # a transpose of one: one
        node = dataclasses.replace(node, permute=tuple(before[a] for a in order))
        return Sym(node, tuple(self.shape[a] for a in order), self.dtype)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise Inexpressible("writing into the tensor")


def refused(why: str, shape: tuple[int, ...], dtype: Any) -> Sym:
    """A value no target expresses, carrying why: :class:`Inexpressible` is raised
    only where it is used (an operation on it, :func:`target`), so a value computed
    and never used refuses nothing."""
    return Sym(Inexpressible(why), shape, dtype)


def _unrefused(x: Sym) -> Any:
    """``x``'s node; :class:`Inexpressible` where ``x`` is :func:`refused`, or a slice
    that only a join of all its kin can use."""
    if isinstance(x.node, Inexpressible):
        raise Inexpressible(str(x.node))
    if isinstance(x.node, _Pending):
        raise Inexpressible("a slice of an axis that a reshape split or merged")
    return x.node


def _work(dtype: np.dtype) -> np.dtype:
    """The dtype meshinit scales and offsets a planned dtype in."""
    return np.result_type(dtype, np.float32)


# ----------------------------------------------------------------- joins and fills


def target(x: Any) -> _names.Target:
    """What ``x`` (a hook's result) reads, as a ``names=`` target."""
    if not isinstance(x, Sym):
        raise Inexpressible(f"a result that is not the stored tensor ({type(x).__name__})")
    node = _unrefused(x)
    return node.target() if isinstance(node, _View) else node


def picked(x: Any, i: int) -> _names.Target:
    """``target(x[..., i])``: part ``i`` of a hook's result stacked on its last axis
    (MaxText's composite keys: one hook makes several parameters, ``[..., i]`` each)."""
    if not isinstance(x, Sym):
        raise Inexpressible(f"a result that is not the stored tensor ({type(x).__name__})")
    if x.stacked is not None and x.stacked[1] == x.ndim - 1:  # its part, as it was
        return _part(x.stacked[0][i])
    return target(x[..., i])


def _part(x: Any) -> Any:
    """A join's part: a stand-in's target, or a constant array as a fill."""
    if isinstance(x, Sym):
        return target(x)
    if isinstance(x, _names.PARTS):
        return x
    arr = np.asarray(x)
    if arr.size and (arr == arr.flat[0]).all():
        return _names.Fill(arr.flat[0].item(), arr.shape)
    raise Inexpressible("a join with an array of values")


def _dtype_of(xs: Sequence[Any]) -> np.dtype:
    return np.result_type(*[x.dtype if isinstance(x, Sym) else np.asarray(x).dtype for x in xs])


def _shape_of(x: Any) -> tuple[int, ...]:
    return x.shape if isinstance(x, Sym) else np.shape(x)


def stack(xs: Sequence[Any], axis: int = 0, **_: Any) -> Sym:
    """``np.stack(xs, axis)``: a :class:`~.parts.Stack`, or, of all the equal slices of
    one axis of one view in order (:func:`.views.equal_slices`), a split of that axis."""
    xs = list(xs)
    shape = _shape_of(xs[0])
    n, k = len(shape) + 1, len(xs)
    axis = operator.index(axis) % n
    views = all(isinstance(x, Sym) and x.wide is None for x in xs)
    found = _equal_slices([x.node for x in xs]) if views else None
    if found is not None:
        view, a = found
        whole = Sym(view, view.shape, xs[0].dtype)
        split = whole.reshape((*view.shape[:a], k, view.shape[a] // k, *view.shape[a + 1 :]))
        order = [d for d in range(n) if d != a]
        order.insert(axis, a)
        made = split.transpose(order)
    else:
        out = (*shape[:axis], k, *shape[axis:])
        made = Sym(_names.Stack(tuple(_part(x) for x in xs), axis), out, _dtype_of(xs))
    made.stacked = (tuple(xs), axis)  # for picked(): a part as it was
    return made


def concatenate(xs: Sequence[Any], axis: int = 0, **_: Any) -> Sym:
    """``np.concatenate(xs, axis)``: a :class:`~.parts.Concat`, flattening parts that
    are concatenations along ``axis``. Where every part is a unit slice along ``axis``
    (as ``np.stack`` makes them) or a stack along it, a :func:`stack` of them (jax's
    ``jnp.stack`` of many operands concatenates at most 16 at a time)."""
    xs = list(xs)
    if len(xs) == 1 and isinstance(xs[0], Sym):
        return xs[0]
    shape = list(_shape_of(xs[0]))
    axis = operator.index(axis) % len(shape)
    shape[axis] = sum(_shape_of(x)[axis] for x in xs)
    try:
        items = [_stacked(x, axis) for x in xs]
    except Inexpressible:  # a unit part that is no view (a pad, a transposed join)
        items = [None]
    if None not in items:
        flat = [p for i in items for p in i or ()]
        if all(isinstance(p, Sym) for p in flat):
            return stack(flat, axis)
        stacked = _names.Stack(tuple(_part(p) for p in flat), axis)
        return Sym(stacked, tuple(shape), _dtype_of(xs))
    parts = [p for x in xs for p in _flat(_part(x), _names.Concat, axis)]
    return Sym(_names.Concat(tuple(parts), axis), tuple(shape), _dtype_of(xs))


def _stacked(x: Any, axis: int) -> list[Any] | None:
    """``x`` as parts stacked along ``axis`` (a stack's own parts, a unit slice less
    that axis), or None."""
    if isinstance(x, Sym) and _plain(x.node, _names.Stack, axis):
        return list(x.node.parts)
    shape = _shape_of(x)
    if shape[axis] != 1:
        return None
    squeezed = (*shape[:axis], *shape[axis + 1 :])
    return [x.reshape(squeezed) if isinstance(x, Sym) else np.asarray(x).reshape(squeezed)]


def _plain(t: Any, kind: type[_names.Stack | _names.Concat], axis: int) -> bool:
    """Whether ``t`` is a ``kind`` join along ``axis``, neither reshaped nor permuted."""
    return isinstance(t, kind) and t.axis == axis and t.out_shape is None and t.permute is None


def _flat(t: Any, kind: type[_names.Stack | _names.Concat], axis: int) -> tuple[Any, ...]:
    return t.parts if _plain(t, kind, axis) else (t,)


class _Filled(Sym):
    """zeros/ones/full: a fill, into which a hook may write the tensor at the origin
    (a pad)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        key = key if isinstance(key, tuple) else (key,)
        if not isinstance(value, Sym) or not isinstance(self.node, _names.Fill):
            raise Inexpressible("writing values into a fill")
        if len(key) > self.ndim or not all(isinstance(k, slice) for k in key):
            raise Inexpressible(f"writing into a fill at {key}")
        key = key + (slice(None),) * (self.ndim - len(key))
        span = [k.indices(n) for k, n in zip(key, self.shape, strict=True)]
        if any(s[0] != 0 or s[2] != 1 for s in span) or tuple(s[1] for s in span) != value.shape:
            raise Inexpressible(f"writing a {value.shape} tensor into a fill at {key}")
        self.node = _names.Pad(target(value), self.shape, value=self.node.value)


def filled(shape: Any, value: Any, dtype: Any) -> Sym:
    """``np.full(shape, value, dtype)``, into which a hook may write a tensor (a pad)."""
    shape = (shape,) if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)
    return _Filled(_names.Fill(value, shape), shape, np.dtype(dtype or np.float64))


def stand_in(name: str, shape: tuple[int, ...], dtype: Any) -> Sym:
    """A stored tensor as code's input: its name, shape and (planned) dtype."""
    n = len(shape)
    view = _View(
        name,
        tuple(shape),
        [slice(0, d, 1) for d in shape],
        list(shape),
        list(range(n)),
        [[a] for a in range(n)],
    )
    return Sym(view, tuple(shape), dtype)
