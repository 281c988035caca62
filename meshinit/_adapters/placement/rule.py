"""``placements=`` given as a rule: a callable ``(path, shape_dtype) -> axes or None``
called once per array variable, with its dot-joined path and ``jax.ShapeDtypeStruct``
(kauldron's ``FSDPSharding`` is such a rule), read into the same per-path placements a
table gives (:class:`~.parsed.Parsed`), and checked alike."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax

from ..._errors import Problem
from .forms import Placements
from .parsed import Parsed, given


class Rule(Placements):
    """A callable ``(path, shape_dtype) -> axes or None``, asked once per array path."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule
        label = getattr(rule, "__qualname__", None) or type(rule).__name__
        label = label.rsplit("<locals>.", 1)[-1]  # a closure by its own name
        self.name = f"placements={label}"
        self._problems: list[Problem] = []

    def match(self, path: str, struct: Any = None) -> Parsed | None:
        """The placement the rule gives ``path``; None for a variable holding no array."""
        if not isinstance(struct, jax.ShapeDtypeStruct):
            return None
        try:
            answer = self.rule(path, struct)
        except Exception as e:
            e.add_note(f"raised by {self.name} for ({path!r}, {struct})")
            raise
        placed = given(self.name, answer, "return a NamedSharding")
        if isinstance(placed, str):
            self._problems.append(Problem(path, f"{self.name}: {placed}"))
            return Parsed(self.name, None, False, None, None, broken=True)
        return placed

    def finish(
        self, what: str, paths: Sequence[str], keeps: str, others: Iterable[tuple[str, Any]] = ()
    ) -> list[Problem]:
        return list(self._problems)
