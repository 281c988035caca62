"""What runs on the device for an MXFP4 block (:mod:`.pairing`), and the check of its
exponents on the host before it goes there.

The program unpacks each byte's two fp4 (e2m1) codes, the low nibble first, and
builds each value's float32 bits from its code and its group's e8m0 exponent
(:func:`bits`): a table value times a power of two, exact. It rounds them to the
planned dtype, cuts the block's span of K out of the groups read, and transposes to
transformers' ``[E, K, R]`` and the view's order. The exponents it cannot apply as
the reference does (:func:`checked`) are refused before it runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .... import _caches
from ...._errors import PlanError, Problem, printable

VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The fp4 (e2m1) value of each nibble: bit 3 the sign."""

HOST = "dequantize this checkpoint on the host first"


def _top(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)


def spanned(
    raw: np.ndarray, exps: np.ndarray, start: int, count: int, group: int
) -> tuple[np.ndarray, np.ndarray]:
    """Of a block's groups (``raw`` bytes ``[..., groups, B]``, ``exps``), the ones its
    ``count`` values from ``start`` (along K, within the groups) reach, the values
    outside that span zeroed: the exponents and values the block applies, and no
    others (every block takes as many groups as the most any needs; the first and
    last may reach past the view)."""
    first, last = start // group, -(-(start + count) // group)
    raw, exps = raw[..., first:last, :], exps[..., first:last]
    lead, tail = start - first * group, last * group - start - count
    if lead or tail:
        nibbles = np.zeros(raw.shape[-2] * group, bool)
        nibbles[lead : len(nibbles) - tail] = True  # K order: a byte's low nibble first
        keep = np.where(nibbles[0::2], 0x0F, 0) | np.where(nibbles[1::2], 0xF0, 0)
        raw = raw & keep.astype(np.uint8).reshape(raw.shape[-2:])
    return raw, exps


def checked(
    raw: np.ndarray, exps: np.ndarray, dtypes: tuple[np.dtype, np.dtype], path: str, reached: Any
) -> None:
    """Refuses the exponents the device would not apply as the reference does, for
    values rounded to each of ``dtypes`` in turn; ``raw`` and ``exps`` hold one row
    per leaf of ``reached`` (the stacked tensors), each named by its own scales. Only
    the exponents are read (a sixteenth of the bytes) unless one is 0, 1 or large:
    then the values of those groups say."""
    dtype = min(dtypes, key=_top)
    high = _overflowing(dtype)
    low, big = int(exps.min(initial=255)), int(exps.max(initial=0))
    if low > 1 and big < high:
        return
    problems = []
    for k, (leaf, _) in enumerate(reached):
        name = repr(printable(leaf.quant.scales.name))
        problems += [f"{name} {p}" for p in _problems(raw[k], exps[k], dtype)]
    if problems:
        raise PlanError(
            [Problem(path, p) for p in problems],
            header="meshinit.safetensors.load: MXFP4 exponents cannot be applied on the device:",
        )


def _problems(raw: np.ndarray, exps: np.ndarray, dtype: np.dtype) -> list[str]:
    """What is wrong with one tensor's exponents (``exps``) over its bytes (``raw``)."""
    top, high = _top(dtype), _overflowing(dtype)
    low, big = int(exps.min(initial=255)), int(exps.max(initial=0))
    problems = []
    if big == 255:
        problems.append(
            "holds the exponent byte 255, NaN in e8m0, which no weight is: the file is "
            "damaged; download or convert it again"
        )
    tiny = exps <= 1
    if low <= 1 and (codes := _codes(raw[tiny])).any():
        byte = int(exps[tiny][codes > 0].min())
        problems.append(
            f"holds the exponent byte {byte} under a non-zero value: a float32 subnormal, "
            f"which the device flushes to zero; {HOST}"
        )
    large = (exps >= high) & (exps != 255)
    if big >= high and large.any():
        values = np.abs(np.array(VALUES[:8]))[_codes(raw[large])]
        largest = values * np.exp2(exps[large] - 127.0)
        if (largest > top).any():
            if dtype == np.float16:
                fix = f"plan float32 or bfloat16, or {HOST}"
            elif top < _top(np.dtype(np.float32)):
                fix = f"plan float32, or {HOST}"
            else:
                fix = (
                    "no float is wider than float32 (transformers would load inf): an "
                    "exponent that large is no weight's; the file is damaged or "
                    "misconverted: download or convert it again"
                )
            problems.append(
                f"holds the exponent byte {int(exps[large][largest > top].min())} under "
                f"values that overflow {dtype.name} (up to {float(largest.max())!r}); {fix}"
            )
    return problems


