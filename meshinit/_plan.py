"""The plan: every spec resolved to its exact NamedSharding, grouped by mesh.

Planning is pure and cheap: it allocates nothing and works on ``AbstractMesh``.
Every problem in the tree is gathered and raised once as a :class:`PlanError`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from . import _paths
from ._errors import PlanError, Problem
from ._rules import partition
from ._signature import check_init, fingerprint
from ._spec import ParamSpec


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One planned parameter.

    Attributes:
      path: the dot-joined path, for example ``"layers.0.attn.q"``.
      spec: the :class:`ParamSpec` declared there.
      sharding: the exact ``NamedSharding`` its array will have.
      signature: equal for entries that compile to the same work (initializer,
        shape, dtype and PartitionSpec); used to deduplicate compilation.
      leaf_index: the spec's position among the tree's leaves.
    """

    path: str
    spec: ParamSpec
    sharding: NamedSharding
    signature: Hashable = dataclasses.field(repr=False)
    leaf_index: int = dataclasses.field(repr=False)

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        return self.sharding.mesh

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The shape of the block each device holds."""
        return self.sharding.shard_shape(self.spec.shape)

    @property
    def device_bytes(self) -> int:
        """Bytes this parameter takes on each device of its mesh."""
        n = 1
        for d in self.shard_shape:
            n *= d
        return n * self.spec.dtype.itemsize

    @property
    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.spec.shape, self.spec.dtype, sharding=self.sharding)


@dataclasses.dataclass(frozen=True)
class MeshGroup:
    """All entries placed on one mesh; materialized by one compiled computation."""

    mesh: Mesh | AbstractMesh
    entries: tuple[PlanEntry, ...]

    @property
    def is_abstract(self) -> bool:
        return isinstance(self.mesh, AbstractMesh)

    @property
    def nbytes(self) -> int:
        """Total bytes of the group's parameters, unsharded."""
        return sum(e.spec.nbytes for e in self.entries)

    @property
    def device_bytes(self) -> int:
        """Bytes the group's parameters take on each device of the mesh."""
        return sum(e.device_bytes for e in self.entries)

    @functools.cached_property
    def batches(self) -> tuple[tuple[int, ...], ...]:
        """Positions in ``entries`` of the entries that share a signature.

        One batch compiles to one piece of work, whatever the number of entries in it.
        """
        by_signature: dict[Hashable, list[int]] = {}
        for i, e in enumerate(self.entries):
            by_signature.setdefault(e.signature, []).append(i)
        return tuple(tuple(positions) for positions in by_signature.values())

    @functools.cached_property
    def digests(self) -> np.ndarray:
        """uint32[n, 2]: each entry's path digest, in batch order."""
        return np.array(
            [_paths.path_digest(self.entries[i].path) for b in self.batches for i in b],
            dtype=np.uint32,
        ).reshape(len(self.entries), 2)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where every parameter of a tree goes. Build it with :func:`plan`.

    Attributes:
      entries: one :class:`PlanEntry` per spec, in tree-flatten order.
      groups: one :class:`MeshGroup` per mesh, in order of first appearance.
      treedef: the tree's structure.
      leaves: the tree's leaves; specs stand where arrays will go.
    """

    entries: tuple[PlanEntry, ...]
    groups: tuple[MeshGroup, ...]
    treedef: Any = dataclasses.field(repr=False)
    leaves: tuple[Any, ...] = dataclasses.field(repr=False)

    @property
    def nbytes(self) -> int:
        """Total parameter bytes, unsharded."""
        return sum(e.spec.nbytes for e in self.entries)

    def abstract(self) -> Any:
        """The tree with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` for each spec.

        Allocates nothing; a restore target for checkpoints.
        """
        return self.fill([e.abstract for e in self.entries])

    def fill(self, values: list[Any]) -> Any:
        """The tree with ``values[i]`` in place of ``entries[i]``'s spec."""
        leaves = list(self.leaves)
        for entry, value in zip(self.entries, values, strict=True):
            leaves[entry.leaf_index] = value
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def __str__(self) -> str:
        from ._report import table

        return table(self)


@functools.lru_cache(maxsize=4096)
def _partition(shape, axes, rules, mesh) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    # Memoized: a deep model repeats a handful of (shape, axes, rules, mesh) many times,
    # and reading ``mesh.shape`` builds a new dict on every call.
    entries, problems = partition(shape, axes, rules, mesh.shape)
    return entries, tuple(problems)


def _is_mesh(m: Any) -> bool:
    return isinstance(m, Mesh | AbstractMesh)


def plan(tree: Any) -> Plan:
    """Resolves every :class:`ParamSpec` in ``tree`` to an exact ``NamedSharding``.

    Args:
      tree: any pytree. ``ParamSpec`` leaves are planned; every other leaf passes
        through untouched.

    Returns:
      A :class:`Plan`. ``print(plan)`` shows the table.

    Raises:
      PlanError: with one problem per bad spec or path, all gathered first.

    Example:
      >>> p = meshinit.plan({"w": meshinit.param((8, 8), init, axes=("a", "b"), mesh=m)})
      >>> p.entries[0].sharding
      NamedSharding(mesh=Mesh('a': 2, 'b': 4), spec=P('a', 'b'))
    """
    return build_plan(tree)


def build_plan(tree: Any, *, check_inits: bool = True, problems: Sequence[Problem] = ()) -> Plan:
    """:func:`plan`, for adapters.

    Adapters whose values come from a constructor, not from the specs' initializers
    (``materialize_from``), skip the abstract init check, and pass the problems they
    found themselves, so that everything is raised once, together.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    problems = list(problems)
    seen_paths: dict[str, int] = {}
    seen_digests: dict[tuple[int, int], str] = {}
    shardings: dict[tuple[Any, ...], NamedSharding] = {}
    entries: list[PlanEntry] = []

    for index, (keypath, leaf) in enumerate(flat):
        if not isinstance(leaf, ParamSpec):
            continue
        path = _paths.path_str(keypath)
        seen_paths[path] = seen_paths.get(path, 0) + 1
        if seen_paths[path] == 2:
            problems.append(
                Problem(
                    path,
                    "two parameters have this path; rename one (paths "
                    "join keys with '.', so 'a.b' and a/b collide)",
                )
            )
        if seen_paths[path] > 1:
            continue
        digest = _paths.path_digest(path)
        if digest in seen_digests:
            problems.append(
                Problem(
                    path,
                    f"its 64-bit key digest collides with "
                    f"{seen_digests[digest]!r}; rename one of them",
                )
            )
        seen_digests[digest] = path

        spec = leaf
        mine = []
        if not callable(spec.init):
            mine.append(
                f"init {spec.init!r} is not callable; pass an initializer "
                f"init(key, shape, dtype), for example jax.nn.initializers.normal()"
            )
        if spec.mesh is None:
            mine.append(
                "no mesh given and no default; pass mesh= to param() or build it "
                "inside meshinit.defaults(mesh=...)"
            )
        elif not _is_mesh(spec.mesh):
            mine.append(
                f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {type(spec.mesh).__name__}"
            )
        else:
            entries_, msgs = _partition(spec.shape, spec.axes, spec.rules, spec.mesh)
            mine += msgs
        fp = None
        if callable(spec.init):
            fp = fingerprint(spec.init)
            msg = check_init(spec.init, fp, spec.shape, spec.dtype) if check_inits else None
            if msg:
                mine.append(msg)
        if mine:
            problems += [Problem(path, m) for m in mine]
            continue
        skey = (spec.mesh, entries_)
        if skey not in shardings:
            shardings[skey] = NamedSharding(spec.mesh, PartitionSpec(*entries_))
        entries.append(
            PlanEntry(
                path=path,
                spec=spec,
                sharding=shardings[skey],
                signature=(fp, spec.shape, spec.dtype, entries_),
                leaf_index=index,
            )
        )

    if problems:
        raise PlanError(problems)
    groups: dict[Any, list[PlanEntry]] = {}
    for e in entries:
        groups.setdefault(e.mesh, []).append(e)
    return Plan(
        entries=tuple(entries),
        groups=tuple(MeshGroup(m, tuple(es)) for m, es in groups.items()),
        treedef=treedef,
        leaves=tuple(leaf for _, leaf in flat),
    )
