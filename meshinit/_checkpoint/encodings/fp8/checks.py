"""The block scales a block of float8 weights reads, checked before it is placed:
only those some element of the view reads (:func:`read_blocks`), so that no sharding
refuses what another loads (:func:`applied`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ...._errors import PlanError, Problem, printable
from ...layout import blocks as _blocks
from .geometry import geometry


def read_blocks(leaf: _blocks.Leaf, at: tuple[slice, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The scale rows and columns (block indices, ascending) that the elements of
    ``leaf``'s transposed view at ``at`` take their scales from: only those some
    element reads, not the span between (a view that steps over a block skips it)."""
    got = geometry(leaf)
    assert not isinstance(got, str)  # refused at plan time
    (r, c), moves = got
    rows, cols = np.array([r], np.int64), np.array([c], np.int64)
    for s, (dr, dc) in zip(at, moves, strict=True):
        n = max(0, s.stop - s.start)
        if not n:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        along = s.start + np.arange(n, dtype=np.int64)
        rows = np.add.outer(rows, along * dr).ravel() if dr else rows
        cols = np.add.outer(cols, along * dc).ravel() if dc else cols
    b0, b1 = leaf.quant.block
    return np.unique(rows // b0), np.unique(cols // b1)


DAMAGED = (
    "the file is damaged: download or convert it again (meshinit.safetensors.save "
    "refuses such values too)"
)


def applied(
    parts: Any, scale_of: Any, stored: Any, dtypes: tuple[np.dtype, np.dtype], path: str
) -> str:
    """Checks the block scales that a block reads (``parts``: each weight it reaches
    and the index of its view, ``scale_of(quant)`` the scale tensor's values), only
    those some element of the view reads, so that no sharding refuses what another
    loads. Refuses a scale that is NaN or infinite (every value of its block would be
    NaN or infinite: DeepSeek's ``weight_dequant`` loads IEEE's result, we refuse it
    as a damaged file), and one so small that a product would be a float32 subnormal
    (XLA flushes those to zero, the reference keeps them). Returns, where a stored
    value times a scale may overflow the narrower of ``dtypes`` (the compute and
    planned dtypes), the refusal the program gives should one do (naming the largest
    such scale read), else ""."""
    smallest = 2.0**-126 / float(ml_dtypes.finfo(stored).smallest_subnormal)
    narrow = min(dtypes, key=lambda t: float(ml_dtypes.finfo(t).max))
    limit = float(ml_dtypes.finfo(narrow).max) / float(ml_dtypes.finfo(stored).max)
    problems, top = [], None
    seen: dict[Any, tuple[np.ndarray, np.ndarray]] = {}  # a Stack's leaves: one geometry
    for leaf, at in parts:
        key = (
            leaf.stored.shape, leaf.shape, leaf.order, leaf.quant.block,
            tuple((s.start, s.stop, s.step) for s in (*leaf.index, *at)),
        )  # fmt: skip
        if key not in seen:
            seen[key] = read_blocks(leaf, at)
        rows, cols = seen[key]
        if not rows.size or not cols.size:
            continue
        scale = leaf.quant.scale
        values = np.abs(scale_of(leaf.quant)[np.ix_(rows, cols)].astype(np.float32))
        where = f"of tensor {printable(leaf.stored.name)!r}"
        held = f"in {printable(scale.name)!r} in {scale.file.name}"
        for bad, why in (
            (~np.isfinite(values), f": a scale that is not a finite "
             f"number makes every value of its block NaN or infinite, as DeepSeek's "
             f"weight_dequant would load them; {DAMAGED}"),
            ((values > 0) & (values < smallest), f", below {smallest!r}: products would be "
             f"float32 subnormals, which the device flushes to zero; dequantize this "
             f"checkpoint on the host first"),
        ):  # fmt: skip
            if bad.any():
                i, j = (int(k[0]) for k in np.nonzero(bad))
                value = np.float32(scale_of(leaf.quant)[rows[i], cols[j]])
                more = int(bad.sum()) - 1
                also = f" (and {more} more of the blocks read)" if more else ""
                said = f"block scale ({rows[i]}, {cols[j]}) {where} is {str(value)} {held}"
                problems.append(Problem(path, f"{said}{also}{why}"))
        finite = np.where(np.isfinite(values), values, 0)
        k = np.unravel_index(int(np.argmax(finite)), finite.shape)
        if finite[k] >= limit and (top is None or finite[k] > top[0]):
            top = (float(finite[k]), leaf, scale, (int(rows[k[0]]), int(cols[k[1]])))
    if problems:
        raise PlanError(
            problems, header="meshinit.safetensors.load: a block scale cannot be applied:"
        )
    if top is None:
        return ""
    _, leaf, scale, (r, c) = top
    value = np.float32(scale_of(leaf.quant)[r, c])
    if float(ml_dtypes.finfo(narrow).max) < float(ml_dtypes.finfo(np.float32).max):
        fix = "plan float32" + (" or bfloat16" if narrow == np.float16 else "")
    else:
        fix = (
            "no float is wider than float32: a scale that large is no weight's (a damaged "
            "or misconverted file: download or convert it again), or plan the parameter "
            "as float8 to load the stored values and its scale as a parameter of its own"
        )
    return (
        f"tensor {printable(leaf.stored.name)!r} times its block scales overflows "
        f"{narrow.name}: block scale ({r}, {c}) is {str(value)} in {printable(scale.name)!r}; "
        f"{fix}"
    )
