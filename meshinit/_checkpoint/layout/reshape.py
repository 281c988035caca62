"""Reshapes as views: whether a slice of a stored tensor reshapes without a copy, which
axes a reshape merges, and which rectangle of the unmerged shape a block of the merged
one covers. Index arithmetic only, on shapes and strides: nothing here reads a byte.
"""

from __future__ import annotations

import math

import numpy as np


def merges(view: tuple[int, ...], out: tuple[int, ...]) -> tuple[int, ...] | None:
    """How many axes of ``view`` each axis of ``out`` merges (an axis of size 1 may
    merge none), or None where ``out`` is no such merge of ``view``."""
    if 0 in view or 0 in out:
        return tuple([1] * len(view)) if view == out else None
    groups, k = [], 0
    for n in out:
        size, start = 1, k
        while size < n and k < len(view):
            size, k = size * view[k], k + 1
        if size != n:
            return None
        groups.append(k - start)
    while k < len(view) and view[k] == 1:  # trailing axes of size 1 join the last group
        k += 1
        if groups:
            groups[-1] += 1
    return tuple(groups) if k == len(view) and groups else None


def unmerge(
    index: tuple[slice, ...], groups: tuple[int, ...], view: tuple[int, ...]
) -> tuple[slice, ...] | None:
    """The slices of the view that a block at ``index`` of the merged shape covers, or
    None where the block is no rectangle of the view (it cuts a merged axis within an
    inner row)."""
    out: list[slice] = []
    k = 0
    for s, g in zip(index, groups, strict=True):
        dims = view[k : k + g]
        k += g
        part = _split(s.start, s.stop, dims)
        if part is None:
            return None
        out += part
    return tuple(out)


def _split(a: int, b: int, dims: tuple[int, ...]) -> list[slice] | None:
    if not dims:
        return []
    if b <= a:
        return [slice(0, 0)] + [slice(0, d) for d in dims[1:]]
    if len(dims) == 1:
        return [slice(a, b)]
    inner = math.prod(dims[1:])
    if a % inner == 0 and b % inner == 0:
        return [slice(a // inner, b // inner)] + [slice(0, d) for d in dims[1:]]
    row = a // inner
    if row == (b - 1) // inner:
        rest = _split(a - row * inner, b - row * inner, dims[1:])
        return None if rest is None else [slice(row, row + 1), *rest]
    return None


def viewable(stored: tuple[int, ...], index: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``stored[index].reshape(shape)`` is a view: decided on strides alone, on a
    one-byte buffer that nothing ever reads (the reshape is asked never to copy)."""
    if 0 in stored:
        return True
    strides = tuple(int(math.prod(stored[k + 1 :])) for k in range(len(stored)))
    fake = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), stored, strides)[index]
    try:
        np.reshape(fake, shape, copy=False)
    except ValueError:
        return False
    except TypeError:  # numpy < 2.1 has no copy=; assigning the shape never copies
        view = fake.view()
        try:
            view.shape = shape
        except AttributeError:
            return False
    return True


def runs(given: tuple[int, ...], resolved: tuple[int, ...]) -> tuple[int, ...]:
    """The stored shape an export reads off a reshape to ``given`` (``resolved``: its
    ``-1`` resolved): each run of given sizes one stored axis, split; each ``-1`` one
    stored axis, kept whole (``(heads, head_dim, -1)`` of a ``(heads * head_dim, d)``
    weight)."""
    out: list[int] = []
    run: int | None = None
    for g, r in zip(given, resolved, strict=True):
        if g == -1:
            if run is not None:
                out.append(run)
                run = None
            out.append(r)
        else:
            run = r if run is None else run * r
    if run is not None:
        out.append(run)
    return tuple(out)
