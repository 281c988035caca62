"""A dequantized parameter's large block read and placed in slices.

A block of more than :data:`SLICE_BYTES` of stored bytes is read and placed in equal
slices along one axis (:func:`cut`, :func:`pieces`), each let go of on the host before
the next is read, so the host never holds a stacked parameter's whole block (on one
TPU, DeepSeek-V3's 470 MiB stack of experts was one block, its file's pages mapped
beside it). The program takes the slices as arguments: :mod:`.decode`'s dequantizes
each with its part of the block's scales (:func:`part`) and joins the values;
:mod:`.joins`' joins the stored bytes first (:func:`joined`). Both give each element
the same float32 product as the block whole.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

SLICE_BYTES = 64 << 20
"""A block of more stored bytes is read and placed in equal slices of at most this many
(where its shape divides so, in at most :data:`MOST_SLICES`), which its program joins
on the device: the host never holds a stacked parameter's whole block (a 470 MiB
stack of experts), only the slice being read and the one placed before it (jax lets
go of a placed array's host memory at its next transfer)."""

MOST_SLICES = 64
"""The most slices a block is placed in: each is an argument of its program."""


def cut(sizes: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """How a block of ``sizes`` is sliced: (axis, how many), equal slices of at most
    :data:`SLICE_BYTES` along the first axis that divides so, else the smallest slices
    one axis gives; None where it fits whole or no axis divides."""
    total = math.prod(sizes) * itemsize
    if total <= SLICE_BYTES:
        return None
    best: tuple[int, int] | None = None
    for axis, size in enumerate(sizes):
        for n in range(2, min(size, MOST_SLICES) + 1):
            if size % n:
                continue
            if total // n <= SLICE_BYTES:
                return axis, n
            if best is None or n > best[1]:
                best = (axis, n)
    return best


def pieces(index: tuple[slice, ...], at: tuple[int, int]) -> list[tuple[slice, ...]]:
    """The slices of the block at ``index`` along ``at`` (axis, how many), in order."""
    axis, n = at
    start, stop = index[axis].start, index[axis].stop
    step = (stop - start) // n
    return [
        (*index[:axis], slice(start + k * step, start + (k + 1) * step), *index[axis + 1 :])
        for k in range(n)
    ]


def joined(slices: Any, at: tuple[int, int] | None) -> Any:
    """A device's block in a program, from the arguments its slices came as."""
    return slices[0] if at is None else jnp.concatenate(slices, axis=at[0])


def part(values: Any, k: int, at: tuple[int, int] | None) -> Any:
    """Slice ``k``'s part of ``values`` over a block placed in ``at``'s slices (all of
    it along an axis it broadcasts over)."""
    if at is None or values.shape[at[0]] == 1:
        return values
    axis, count = at
    step = values.shape[axis] // count
    return jax.lax.slice_in_dim(values, k * step, (k + 1) * step, axis=axis)


def specs(spec: Any, at: tuple[int, int] | None) -> tuple[Any, ...]:
    """The ``in_specs`` of a block's arguments: one per slice, each as the block's."""
    return (spec,) * (1 if at is None else at[1])
