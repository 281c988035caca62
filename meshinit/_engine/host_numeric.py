"""numpy twins of XLA's integer arithmetic, shifts and conversions, bit for bit.

The host rules of :mod:`meshinit._engine.host_eval` evaluate equations with these. Each either
gives XLA's bits or raises :class:`NotHost`, where numpy and XLA differ or XLA itself
has no one answer (subnormals, NaN payloads); tests/_engine/test_host_eval.py compares every rule
with jax on hypothesis inputs and edge cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


class NotHost(Exception):
    """This equation is not evaluated on the host; compute it in the program."""


FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.dtype(a.dtype).kind not in "iu":
        raise NotHost(f"{a.dtype} division")  # floats, and int4/int2 (kind "V")
    if np.any(b == 0):
        raise NotHost("integer division by zero")
    # XLA rounds toward zero and numpy's // toward -inf; they agree on a - fmod(a, b),
    # a multiple of b. (np.abs(INT_MIN) is INT_MIN, so dividing magnitudes is wrong
    # there.) INT_MIN // -1 wraps to INT_MIN, as XLA's division does.
    return ((a - np.fmod(a, b)) // b).astype(a.dtype)


def int_rem(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.dtype(a.dtype).kind not in "iu" or np.any(b == 0):
        raise NotHost("rem")
    return np.fmod(a, b).astype(a.dtype)  # XLA's remainder takes the dividend's sign


def shift(kind: str) -> Callable[..., Any]:
    """XLA's shifts: an amount outside [0, bits) gives 0, or the sign for arithmetic."""

    def shifted(a: np.ndarray, s: np.ndarray) -> np.ndarray:
        if np.dtype(a.dtype).kind not in "iu":
            raise NotHost(f"shift of {a.dtype}")  # int4/int2: 4 or 2 bits in a byte
        a, s = np.broadcast_arrays(a, s)
        bits = a.dtype.itemsize * 8
        unsigned = np.dtype(f"u{a.dtype.itemsize}")
        amount = s.astype(unsigned)
        inside = amount < bits
        safe = np.where(inside, amount, 0).astype(unsigned)
        if kind == "left":
            out = (a.view(unsigned) << safe).view(a.dtype)
            return np.where(inside, out, 0).astype(a.dtype)
        if kind == "logical":
            out = (a.view(unsigned) >> safe).view(a.dtype)
            return np.where(inside, out, 0).astype(a.dtype)
        # XLA shifts the bits arithmetically whatever the type (uint8 0xFE >> 1 is
        # 0xFF), and numpy's >> is arithmetic on signed types: shift the signed view.
        signed = np.dtype(f"i{a.dtype.itemsize}")
        v = a.view(signed)
        out = v >> safe.astype(signed)
        sign = np.where(v < 0, -1, 0).astype(signed)
        return np.where(inside, out, sign).astype(signed).view(a.dtype)

    return shifted


def subnormal(x: np.ndarray) -> bool:
    """Whether float ``x`` holds a subnormal number, on which jax has no one answer:
    XLA's compiled CPU code treats them as zero (1e-45 > 0 is false there, and f32
    1e-45 converts to f64 0), while its constant folder and numpy do not."""
    if not jax.dtypes.issubdtype(x.dtype, np.floating):
        return False
    magnitude = np.abs(x)
    tiny = jax.dtypes.finfo(x.dtype).smallest_normal
    return bool(np.any((magnitude < tiny) & (magnitude != 0)))


def moved(xs: list[Any]) -> None:
    """Refuses to move NaNs of the narrow float types: XLA's CPU code moves some of
    them through f32, which makes their NaNs canonical, differently by version (jax
    0.10.2 concatenates bf16 0x7f81 as 0x7fc0; 0.12 slices float8_e5m2 0xfe as 0x7f)."""
    for x in xs:
        dtype = np.dtype(x.dtype)
        if dtype not in FLOATS and jax.dtypes.issubdtype(dtype, np.inexact):
            if np.any(np.isnan(x)):
                raise NotHost(f"a move of {dtype} NaNs")


def convert(x: np.ndarray, new_dtype: Any) -> np.ndarray:
    """XLA's convert_element_type of ``x``, where numpy gives its bits; else NotHost."""
    old, new = np.dtype(x.dtype), np.dtype(new_dtype)
    floating = jax.dtypes.issubdtype  # bf16 and float8 are numpy kind "V", not "f"
    if old == new:
        return x.copy()  # a weak type made strong: the same bits
    if floating(old, np.complexfloating) or floating(new, np.complexfloating):
        raise NotHost("complex conversion")
    if not floating(old, np.floating):
        narrow = floating(new, np.floating) and new not in FLOATS
        if narrow and np.any(np.abs(x.astype(np.float64)) > 2**24):
            # XLA converts an integer to bf16 through f32, rounding twice (int32
            # 2**24 + 2**16 + 1 is bf16 16777216 in XLA, 16908288 in ml_dtypes)
            raise NotHost("large integer to a narrow float")
        return x.astype(new)
    if not floating(new, np.floating):
        raise NotHost("float to integer conversion")  # numpy and XLA saturate differently
    if np.any(np.isnan(x)):
        # XLA quiets signalling NaNs and gives float8 types their one NaN (no sign, no
        # payload); numpy and ml_dtypes keep sign and payload bits
        raise NotHost("NaN conversion")
    if old == np.float64 and new not in FLOATS:
        raise NotHost("f64 to a narrow float")  # XLA rounds through f32, twice
    out = x.astype(new)
    if subnormal(x) or subnormal(out):
        raise NotHost("subnormal conversion")  # XLA's CPU code flushes them to zero
    return out