def _overflowing(dtype: np.dtype) -> int:
    """The least exponent byte under which a value (up to 6) may overflow ``dtype``."""
    return next(s for s in range(256) if 6.0 * 2.0 ** (s - 127) > _top(dtype))


def _codes(groups: np.ndarray) -> np.ndarray:
    """Each group's (``[..., B]`` bytes) largest magnitude code: 0 where every value
    is +-0."""
    return np.maximum(groups & 0x07, (groups >> 4) & 0x07).max(axis=-1, initial=0)


@_caches.memo(256)
def program(signature: tuple[Any, ...], mesh: Any, spec: Any, names: tuple[str, ...]) -> Any:
    """The compiled dequantization of one signature over the mesh: every device's
    bytes, exponents and offset are arguments, so every layer of a shape shares it."""
    shape, nk, order, across, (outer, inner), work, planned = signature
    P = jax.sharding.PartitionSpec

    def dequantized(raw: Any, exps: Any, offset: Any) -> Any:
        raw, exps, offset = raw[0], exps[0], offset[0, 0]
        values = decoded(raw, exps, work, planned)
        values = jax.lax.dynamic_slice_in_dim(values, offset, nk, axis=3)
        return laid_out(values, order, across, outer, inner)

    mapped = jax.shard_map(
        dequantized, mesh=mesh, in_specs=(P(names), P(names), P(names)), out_specs=spec,
        check_vma=False,
    )  # fmt: skip
    return jax.jit(mapped)


def decoded(raw: Any, exps: Any, work: Any, planned: Any) -> Any:
    """The values of ``raw`` bytes ``[L, E, R, G, B]`` under ``exps`` ``[L, E, R, G]``,
    ``[L, E, R, G * 2B]``: rounded to ``work``, then to ``planned``."""
    leaves, e, r, g, b = raw.shape
    nibbles = jnp.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(leaves, e, r, g, 2 * b)
    values = jax.lax.bitcast_convert_type(bits(nibbles, exps[..., None]), jnp.float32)
    return values.astype(work).astype(planned).reshape(leaves, e, r, g * 2 * b)


def laid_out(values: Any, order: Any, across: Any, outer: Any, inner: Any) -> Any:
    """``values`` ``[L, E, R, K]`` (one row a leaf) as the parameter's block: K and R
    transposed (transformers' ``[E, K, R]``), the leaf's view, and the leaves along
    the ``across`` axes. Numpy's arrays and jax's alike (:mod:`.packed` lays out
    stored bytes with it)."""
    values = values.transpose(0, 1, 3, 2)  # X's axes: E, K, R
    values = values.transpose(0, *(1 + a for a in order))  # the leaf's view
    values = values.reshape(*outer, *inner)
    placed = list(across) + [k for k in range(len(outer) + len(inner)) if k not in across]
    return values.transpose([placed.index(k) for k in range(len(placed))])


def unlaid(block: Any, order: Any, across: Any, leaves: int) -> Any:
    """:func:`laid_out`'s inverse: a block in the parameter's axes as ``[L, E, R, K]``."""
    placed = list(across) + [k for k in range(block.ndim) if k not in across]
    values = block.transpose(placed)
    values = values.reshape(leaves, *values.shape[len(across) :])
    values = values.transpose(0, *(1 + order.index(a) for a in range(3)))  # E, K, R
    return values.transpose(0, 1, 3, 2)


def planned_as(got: jax.Array, shape: Any, sharding: Any) -> jax.Array:
    """``got`` on ``sharding`` itself (shard_map gives its spec without trailing Nones,
    and an Explicit mesh's twin): the same devices, indices and bytes, no copy."""
    if got.sharding == sharding:
        return got
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [s.data for s in got.addressable_shards]
    )


def bits(nibbles: Any, exps: Any) -> Any:
    """The float32 bits of ``FP4[nibble] * 2^(exponent - 127)``, exact (for exponent
    bytes 2 to 254 and no overflow: :func:`_checked`): an e2m1 code ``(e, m)`` is
    ``m / 2`` for ``e == 0``, else ``2^(e - 1) * (1 + m / 2)``."""
    code = nibbles.astype(jnp.int32)
    sign = (code >> 3) << 31
    e, m = (code >> 1) & 3, code & 1
    exps = exps.astype(jnp.int32)
    normal = ((exps + e - 1) << 23) | (m << 22)
    bits = jnp.where(e == 0, jnp.where(m == 0, 0, (exps - 1) << 23), normal)
    return bits | sign
