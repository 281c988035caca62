"""A block's values on the host, as the loader changes them: cast to the planned dtype
(or the dtype MaxText's hooks compute in), scaled and offset as MaxText's conversion
hooks compute them; a value that a step would change beyond rounding is a PlanError
naming the path, the part and the value."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

from ..._errors import PlanError, Problem
from . import blocks as _blocks


def cast(block: np.ndarray, dtype: np.dtype, path: str, leaf: _blocks.Leaf) -> np.ndarray:
    """``block`` cast to ``dtype``; a value the cast would change beyond rounding (an
    int out of range, a finite float that overflows) is a PlanError naming the path
    and the part."""
    why = None
    if jax.dtypes.issubdtype(dtype, np.integer) and block.size:
        info = ml_dtypes.iinfo(dtype)
        low, high = block.min(), block.max()
        if low < info.min or high > info.max:
            why = f"holds values from {low} to {high}, outside {dtype.name}'s range"
    with np.errstate(over="ignore", invalid="ignore"):
        out = block.astype(dtype)
    if why is None and jax.dtypes.issubdtype(dtype, np.inexact) and not np.isfinite(out).all():
        grew = np.isfinite(block) & ~np.isfinite(out)
        if grew.any():
            why = f"holds {block[grew].flat[0]}, which overflows {dtype.name}"
    if why is not None:
        raise PlanError(
            [Problem(path, f"{leaf.label}tensor {leaf.stored.name!r} {why}; plan a wider dtype")],
            header="meshinit.safetensors.load: a value does not fit the planned dtype:",
        )
    return out


def scaled(block: np.ndarray, scale: float, path: str, leaf: _blocks.Leaf) -> np.ndarray:
    """``block``, already in the planned dtype, times ``scale`` as MaxText 0.2.5's
    conversion hooks compute it on a tensor in its save dtype:
    ``(x.astype(np.float32) * np.float32(scale)).astype(x.dtype)``. A float64 block is
    multiplied in float64 (as numpy promotes ``x * np.float32(scale)``, the other
    spelling of MaxText's hooks), not cut to float32. A finite value that the product
    or its rounding back makes infinite (NaN in a float8 without infinities) is a
    PlanError naming the path, the part and the value."""
    return _arithmetic(block, scale, np.multiply, path, leaf)


def offset(block: np.ndarray, value: float, path: str, leaf: _blocks.Leaf) -> np.ndarray:
    """``block``, already in the planned dtype (and scaled), plus ``value``, computed
    as :func:`scaled` computes its product: ``(x.astype(np.float32) +
    np.float32(value)).astype(x.dtype)``, which is what ml_dtypes gives for ``x + 1.0``
    on a bfloat16 array (MaxText's Gemma norm scales); a float64 block in float64. A
    finite value that the sum or its rounding makes infinite is a PlanError naming the
    path, the part and the value."""
    return _arithmetic(block, value, np.add, path, leaf)


def _arithmetic(
    block: np.ndarray, x: float, op: np.ufunc, path: str, leaf: _blocks.Leaf
) -> np.ndarray:
    work = np.result_type(block.dtype, np.float32)
    if op is np.multiply:
        what, result, by, made = "scale", "product", "times", "a scaled value"
    else:
        what, result, by, made = "offset", "sum", "plus", "an offset value"
    with np.errstate(over="ignore", invalid="ignore"):
        factor = work.type(x)
        wide = op(block.astype(work), factor)
        out = wide.astype(block.dtype)
    grew = np.isfinite(block) & ~np.isfinite(out)
    if not grew.any():
        return out
    value, got = float(block[grew].flat[0]), float(wide[grew].flat[0])
    if not np.isfinite(factor):
        verb = "scaled" if what == "scale" else "offset"
        why = f"is {verb} by {x}, which overflows {work.name} (the {result}'s dtype)"
    elif not np.isfinite(got):
        why = f"holds {value}, which {by} {what}={x} overflows {work.name}"
    else:
        why = f"holds {value}, which {by} {what}={x} is {got}: it overflows {out.dtype.name}"
    raise PlanError(
        [Problem(path, f"{leaf.label}tensor {leaf.stored.name!r} {why}; plan a wider dtype")],
        header=f"meshinit.safetensors.load: {made} does not fit the planned dtype:",
    )
