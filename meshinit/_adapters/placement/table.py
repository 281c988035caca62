"""``placements=`` as a table of patterns: the sharding kept outside the model.

A table is an ordered sequence of ``(regex, axes)``, ``(regex, axes, mesh)`` or
``(regex, axes, mesh, memory_kind)``: the sharding kept outside the model, as in
EasyDeL's partition rules, t5x's and Levanter's. Each regex is full-matched against a
variable's dot-joined path and the first match wins; a table wrapped in
:func:`meshinit.searched` is matched by ``re.search`` on ``/``-joined paths instead, as
EasyDeL matches its rules. ``axes`` is None (replicated), a tuple with one entry per
dimension (logical names where the call has rules, else mesh axis names), or a
``jax.sharding.PartitionSpec``, whose names are mesh axes whatever the rules (jax's
meaning), padded with None to the variable's rank as jax pads it.

:func:`read_table` checks every entry and collects what is wrong; :class:`Table` gives
each path its first match, and says which entries matched nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from ... import _patterns
from ..._errors import Problem
from .forms import Placements
from .parsed import Parsed, axes_of, not_an_array

Placement = tuple[Any, ...]
"""``(regex, axes)``, ``(regex, axes, mesh)`` or ``(regex, axes, mesh, memory_kind)``."""

FORMS = "(regex, axes), (regex, axes, mesh) or (regex, axes, mesh, memory_kind)"

_NOT_ARRAY_FIX = "narrow the regex so that it leaves this path out"


class Table(Placements):
    """A parsed table: the first match per path, and which entries matched none."""

    def __init__(
        self,
        entries: Sequence[Parsed],
        patterns: Sequence[re.Pattern[str]] = (),
        searched: _patterns.Searched | None = None,
    ) -> None:
        self.entries = tuple(entries)
        self._pattern = {e.index: p for e, p in zip(entries, patterns, strict=True)}
        self.searched = searched  # re.search on sep-joined paths; None: re.fullmatch
        self._test = re.Pattern.fullmatch if searched is None else re.Pattern.search
        self._order = tuple(  # each entry with its bound matcher: one call per entry
            (e, p.fullmatch if searched is None else p.search)
            for e, p in zip(entries, patterns, strict=True)
        )
        self._used: set[int] = set()  # the indices of entries some path matched first
        self._held: set[int] = set()  # entries refused for a variable holding no array

    def __bool__(self) -> bool:
        return bool(self.entries)

    def how(self) -> str:
        """How this table's regexes are matched, for messages."""
        if self.searched is None:
            return "each regex must match the whole path"
        return f"each regex is searched in the {self.searched.sep!r}-joined path"

    def example(self, path: str) -> str:
        """A regex that matches ``path`` alone, as this table spells paths."""
        if self.searched is None:
            return re.escape(path)
        return re.escape(self.searched.path(path)).join("^$")

    def _key(self, path: str) -> str:
        """``path`` as this table's regexes see it."""
        return path if self.searched is None else self.searched.path(path)

    def _matches(self, pattern: re.Pattern[str], path: str) -> bool:
        return self._test(pattern, self._key(path)) is not None

    def _first(self, path: str) -> Parsed | None:
        key = self._key(path)
        for entry, match in self._order:
            if match(key) is not None:
                return entry
        return None

    def match(self, path: str, struct: Any = None) -> Parsed | None:
        """The first entry whose regex matches ``path``, or None."""
        entry = self._first(path)
        if entry is not None:
            self._used.add(entry.index)
        return entry

    def refuse(self, others: Iterable[tuple[str, Any]], paths: Sequence[str] = ()) -> list[Problem]:
        """A variable holding no array (an int, None) that an entry matches first is
        the entry's problem where the entry matches no array path (``paths``): it was
        written for that variable, which cannot be placed. An entry that also matches
        arrays (a catch-all ``.*``) leaves such a variable as it is."""
        problems = []
        for path, value in others:
            entry = self._first(path)
            if entry is None:
                continue
            self._held.add(entry.index)  # it matched a variable: no typo
            pattern = self._pattern[entry.index]
            if entry.broken or any(self._matches(pattern, p) for p in paths):
                continue
            problems.append(not_an_array(path, entry.name, value, _NOT_ARRAY_FIX))
        return problems

    def finish(
        self, what: str, paths: Sequence[str], keeps: str, others: Iterable[tuple[str, Any]] = ()
    ) -> list[Problem]:
        problems = self.refuse(others, paths)
        self.warn_idle(what, paths, keeps)
        return problems

    def warn_idle(self, what: str, paths: Sequence[str], keeps: str) -> None:
        """Warns (:class:`~meshinit.UnusedPatternWarning`) about the entries that match
        none of ``paths``; ``keeps`` says what an unplaced variable keeps."""
        effect = f"It places nothing (each variable keeps its own {keeps})"
        self.warn(what, self.idle(paths), paths, "variable path", effect)

    def warn(
        self,
        what: str,
        idle: Sequence[Parsed],
        paths: Sequence[str],
        noun: str,
        effect: str = "It places nothing (every leaf is placed without it)",
    ) -> None:
        """Warns about the ``idle`` entries, with the hint that fits them."""
        names = [e.name for e in idle]
        _patterns.warn_idle(what, names, paths, noun, effect, self.searched, self.hint(idle))

    def idle_message(self, entry: Parsed, paths: Sequence[str], noun: str) -> str:
        """The line that says ``entry`` matched none of ``paths``, with its hint."""
        text = _patterns.idle_message([entry.name], paths, noun, self.searched)
        hint = self.hint([entry])
        return f"{text}. {hint}" if hint else text

    def hint(self, idle: Sequence[Parsed]) -> str:
        """What may be wrong with ``idle`` entries: a ``/`` in a full-matched regex is
        a path spelled with slashes, as EasyDeL spells them."""
        slashed = any("/" in self._pattern[e.index].pattern for e in idle)
        slashed = slashed and self.searched is None
        return _patterns.SLASH_HINT if slashed else ""

    def idle(self, paths: Sequence[str]) -> list[Parsed]:
        """The entries that match none of ``paths``: an entry shadowed by an earlier one
        still counts as matching (it is not a typo), as does one matching a variable
        that holds no array (said by :meth:`refuse`)."""
        unused = [e for e in self.entries if e.index not in self._used | self._held]
        patterns = [self._pattern[e.index] for e in unused]
        idle = _patterns.idle_patterns(patterns, paths, self.searched)
        return [unused[i] for i in idle]


