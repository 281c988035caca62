"""The likely name behind a typo: every "did you mean" of the package ranks alike.

At the bottom of the package, with the formatter: it imports nothing of meshinit. A
suggestion is advice the user may follow without a second look, so a name is offered
only where it differs as a typo does, never where it names another thing that happens
to share most letters: ``layers.1.up`` is not a typo of ``layers.0.up``, nor ``up_proj``
of ``down_proj``, nor ``heads`` of ``kv_heads``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_PARTS = re.compile(r"[./]")  # a path's components: layers.0.up, params/Dense_0
_WORDS = re.compile(r"[_-]")  # a component's words: up_proj, kv-heads


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``name`` is most likely a typo of, or None.

    A candidate is a typo of ``name`` where each word (the parts between ``.``, ``/``,
    ``_`` and ``-``) that differs is at most a third as many edits away as it has
    letters (a letter added, dropped or changed, or two neighbours swapped, each one
    edit; case ignored): ``mpl`` for ``mlp``, ``vocb`` for ``vocab``, ``up_porj`` in a
    path; a word of one or two letters (``0``, ``q``, ``up``) must match. Or where the longer
    of the two is the other with whole components added in one place, the other
    having two or more (``layers.0.up`` and ``model.layers.0.up``). Of those, the
    fewest edits over the whole name wins; ties go to the earlier candidate. ``name``
    itself is never suggested.

    >>> closest("mpl", ["embed", "mlp", "vocab"]), closest("dp", ["tp", "fsdp"])
    ('mlp', None)
    >>> closest("layers.0.up", ["model.layers.0.up", "layers.1.up", "layers.0.down"])
    'model.layers.0.up'
    """
    folded = name.casefold()
    parts, components = _split(folded), _PARTS.split(folded)
    # Cheap tests first, as a checkpoint holds 10^5 names: with as many components, at
    # most a third of the letters more or less; else the first or last one in common.
    cuts, slack = len(components) - 1, len(folded) // 3
    best, fewest = None, 0
    for c in candidates:
        if c == name:
            continue
        other = c.casefold()
        if other.count(".") + other.count("/") == cuts:
            if abs(len(other) - len(folded)) > slack:
                continue
        elif not other.startswith(components[0]) and not other.endswith(components[-1]):
            continue
        if _typo(parts, _split(other)):
            most = fewest - 1 if best is not None else len(other) + len(folded)
            d = edits(folded, other, most)
            if best is None or d < fewest:
                best, fewest = c, d
    return best


def _split(folded: str) -> list[list[str]]:
    return [_WORDS.split(part) for part in _PARTS.split(folded)]


def _typo(a: list[list[str]], b: list[list[str]]) -> bool:
    """Whether two split names differ as a typo: word by word, or by whole components."""
    if len(a) == len(b):
        return all(
            x == y
            or len(x) == len(y)
            and all(edits(u, v, len(u) // 3) <= len(u) // 3 for u, v in zip(x, y, strict=True))
            for x, y in zip(a, b, strict=True)
        )
    short, long = (a, b) if len(a) < len(b) else (b, a)
    if len(short) < 2:  # heads and kv.heads name two things
        return False
    same = 0  # short is long less one run: the components before it, then after it
    while same < len(short) and short[same] == long[same]:
        same += 1
    return short[same:] == long[len(long) - len(short) + same :]


def edits(a: str, b: str, most: int) -> int:
    """Edits from ``a`` to ``b``, a swap of neighbours counting one (optimal string
    alignment); any count above ``most`` is returned as ``most + 1``, found early.

    >>> edits("mpl", "mlp", 3), edits("embed", "vocab", 2)
    (1, 3)
    """
    n = min(len(a), len(b))
    start = 0  # a shared prefix or suffix costs nothing, and paths share long ones
    while start < n and a[start] == b[start]:
        start += 1
    end = 0
    while end < n - start and a[-1 - end] == b[-1 - end]:
        end += 1
    a, b = a[start : len(a) - end], b[start : len(b) - end]
    over = most + 1
    if abs(len(a) - len(b)) > most:
        return over
    if not a or not b:
        return len(a) + len(b)
    # One row per letter of a, only the cells within ``most`` of the diagonal; a row
    # whose every cell, plus the length left to even up, is over ``most`` ends it.
    before, prev = [over] * (len(b) + 1), [min(j, over) for j in range(len(b) + 1)]
    for i, x in enumerate(a, 1):
        row = [i if i <= most else over] + [over] * len(b)
        level = i - len(a) + len(b)  # where the rest of both strings is equally long
        least = row[0] + abs(level)
        for j in range(max(1, i - most), min(len(b), i + most) + 1):
            y = b[j - 1]
            d = prev[j - 1] + (x != y)  # comparisons, not min(): this loop is the cost
            if prev[j] < d:
                d = prev[j] + 1
            if row[j - 1] < d:
                d = row[j - 1] + 1
            if x != y and i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                if before[j - 2] < d:
                    d = before[j - 2] + 1
            row[j] = d
            if d + abs(level - j) < least:
                least = d + abs(level - j)
        if least > most:
            return over
        before, prev = prev, row
    return min(prev[-1], over)
