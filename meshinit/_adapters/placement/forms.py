"""What every form of ``placements=`` (a table of patterns, a tree of shardings, a rule)
offers the adapters: each path's :class:`~.parsed.Parsed` placement, and the problems
of what does not fit once every path is matched."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..._errors import Problem
from .parsed import Parsed


class Placements:
    """What every form of ``placements=`` offers the adapters. The adapters call
    :meth:`match` once per array path, then :meth:`finish` (or, for eqx, :meth:`refuse`
    and the idle entries) once with every path."""

    def __bool__(self) -> bool:
        return True

    def match(self, path: str, struct: Any = None) -> Parsed | None:
        """The placement of ``path`` (its ``jax.ShapeDtypeStruct`` is ``struct``), or None."""
        raise NotImplementedError

    def lacks(self, path: str) -> bool:
        """Whether ``path`` has no placement here though it must have one (a tree
        without its leaf, said once by :meth:`finish`): the adapter places nothing."""
        return False

    def refuse(self, others: Iterable[tuple[str, Any]], paths: Sequence[str] = ()) -> list[Problem]:
        """The problems of the variables ``others`` (path, value), which hold no array,
        where the placements meant to place them; ``paths`` are the array paths."""
        return []

    def finish(
        self, what: str, paths: Sequence[str], keeps: str, others: Iterable[tuple[str, Any]] = ()
    ) -> list[Problem]:
        """Once every array path (``paths``) is matched: the problems of what does not
        fit (the variables ``others`` hold no array), warning about what is only likely
        a mistake; ``keeps`` says what an unplaced variable keeps."""
        return self.refuse(others, paths)
