"""Pattern tables (``meshes=``, ``placements=``, the loader's ``names=``): each regex
compiled or reported as a problem, named alike in messages, and entries that match no
path reported as idle, in a warning that points at the caller's own line.

A table is matched by ``re.fullmatch`` on dot-joined paths, unless it is wrapped in
:func:`searched`: then by ``re.search`` on the paths joined with its separator, as
EasyDeL's partition rules are matched.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from ._errors import Problem, UnusedPatternWarning, printable


def compile_regex(where: str, regex: Any) -> re.Pattern[str] | Problem:
    """A pattern table's regex (``meshes[2]``, ``names[0]``, ...) compiled, or the
    problem that says why it cannot be."""
    if isinstance(regex, re.Pattern):
        regex, compiled = regex.pattern, regex
    else:
        compiled = None
    if isinstance(regex, bytes | bytearray):
        # paths are str: a bytes pattern would fail on the first path it meets
        given = f"re.compile({bytes(regex)!r})" if compiled is not None else repr(bytes(regex))
        text = printable(regex.decode("utf-8", "backslashreplace"))
        fix = f"r'{text}'" if "'" not in text and not text.endswith("\\") else repr(text)
        return Problem("", f"{where}: the regex is bytes {given}; give a str: {fix}")
    if compiled is not None:
        return compiled
    if not isinstance(regex, str):
        kind = type(regex).__name__
        return Problem("", f"{where}: the regex must be a str or re.Pattern, got {kind} {regex!r}")
    try:
        return re.compile(regex)
    except re.error as e:
        return Problem("", f"{where}: regex {regex!r} does not compile: {e}")


@dataclasses.dataclass(frozen=True)
class Searched:
    """A table matched as EasyDeL matches its partition rules: :func:`searched`."""

    rules: tuple[Any, ...]
    sep: str

    def path(self, path: str) -> str:
        """``path`` (dot-joined) as this table's regexes see it."""
        return path.replace(".", self.sep)


def searched(rules: Sequence[Any], sep: str = "/") -> Searched:
    r"""Marks a ``placements=`` table as matched by ``re.search`` on ``sep``-joined
    paths, the first match winning: EasyDeL's partition rules, taken unchanged.

    meshinit matches a table's regexes with ``re.fullmatch`` on dot-joined paths
    (``model.layers.0.mlp.gate_proj.kernel``). EasyDeL (and EasyLM before it) matches
    ``(regex, PartitionSpec)`` rules with ``re.search`` on ``/``-joined paths
    (``model/layers/0/mlp/gate_proj/kernel``), so its ``(".*/mlp/gate_proj/kernel",
    ...)`` finds every layer. ``placements=meshinit.searched(rules)`` matches each of
    ``rules`` that way: each path's dots become ``sep``, and the first rule that
    ``re.search`` finds in it places the variable. Everything else is as for a
    table: the entries are ``(regex, axes)``, ``(regex, axes, mesh)`` or ``(regex,
    axes, mesh, memory_kind)``, a ``PartitionSpec`` names mesh axes, every placement
    is checked (rank, divisibility, mesh axes) and an entry that matches nothing is
    warned about. EasyDeL's own matcher trims a spec longer than the rank and
    replicates scalars and small arrays without a word; meshinit refuses a spec that
    does not fit, naming the path.

    ``placements=`` of :func:`meshinit.nnx.init`, :func:`meshinit.linen.init` and
    :func:`meshinit.eqx.init` (and their ``plan``, ``abstract``) take it.

    Args:
      rules: the table, as a list or tuple of entries.
      sep: the separator the regexes expect between path parts.

    Returns:
      The table, marked; pass it as ``placements=``.

    Raises:
      TypeError: ``rules`` is not a list or tuple, or ``sep`` is not a non-empty str.

    Examples:
      >>> rules = (  # EasyDeL's form: re.search on "/"-joined paths
      ...     (r"layers/\d+/kernel", P("fsdp", "tensor")),
      ...     (".*", P()),
      ... )
      >>> model = meshinit.nnx.init(factory, placements=meshinit.searched(rules), mesh=mesh)
      >>> model.layers[1].kernel.get_value().sharding.spec
      P('fsdp', 'tensor')
    """
    if isinstance(rules, Searched):
        raise TypeError("rules are already searched: pass them once to meshinit.searched")
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise TypeError(
            f"meshinit.searched takes an ordered sequence of (regex, axes, ...) rules, the "
            f"first match winning; got {type(rules).__name__}"
        )
    if not isinstance(sep, str) or not sep:
        raise TypeError(f"sep must be a non-empty str, got {sep!r}")
    return Searched(tuple(rules), sep)


def idle_patterns(
    patterns: Sequence[re.Pattern[str]], paths: Iterable[str], searched: Searched | None = None
) -> list[int]:
    """The indices of ``patterns`` that match none of ``paths``: full-match none, or
    for a :class:`Searched` table, are found in none as it spells them."""
    tests = [p.fullmatch if searched is None else p.search for p in patterns]
    idle = dict.fromkeys(range(len(patterns)))
    for path in paths if searched is None else map(searched.path, paths):
        for i in [i for i in idle if tests[i](path)]:
            del idle[i]
        if not idle:
            break
    return list(idle)


def pattern_name(kind: str, index: int, pattern: re.Pattern[str]) -> str:
    r"""How messages name a pattern: ``meshes[1] r"layers\.9\..*"``."""
    return f'{kind}[{index}] r"{printable(pattern.pattern)}"'


def idle_message(
    names: Sequence[str], paths: Sequence[str], noun: str, searched: Searched | None = None
) -> str:
    """The one line that says which patterns matched nothing, with the full-match hint
    (or, for a :class:`Searched` table, how its paths are spelled)."""
    if searched is not None:
        shown = [searched.path(p) for p in paths[:3]]
        how = f"Each regex is searched (re.search) in the {searched.sep!r}-joined path"
    else:
        shown = list(paths[:3])
        how = (
            "Each regex must match a whole path (re.fullmatch): r'.*weight' matches every "
            "path ending in weight"
        )
    example = f"; the paths are like {', '.join(repr(printable(p)) for p in shown)}"
    return f"{' and '.join(names)} matched no {noun}. {how}{example if paths else ''}"


SLASH_HINT = (
    "meshinit joins a path with dots (layers.0.mlp.kernel) and matches it with "
    "re.fullmatch; a table of '/'-joined rules matched with re.search (EasyDeL's) goes in "
    "unchanged as placements=meshinit.searched(rules)"
)
"""Said with an idle ``placements=`` entry whose regex holds a ``/``."""


def warn_idle(
    what: str,
    names: Sequence[str],
    paths: Sequence[str],
    noun: str,
    effect: str = "It places nothing (every leaf is placed without it)",
    searched: Searched | None = None,
    hint: str = "",
) -> None:
    """Warns (:class:`~meshinit.UnusedPatternWarning`) that the patterns ``names``
    matched no path, pointing at the caller's line outside meshinit; ``effect`` says
    what an idle pattern does not do, ``hint`` (if any) what may be wrong."""
    if not names:
        return
    message = (
        f"{what}: {idle_message(names, paths, noun, searched)}. {effect}: fix the regex, or "
        f"drop the pattern{f'. {hint}' if hint else ''}"
    )
    warnings.warn(message, UnusedPatternWarning, stacklevel=outside_stacklevel())


def outside_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame outside the meshinit package, as seen
    from the function that calls :func:`warnings.warn`."""
    # meshinit/, the folder of this module
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame: types.FrameType | None
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
