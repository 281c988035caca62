"""Placement tables: ``placements=`` of ``meshinit.eqx.init``, ``nnx.init`` and ``linen.init``.

A table is an ordered sequence of ``(regex, axes)``, ``(regex, axes, mesh)`` or
``(regex, axes, mesh, memory_kind)``: the sharding kept outside the model, as in
EasyDeL's partition rules, t5x's and Levanter's. Each regex is full-matched against a
variable's dot-joined path and the first match wins. ``axes`` is None (replicated), a
tuple with one entry per dimension (logical names where the call has rules, else mesh
axis names), or a ``jax.sharding.PartitionSpec``, whose names are mesh axes whatever
the rules (jax's meaning), padded with None to the variable's rank as jax pads it.

One parser for the three adapters: :func:`parse` checks every entry and collects what
is wrong, and :meth:`Table.match` finds a path's placement, once per path.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .. import _patterns
from .._errors import Problem, printable

Placement = tuple[Any, ...]
"""``(regex, axes)``, ``(regex, axes, mesh)`` or ``(regex, axes, mesh, memory_kind)``."""

_FORMS = "(regex, axes), (regex, axes, mesh) or (regex, axes, mesh, memory_kind)"


@dataclasses.dataclass(frozen=True)
class Parsed:
    """One well-formed entry of a table."""

    index: int
    pattern: re.Pattern[str]
    axes: tuple[Any, ...] | None  # as given (a PartitionSpec's entries), None: replicated
    mesh_axes: bool  # given as a PartitionSpec: mesh axes, never resolved through rules
    mesh: Mesh | AbstractMesh | None
    memory_kind: str | None
    broken: bool = False  # malformed, and said so: what it matches is placed by nothing

    @property
    def name(self) -> str:
        return f'placements[{self.index}] r"{printable(self.pattern.pattern)}"'

    def axes_for(self, ndim: int) -> tuple[Any, ...] | None:
        """The axes for a variable of ``ndim`` dimensions: a PartitionSpec shorter than
        that pads with None, as jax pads it; a tuple is as given (the planner says when
        its length is not the rank)."""
        if self.axes is None or not self.mesh_axes or len(self.axes) >= ndim:
            return self.axes
        return self.axes + (None,) * (ndim - len(self.axes))

    def rules_for(self, rules: Any) -> Any:
        """The rules this entry's axes resolve through: none for a PartitionSpec (its
        names are mesh axes) or replicated axes, else ``rules``."""
        return None if self.mesh_axes or self.axes is None else rules

    @staticmethod
    def shards(axes: tuple[Any, ...] | None) -> bool:
        """Whether ``axes`` shard any dimension (so a mesh is needed)."""
        return axes is not None and any(a is not None for a in axes)

    def no_mesh(self, path: str, call: str) -> Problem:
        """The problem of ``path``, which this entry shards, having no mesh."""
        return Problem(
            path,
            f"{self.name} shards it but there is no mesh: pass mesh= to {call}, call under "
            f"jax.set_mesh, or give the placement its own as (regex, axes, mesh)",
        )

    @property
    def spelled(self) -> int:
        """How many entries the framework spells the placed spec with: as many as given
        (``P()`` for None, as flax spells a Variable without sharding)."""
        return 0 if self.axes is None else len(self.axes)


class Table:
    """A parsed table: the first full match per path, and which entries matched none."""

    def __init__(self, entries: Sequence[Parsed]) -> None:
        self.entries = tuple(entries)
        self._used: set[int] = set()  # the indices of entries some path matched first

    def __bool__(self) -> bool:
        return bool(self.entries)

    def match(self, path: str) -> Parsed | None:
        """The first entry whose regex full-matches ``path``, or None."""
        for entry in self.entries:
            if entry.pattern.fullmatch(path):
                self._used.add(entry.index)
                return entry
        return None

    def warn_idle(self, what: str, paths: Sequence[str], keeps: str) -> None:
        """Warns (:class:`~meshinit.UnusedPatternWarning`) about the entries that match
        none of ``paths``; ``keeps`` says what an unplaced variable keeps."""
        effect = f"It places nothing (each variable keeps its own {keeps})"
        _patterns.warn_idle(what, self.idle(paths), paths, "variable path", effect)

    def idle(self, paths: Sequence[str]) -> list[str]:
        """The names of the entries that full-match none of ``paths``: an entry shadowed
        by an earlier one still counts as matching (it is not a typo)."""
        unused = [e for e in self.entries if e.index not in self._used]
        idle = _patterns.idle_patterns([e.pattern for e in unused], paths)
        return [unused[i].name for i in idle]


def parse(placements: Any) -> tuple[Table, list[Problem]]:
    """The table of ``placements`` (None: an empty one), and every malformed entry.

    Raises:
      TypeError: ``placements`` is not an ordered sequence.
    """
    if placements is None:
        return Table(()), []
    if isinstance(placements, str | bytes | Mapping) or not isinstance(placements, Sequence):
        raise TypeError(
            f"placements must be an ordered sequence of {_FORMS} tuples, first full match "
            f"wins; got {type(placements).__name__}"
        )
    parsed: list[Parsed] = []
    problems: list[Problem] = []
    for i, p in enumerate(placements):
        if not isinstance(p, tuple | list) or len(p) not in (2, 3, 4):
            problems.append(Problem("", f"placements[{i}] must be {_FORMS}; got {p!r}"))
            continue
        regex, axes, mesh, memory_kind = (*p, None, None, None)[:4]
        pattern = _patterns.compile_regex(f"placements[{i}]", regex)
        if isinstance(pattern, Problem):
            problems.append(pattern)  # it names placements[i]
            name = f"placements[{i}]"
        else:
            name = f'placements[{i}] r"{printable(pattern.pattern)}"'
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
        given, axes_problem = _axes(axes)
        if axes_problem:
            wrong.append(axes_problem)
        problems += [Problem("", f"{name}: {w}") for w in wrong]
        if isinstance(pattern, Problem):
            continue
        # A malformed entry still matches its paths, so that they are not also named as
        # unplaced: its problem is said once, for the entry.
        mesh_axes = isinstance(axes, PartitionSpec)
        parsed.append(Parsed(i, pattern, given, mesh_axes, mesh, memory_kind, bool(wrong)))
    return Table(parsed), problems


def _axes(axes: Any) -> tuple[tuple[Any, ...] | None, str | None]:
    """A placement's axes as a tuple of entries, or what is wrong with them."""
    if axes is None:
        return None, None
    if isinstance(axes, PartitionSpec):
        entries = tuple(axes)
        if any(e is PartitionSpec.UNCONSTRAINED for e in entries):
            return None, (
                "UNCONSTRAINED cannot be placed exactly; name mesh axes or None per dimension"
            )
    elif isinstance(axes, str) or not isinstance(axes, Sequence):
        return None, (
            f"axes must be None, a jax.sharding.PartitionSpec, or a tuple with one entry per "
            f"dimension (a name, a tuple of names, or None); got {axes!r}"
            + (f"; for one dimension write ({axes!r},)" if isinstance(axes, str) else "")
        )
    else:
        entries = tuple(axes)
    for e in entries:
        names = e if isinstance(e, tuple) else (e,)
        if e is not None and not all(isinstance(n, str) for n in names):
            return None, (
                f"each axes entry must be a name, a tuple of names or None; got {e!r} in {axes!r}"
            )
    return entries, None
