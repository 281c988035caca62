"""One stored tensor of an export from the regions its parameters write
(:func:`recipe`): its extent from the slices that reach it, each slice resolved as the
loader resolves it, every element written once; and the build that places each region
in its slice on the devices (:class:`Assemble`), compared by value so that every layer
of a scanned parameter shares one program."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._errors import Problem
from ..layout.parts import Tensor, length
from ..layout.recipe import Recipe

Op = tuple[Any, ...]
"""One step from a parameter to a stored region: ``("T", order)`` a transpose,
``("R", shape)`` a reshape, ``("take", axis)`` the next dynamic index along ``axis``,
``("slice", axis, start, size)`` a static slice."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One region of a stored tensor that one parameter writes."""

    tensor: Tensor
    path: str
    ops: tuple[Op, ...]
    at: tuple[int, ...]
    region: tuple[int, ...]  # the shape of the stored slice (after ``index``)
    origin: str


def recipe(
    name: str,
    writers: list[Leaf],
    planned: Mapping[str, tuple[tuple[int, ...], Any]],
    problems: list[Problem],
) -> Recipe | None:
    """The recipe of stored tensor ``name`` from the leaves that write it, or None with
    its problems added: a stored shape the slices do not determine, slices that do not
    tile it once each, parts of two dtypes."""
    ranks = {len(w.region) for w in writers}
    who = ", ".join(sorted({w.origin for w in writers}))
    if len(ranks) > 1:
        problems.append(Problem(name, f"is written with {sorted(ranks)} axes by {who}"))
        return None
    dtypes = {np.dtype(planned[w.path][1]) for w in writers}
    if len(dtypes) > 1:
        problems.append(
            Problem(
                name,
                f"is written from parameters of dtypes {sorted(map(str, dtypes))} "
                f"({who}): cast them to one (dtype=)",
            )
        )
        return None
    stored = _extent(writers)
    if isinstance(stored, str):
        problems.append(Problem(name, f"{stored} ({who})"))
        return None
    boxes = []
    for w in writers:
        try:
            box = w.tensor.sliced(stored)
        except ValueError as e:
            problems.append(Problem(name, f"{w.origin}'s index does not fit {stored}: {e}"))
            return None
        if tuple(length(s) for s in box) != w.region:
            problems.append(
                Problem(
                    name,
                    f"its shape is not known: {w.origin}'s index={w.tensor.index} "
                    f"of {stored} is not its {w.region}",
                )
            )
            return None
        boxes.append(tuple((s.start, s.stop, s.step or 1) for s in box))
    why = _tiling(stored, boxes, [w.origin for w in writers])
    if why:
        problems.append(Problem(name, why))
        return None
    paths = tuple(dict.fromkeys(w.path for w in writers))
    pieces = tuple(
        _Piece(paths.index(w.path), w.ops, len(w.at), box, _whole(box, stored))
        for w, box in zip(writers, boxes, strict=True)
    )
    (dtype,) = dtypes
    at = tuple(i for w in writers for i in w.at)
    build = Assemble(pieces, stored, dtype.name)
    return Recipe(name, stored, dtype, paths, at, build, who)


def _extent(writers: list[Leaf]) -> tuple[int, ...] | str:
    """Each axis as long as the writers' slices reach (a whole axis exactly its
    length); a message where some axis is not determined."""
    shape = []
    for a in range(len(writers[0].region)):
        reach = 0
        for w in writers:
            n = w.region[a]
            index = w.tensor.index or ()
            s = _axis_slice(index, a, len(w.region))
            if s is None or (s.start in (None, 0) and s.stop is None and (s.step or 1) == 1):
                reach = max(reach, n)
                continue
            start = 0 if s.start is None else s.start
            if start < 0 or (s.stop is not None and s.stop < 0):
                return (
                    f"axis {a}'s index {s} counts from the end of a size the export does not know"
                )
            step = s.step or 1
            reach = max(reach, start + (n - 1) * step + 1 if n else start)
        shape.append(reach)
    return tuple(shape)


def _axis_slice(index: tuple[Any, ...], axis: int, rank: int) -> slice | None:
    """The slice ``index`` takes of ``axis`` (None: the whole axis)."""
    if Ellipsis in index:
        at = index.index(Ellipsis)
        before, after = index[:at], index[at + 1 :]
        if axis < len(before):
            return before[axis]
        if axis >= rank - len(after):
            return after[axis - (rank - len(after))]
        return None
    return index[axis] if axis < len(index) else None


def _tiling(
    stored: tuple[int, ...], boxes: list[tuple[tuple[int, int, int], ...]], origins: list[str]
) -> str:
    """Why ``boxes`` do not cover ``stored`` exactly once, or ``""``."""
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if all(_meet(a, b) for a, b in zip(boxes[i], boxes[j], strict=True)):
                return f"is written twice, by {origins[i]} and {origins[j]}"
    total = sum(math.prod(len(range(*s)) for s in box) for box in boxes)
    if total != math.prod(stored):
        missing = math.prod(stored) - total
        return (
            f"is covered only in part: {', '.join(origins)} write {total} of its "
            f"{math.prod(stored)} elements (shape {stored}); {missing} are written by none"
        )
    return ""


def _meet(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    ra, rb = range(*a), range(*b)
    if not ra or not rb:
        return False
    if a[2] == 1 and b[2] == 1:
        return max(a[0], b[0]) < min(a[1], b[1])
    small, large = (ra, rb) if len(ra) <= len(rb) else (rb, ra)
    return any(x in large for x in small)


def _whole(box: tuple[tuple[int, int, int], ...], stored: tuple[int, ...]) -> bool:
    return all(s == (0, n, 1) for s, n in zip(box, stored, strict=True))


# --------------------------------------------------------------- on the devices


@dataclasses.dataclass(frozen=True)
class _Piece:
    source: int  # index into the recipe's paths
    ops: tuple[Op, ...]
    takes: int  # how many of the recipe's dynamic indices its ops take
    box: tuple[tuple[int, int, int], ...]
    whole: bool


@dataclasses.dataclass(frozen=True)
class Assemble:
    """A recipe's build from its pieces: each parameter's steps, then the pieces placed
    in their slices of the stored tensor. Compared by value, so that every layer of a
    scanned parameter (its index taken at run time) shares one program."""

    pieces: tuple[_Piece, ...]
    shape: tuple[int, ...]
    dtype: str

    def __call__(self, arrays: tuple[jax.Array, ...], at: tuple[Any, ...]) -> jax.Array:
        k = 0
        regions = []
        for piece in self.pieces:
            x = arrays[piece.source]
            for op in piece.ops:
                if op[0] == "T":
                    x = jnp.transpose(x, op[1])
                elif op[0] == "R":
                    x = jnp.reshape(x, op[1])
                elif op[0] == "take":
                    x = jax.lax.dynamic_index_in_dim(x, at[k], op[1], keepdims=False)
                    k += 1
                else:
                    x = jax.lax.slice_in_dim(x, op[2], op[2] + op[3], axis=op[1])
            regions.append(x)
        if len(self.pieces) == 1 and self.pieces[0].whole:
            return regions[0]
        out = jnp.zeros(self.shape, self.dtype)
        for piece, x in zip(self.pieces, regions, strict=True):
            out = out.at[tuple(slice(*s) for s in piece.box)].set(x)
        return out
