"""The fields of ``names=``'s parts (:mod:`.parts`), checked as each part is made:
ints, shapes, a :class:`~.parts.Tensor`'s slices, a constant's value. Each gives the
field in the form the part keeps, or raises TypeError or ValueError naming the part's
kind, the field and what it got."""

from __future__ import annotations

import operator
import types
from typing import Any


def ints(value: Any, what: str, kind: str = "Tensor") -> tuple[int, ...] | None:
    """``value`` as a tuple of ints (axes, a reshape with its ``-1``), or None; a bool
    is no int here."""
    if value is None:
        return None
    try:
        out = tuple(operator.index(v) for v in value)
    except TypeError:
        raise TypeError(f"{kind} {what} must be a sequence of ints, got {value!r}") from None
    if any(isinstance(v, bool) for v in value):
        raise TypeError(f"{kind} {what} must be a sequence of ints, got {value!r}")
    return out


def sizes(value: Any, what: str, kind: str) -> tuple[int, ...] | None:
    """``value`` as a shape: a sequence of non-negative ints, or None."""
    out = ints(value, what, kind)
    if out is not None and any(d < 0 for d in out):
        raise ValueError(f"{kind} {what} {out}: sizes are non-negative")
    return out


Index = tuple["slice | types.EllipsisType", ...]
"""A :class:`~.parts.Tensor`'s ``index``: slices, and at most one Ellipsis."""


def slices(index: Any) -> Index | None:
    """``index`` (a slice or a tuple of them, as ``np.s_`` gives, with at most one
    Ellipsis) as a tuple; TypeError for anything else: an int, an array, a step that is
    not positive. A step of 1 is kept as None, as ``np.s_[a:b]`` spells it."""
    if index is None:
        return None
    parts = index if isinstance(index, tuple) else (index,)
    for s in parts:
        bounds = (s.start, s.stop, s.step) if isinstance(s, slice) else ()
        if not (s is Ellipsis or isinstance(s, slice)) or any(
            b is not None and (isinstance(b, bool) or not is_int(b)) for b in bounds
        ):
            raise TypeError(
                f"Tensor index must be basic slices with a positive step, one per leading "
                f"axis, and at most one Ellipsis (np.s_[:4096], np.s_[:, 512:1024], "
                f"np.s_[..., ::2]); got {index!r}"
            )
        if isinstance(s, slice) and s.step is not None and operator.index(s.step) < 1:
            raise TypeError(
                f"Tensor index {index!r}: a step must be positive (numpy's negative steps "
                f"reverse an axis, which no view of the file in its order reads)"
            )
    if sum(s is Ellipsis for s in parts) > 1:
        raise TypeError(f"Tensor index {index!r}: at most one Ellipsis")

    def bound(b: Any) -> int | None:
        return None if b is None else operator.index(b)

    def step(b: Any) -> int | None:
        return None if bound(b) in (None, 1) else bound(b)

    return tuple(
        s if s is Ellipsis else slice(bound(s.start), bound(s.stop), step(s.step)) for s in parts
    )


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int as an index is (``operator.index`` takes it)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def number(value: Any, kind: str) -> bool | int | float:
    """A fill value as a Python bool, int or float (a numpy scalar's ``.item()``);
    TypeError for anything else."""
    if isinstance(value, bool | int | float):
        return value
    item = getattr(value, "item", None)
    if getattr(value, "shape", None) == () and callable(item):
        got = item()
        if isinstance(got, bool | int | float):
            return got
    raise TypeError(f"{kind} value must be a Python float, int or bool, got {value!r}")
