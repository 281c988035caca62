"""Pattern tables (``meshes=``, ``placements=``, the loader's ``names=``): each regex
compiled or reported as a problem, named alike in messages, and entries that match no
path reported as idle, in a warning that points at the caller's own line."""

from __future__ import annotations

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
        return regex
    if not isinstance(regex, str):
        kind = type(regex).__name__
        return Problem("", f"{where}: the regex must be a str or re.Pattern, got {kind} {regex!r}")
    try:
        return re.compile(regex)
    except re.error as e:
        return Problem("", f"{where}: regex {regex!r} does not compile: {e}")


def idle_patterns(patterns: Sequence[re.Pattern[str]], paths: Iterable[str]) -> list[int]:
    """The indices of ``patterns`` that full-match none of ``paths``."""
    idle = dict.fromkeys(range(len(patterns)))
    for path in paths:
        for i in [i for i in idle if patterns[i].fullmatch(path)]:
            del idle[i]
        if not idle:
            break
    return list(idle)


def pattern_name(kind: str, index: int, pattern: re.Pattern[str]) -> str:
    r"""How messages name a pattern: ``meshes[1] r"layers\.9\..*"``."""
    return f'{kind}[{index}] r"{printable(pattern.pattern)}"'


def idle_message(names: Sequence[str], paths: Sequence[str], noun: str) -> str:
    """The one line that says which patterns matched nothing, with the full-match hint."""
    example = f"; the paths are like {', '.join(repr(printable(p)) for p in paths[:3])}"
    return (
        f"{' and '.join(names)} matched no {noun}. Each regex must match a whole path "
        f"(re.fullmatch): r'.*weight' matches every path ending in weight"
        f"{example if paths else ''}"
    )


def warn_idle(
    what: str,
    names: Sequence[str],
    paths: Sequence[str],
    noun: str,
    effect: str = "It places nothing (every leaf is placed without it)",
) -> None:
    """Warns (:class:`~meshinit.UnusedPatternWarning`) that the patterns ``names``
    matched no path, pointing at the caller's line outside meshinit; ``effect`` says
    what an idle pattern does not do."""
    if not names:
        return
    message = (
        f"{what}: {idle_message(names, paths, noun)}. {effect}: fix the regex, or drop the pattern"
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
