"""One placement of ``placements=``: the axes, mesh and memory kind that a table entry, a
leaf of a tree of shardings or a rule's answer gives a variable, checked alike.

:class:`Parsed` is what the adapters (nnx, linen, eqx) read, whatever form the
placements came in (:mod:`.forms` says what every form offers them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from ..._errors import Problem

AXES = (
    "None, a jax.sharding.PartitionSpec, or a tuple with one entry per "
    "dimension (a name, a tuple of names, or None)"
)

CONTEXT = "call under meshinit.defaults(mesh=...) or jax.set_mesh"
"""How messages name the context meshes of a placement that names no mesh."""


@dataclasses.dataclass(frozen=True)
class Parsed:
    """One well-formed placement: a table's entry, or what a tree or a rule gives one path."""

    name: str  # how messages name it: placements[2] r"...", the placements tree, ...
    axes: tuple[Any, ...] | None  # as given (a PartitionSpec's entries), None: replicated
    mesh_axes: bool  # given as a PartitionSpec: mesh axes, never resolved through rules
    mesh: Mesh | AbstractMesh | None
    memory_kind: str | None
    broken: bool = False  # malformed, and said so: what it matches is placed by nothing
    index: int = -1  # its index in a table; -1: it places one path (a tree's or a rule's)
    own_mesh: str = "give the placement its own as (regex, axes, mesh)"  # how to name one

    @property
    def per_path(self) -> bool:
        """Whether it places one path only (from a tree or a rule), not a table's paths."""
        return self.index < 0

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
            f"{self.name} shards it but there is no mesh: pass mesh= to {call}, {CONTEXT}, "
            f"or {self.own_mesh}",
        )

    @property
    def spelled(self) -> int:
        """How many entries the framework spells the placed spec with: as many as given
        (``P()`` for None, as flax spells a Variable without sharding)."""
        return 0 if self.axes is None else len(self.axes)


def not_an_array(path: str, name: str, value: Any, fix: str = "") -> Problem:
    """The problem of ``path``, placed by ``name``, holding ``value``, which is no array."""
    kind = "None" if value is None else type(value).__name__
    text = f"{name}: holds {kind}, not an array; meshinit cannot place it"
    return Problem(path, f"{text}; {fix}" if fix else text)


def axes_of(axes: Any) -> tuple[tuple[Any, ...] | None, str | None]:
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
            f"axes must be {AXES}; got {axes!r}"
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


def described(value: Any) -> str:
    """``value`` as messages show it: its repr, led by its type's name."""
    kind, shown = type(value).__name__, repr(value)
    return shown if shown.startswith(kind) else f"{kind} {shown}"


def given(name: str, value: Any, own_mesh: str) -> Parsed | str:
    """The placement of one path that a tree's leaf or a rule's answer ``value`` gives:
    a ``NamedSharding`` (its mesh, spec and memory kind), a ``PartitionSpec`` (mesh
    axes), a tuple of axes (as a table's) or None (replicated); else what is wrong."""
    mesh = memory_kind = None
    if isinstance(value, NamedSharding):
        mesh, memory_kind = value.mesh, value.memory_kind
        # jax spells "no memory kind given" as the default "device": leave it to the
        # defaults() memory kind, as a table entry without one does
        memory_kind = None if memory_kind == "device" else memory_kind
        value = value.spec
    elif not (value is None or isinstance(value, PartitionSpec | tuple | list | str)):
        return (
            f"got {described(value)}; give a jax.sharding.NamedSharding, a PartitionSpec, a "
            f"tuple of axes or None (replicated)"
        )
    axes, wrong = axes_of(value)
    if wrong:
        return wrong
    mesh_axes = isinstance(value, PartitionSpec)
    return Parsed(name, axes, mesh_axes, mesh, memory_kind, own_mesh=own_mesh)
