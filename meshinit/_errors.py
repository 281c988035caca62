"""Errors raised by meshinit: every problem names its parameter path and the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with one parameter (or with the tree, when ``path`` is empty)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class PlanError(ValueError):
    """Raised once for all problems found while planning or materializing.

    Attributes:
      problems: one :class:`Problem` per problem, each naming its path. ``str(p)``
        reads ``"layers.3.mlp.up: logical axis 'mlpp' has no rule; ..."``.
    """

    def __init__(self, problems: Iterable[Problem], header: str | None = None):
        self.problems = list(problems)
        n = len(self.problems)
        header = header or f"{n} problem{'s' if n != 1 else ''} found while planning:"
        super().__init__("\n".join([header, *(f"  {p}" for p in self.problems)]))