def read_table(
    placements: Sequence[Any], searched: _patterns.Searched | None
) -> tuple[Table, list[Problem]]:
    parsed: list[Parsed] = []
    patterns: list[re.Pattern[str]] = []
    problems: list[Problem] = []
    for i, p in enumerate(placements):
        if not isinstance(p, tuple | list) or len(p) not in (2, 3, 4):
            problems.append(Problem("", f"placements[{i}] must be {FORMS}; got {p!r}"))
            continue
        regex, axes, mesh, memory_kind = (*p, None, None, None)[:4]
        pattern = _patterns.compile_regex(f"placements[{i}]", regex)
        if isinstance(pattern, Problem):
            problems.append(pattern)  # it names placements[i]
            name = f"placements[{i}]"
        else:
            name = _patterns.pattern_name("placements", i, pattern)
        wrong = []
        if mesh is not None and not isinstance(mesh, Mesh | AbstractMesh):
            wrong.append(
                f"the mesh must be a jax.sharding.Mesh, AbstractMesh or None, got "
                f"{type(mesh).__name__}"
            )
        if memory_kind is not None and not isinstance(memory_kind, str):
            wrong.append(
                f"the memory kind must be a str ('device', 'pinned_host', ...) or None, got "
                f"{type(memory_kind).__name__} {memory_kind!r}"
            )
        given, axes_problem = axes_of(axes)
        if axes_problem:
            wrong.append(axes_problem)
        problems += [Problem("", f"{name}: {w}") for w in wrong]
        if isinstance(pattern, Problem):
            continue
        # A malformed entry still matches its paths, so that they are not also named as
        # unplaced: its problem is said once, for the entry.
        mesh_axes = isinstance(axes, PartitionSpec)
        parsed.append(Parsed(name, given, mesh_axes, mesh, memory_kind, bool(wrong), i))
        patterns.append(pattern)
    return Table(parsed, patterns, searched), problems
