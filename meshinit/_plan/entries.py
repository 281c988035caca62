"""The parts of a plan: :class:`PlanEntry` (one parameter, resolved) and
:class:`MeshGroup` (the entries on one mesh). :class:`meshinit._plan.plan.Plan` holds
them; both are pure data, with the byte accounting the reports and the checks read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .. import _paths
from .._spec import rules as _rules
from .._spec.spec import ParamSpec
from . import renamed as _renamed


@dataclasses.dataclass(frozen=True)
class PlanEntry(_renamed.EntryRenames):
    """One planned parameter.

    Attributes:
      path: the dot-joined path, for example ``"layers.0.attn.q"``.
      spec: the :class:`ParamSpec` declared there.
      sharding: the exact ``NamedSharding`` its array will have.
      signature: equal for entries that compile to the same work (initializer,
        shape, dtype and PartitionSpec); used to deduplicate compilation.
      leaf_index: the spec's position among the tree's leaves.

    Examples:
      >>> m = jax.make_mesh((2, 4), ("a", "b"))
      >>> p = meshinit.plan({"w": meshinit.param((8, 8), init, axes=("a", "b"), mesh=m)})
      >>> e = p.entries[0]
      >>> e.path, e.sharding.spec, e.shard_shape, e.device_bytes
      ('w', P('a', 'b'), (4, 2), 32)
    """

    path: str
    spec: ParamSpec
    sharding: NamedSharding
    signature: Hashable = dataclasses.field(repr=False)
    leaf_index: int = dataclasses.field(repr=False)

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        """The mesh this parameter is placed on: ``sharding.mesh``."""
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
    def struct(self) -> jax.ShapeDtypeStruct:
        """``jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)``; allocates nothing.

        :meth:`Plan.abstract` is the tree of these.
        """
        return jax.ShapeDtypeStruct(self.spec.shape, self.spec.dtype, sharding=self.sharding)

    @property
    def memory_kind(self) -> str:
        """The memory its shards live in: the planned sharding's memory kind, or
        ``"device"`` where none was asked for on an ``AbstractMesh``."""
        return self.sharding.memory_kind or "device"

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        """The mesh axes of size > 1 that shard no dimension, in mesh order.

        Every device along such an axis holds the same copy of this parameter.

        Examples:
          >>> m = AbstractMesh((2, 4), ("data", "tensor"))
          >>> meshinit.plan(meshinit.param((8, 8), init, axes=(None, "tensor"),
          ...                              mesh=m)).entries[0].replicated_axes
          ('data',)
        """
        return tuple(
            a for a, _ in _rules.shard_options(self.spec.shape, self.sharding.spec, self.mesh)
        )

    def shard_dims(self, axis: str) -> tuple[int, ...]:
        """The dimensions that the replicated mesh axis ``axis`` could shard evenly.

        The rule: dimension ``d`` qualifies when ``shape[d]`` is divisible by the
        product of the sizes of the mesh axes already sharding it (1 if none) times
        the size of ``axis``; so ``axis`` could shard a replicated dimension, or join
        the axes of a sharded one. A parameter with no elements has none.

        Args:
          axis: a mesh axis name; axes that already shard this parameter, or have
            size 1, have no dimensions to offer.

        Returns:
          The qualifying dimensions, in increasing order; empty if there are none.

        Examples:
          >>> m = AbstractMesh((2, 4), ("data", "tensor"))
          >>> e = meshinit.plan(meshinit.param((6, 8), init, axes=(None, "tensor"),
          ...                                  mesh=m)).entries[0]
          >>> e.shard_dims("data")  # 6 % 2 == 0 and 8 % (4 * 2) == 0
          (0, 1)
        """
        options = _rules.shard_options(self.spec.shape, self.sharding.spec, self.mesh)
        return next((dims for a, dims in options if a == axis), ())

    @property
    def shardable_axes(self) -> tuple[str, ...]:
        """The :attr:`replicated_axes` that could shard this parameter (see :meth:`shard_dims`).

        Non-empty means each device holds more of it than it would need to: the
        parameter is replicated across a mesh axis although that axis could shard it.
        Axes the spec marks as replicated on purpose (``param(replicated=...)``) are
        left out.
        """
        options = _rules.shard_options(self.spec.shape, self.sharding.spec, self.mesh)
        return shardable(options, self.spec.replicated)


def shardable(
    options: tuple[tuple[str, tuple[int, ...]], ...], meant: tuple[str, ...]
) -> tuple[str, ...]:
    """The axes of ``_spec.rules.shard_options`` that could shard a parameter, those its
    spec replicates on purpose (``meant``) left out: :attr:`PlanEntry.shardable_axes`."""
    return tuple(a for a, dims in options if dims and a not in meant)


@dataclasses.dataclass(frozen=True)
class MeshGroup:
    """All entries placed on one mesh; materialized by compiled programs of their own,
    never shared with another group (one per bucket of signatures with the default
    ``rounds`` strategy).

    Attributes:
      mesh: the mesh every entry is placed on.
      entries: the plan's entries on this mesh, in tree-flatten order.

    Examples:
      >>> for group in meshinit.plan(specs).groups:
      ...     print(dict(group.mesh.shape), len(group.entries), group.device_bytes)
      {'fsdp': 2, 'tensor': 4} 4 32768
    """

    mesh: Mesh | AbstractMesh
    entries: tuple[PlanEntry, ...]

    @property
    def is_abstract(self) -> bool:
        """Whether the mesh is an ``AbstractMesh`` (plannable, not materializable)."""
        return isinstance(self.mesh, AbstractMesh)

    @property
    def nbytes(self) -> int:
        """Total bytes of the group's parameters, unsharded."""
        return sum(e.spec.nbytes for e in self.entries)

    @property
    def device_bytes(self) -> int:
        """Bytes the group's parameters take on each device of the mesh.

        Every device of the mesh holds the same amount: planning only accepts shardings
        that divide each dimension evenly.
        """
        return sum(e.device_bytes for e in self.entries)

    @functools.cached_property
    def bytes_per_memory_kind(self) -> dict[str, int]:
        """:attr:`device_bytes` split by memory kind: ``{"device": ..., "pinned_host":
        ...}``, the kinds in order of first appearance."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.memory_kind] = out.get(e.memory_kind, 0) + e.device_bytes
        return out

    @functools.cached_property
    def shardable_entries(self) -> tuple[PlanEntry, ...]:
        """The entries replicated across a mesh axis that could shard them.

        Those whose :attr:`PlanEntry.shardable_axes` is not empty, in entry order.
        """
        return tuple(e for e in self.entries if e.shardable_axes)

    @property
    def replicated_bytes(self) -> int:
        """Bytes of :attr:`shardable_entries` on each device of the mesh.

        How much of :attr:`device_bytes` sits on a device only because a parameter is
        replicated across an axis that could shard it. Replicating across a data axis
        may be deliberate (it saves gathers); this says what it costs.
        """
        return sum(e.device_bytes for e in self.shardable_entries)

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
