"""Where the variables go that a placement replicates without naming a mesh, when the
call names none either: on the one mesh the placements name, else refused."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.sharding import AbstractMesh, Mesh

from ..._errors import Problem
from ..._format import describe_mesh, some
from .parsed import Parsed


class Replicas:
    """Where the variables go that a placement replicates (None, ``P()``) without
    naming a mesh, when the call names none either (no ``mesh=``, no context mesh, no
    mesh of the variable's own): on the one mesh the placements name (a rule's other
    answers, a tree's ``NamedSharding`` s, a table's meshes), as flax replicates a
    variable without sharding on the model's mesh. Where they name none, or several,
    which mesh is not clear: the variables are refused, one problem per placement,
    never left on one device beside a model on many.

    Args:
      placed: the placement of every path (None where none matched).
    """

    def __init__(self, placed: Iterable[Parsed | None]) -> None:
        meshes: dict[Any, None] = {}
        for p in placed:
            if p is not None and not p.broken and p.mesh is not None:
                meshes.setdefault(p.mesh, None)
        self.meshes = tuple(meshes)
        self.given: set[str] = set()  # the paths given the placements' mesh
        self._refused: dict[str, tuple[Parsed, list[str]]] = {}

    def mesh_for(self, path: str, placement: Parsed) -> Mesh | AbstractMesh | None:
        """The mesh of ``path``, which ``placement`` replicates and nothing gives a mesh;
        None where it is not clear (said by :meth:`problems`)."""
        if len(self.meshes) == 1:
            self.given.add(path)
            return self.meshes[0]
        self._refused.setdefault(placement.name, (placement, []))[1].append(path)
        return None

    def mesh_or_problem(
        self,
        where: Mesh | AbstractMesh | None,
        path: str,
        placement: Parsed,
        axes: tuple[Any, ...] | None,
        problems: list[Problem],
        call: str,
    ) -> Mesh | AbstractMesh | None:
        """``where``, the mesh something gave ``path``; else, where ``placement``
        replicates it, :meth:`mesh_for`; else None, with the problem of a sharding
        placement without a mesh added to ``problems`` (``call`` named in its fix)."""
        if where is not None:
            return where
        if placement.shards(axes):
            problems.append(placement.no_mesh(path, call))
            return None
        return self.mesh_for(path, placement)  # None: said once, by problems()

    def problems(self, call: str, context: str) -> list[Problem]:
        """The variables refused, one problem per placement: the paths, why, and the
        fixes (``mesh=`` of ``call``, the ``context`` mesh, the placement's own)."""
        if self.meshes:
            shown = "; ".join(describe_mesh(m) for m in self.meshes)
            why = f"the placements name {len(self.meshes)} meshes ({shown}), so which is unclear"
        else:
            why = "no placement names one"
        return [
            Problem(
                "",
                f"{name}: no mesh for the {len(paths)} variable(s) it replicates "
                f"({some(paths, 8)}), and {why}; pass mesh= to {call}, {context}, or "
                f"{placement.own_mesh}",
            )
            for name, (placement, paths) in self._refused.items()
        ]
