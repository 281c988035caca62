"""The plan as data: :class:`PlanEntry`, :class:`MeshGroup` and :class:`Plan`.

Every spec resolved to its exact ``NamedSharding``, grouped by mesh, with the byte
accounting the reports and the checks read. :mod:`meshinit._planner` builds it; it is
pure and cheap, allocates nothing and works on ``AbstractMesh``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from . import _paths, _plot, _records, _renamed, _report, _rules
from ._spec import ParamSpec


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
        meant = self.spec.replicated
        return tuple(
            a
            for a, dims in _rules.shard_options(self.spec.shape, self.sharding.spec, self.mesh)
            if dims and a not in meant
        )


@dataclasses.dataclass(frozen=True)
class MeshGroup:
    """All entries placed on one mesh; materialized by one compiled computation.

    Attributes:
      mesh: the mesh every entry is placed on.
      entries: the plan's entries on this mesh, in tree-flatten order.

    Examples:
      >>> for group in meshinit.plan(specs).groups:
      ...     print(group.mesh.shape, len(group.entries), group.device_bytes)
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


@dataclasses.dataclass(frozen=True)
class Plan(_renamed.PlanRenames):
    """Where every parameter of a tree goes. Build it with :func:`plan`.

    Attributes:
      entries: one :class:`PlanEntry` per spec, in tree-flatten order.
      groups: one :class:`MeshGroup` per mesh, in order of first appearance.
      treedef: the tree's structure.
      leaves: the tree's leaves; specs stand where arrays will go.

    Examples:
      >>> plan = meshinit.plan(specs)  # allocates nothing
      >>> print(plan)  # one table per mesh: paths, shapes, axes, bytes per device
      >>> params = meshinit.materialize(plan, jax.random.key(0))
    """

    entries: tuple[PlanEntry, ...]
    groups: tuple[MeshGroup, ...]
    treedef: Any = dataclasses.field(repr=False)
    leaves: tuple[Any, ...] = dataclasses.field(repr=False)

    @property
    def nbytes(self) -> int:
        """Total parameter bytes, unsharded."""
        return sum(e.spec.nbytes for e in self.entries)

    def bytes_per_device(self, memory_kind: str | None = None) -> dict[Any, int]:
        """Bytes of parameters each device holds, summed over all mesh groups.

        Meshes over the same devices add up: a ``(2, 4)`` mesh and an ``(8,)`` mesh
        over the same 8 devices put both groups' shards on each device. Devices of
        other processes are counted too.

        Args:
          memory_kind: count only parameters in this memory (``"device"``,
            ``"pinned_host"``: :attr:`PlanEntry.memory_kind`); None counts every kind.

        Returns:
          A dict from device to bytes, with every device of every mesh (0 for a mesh
          whose parameters have no elements). The keys are ``jax.Device`` objects for a
          ``Mesh``; an ``AbstractMesh`` has no devices, so its keys are
          ``(mesh, i)``, ``i`` the device's flat row-major position in the mesh.
          Abstract meshes are taken to share no devices with any other mesh, even
          with one of the same shape: nothing says which devices they will get.

        Examples:
          >>> p = meshinit.plan({
          ...     "a": meshinit.param((8, 8), init, axes=("x", "y"), mesh=mesh_2x4),
          ...     "b": meshinit.param((8, 8), init, axes=("z", None), mesh=mesh_8)})
          >>> p.bytes_per_device()[jax.devices()[0]]  # 4*2*4 bytes + 1*8*4 bytes
          64
        """
        if memory_kind is None:
            return self._per_device(lambda g: g.device_bytes)
        return self._per_device(lambda g: g.bytes_per_memory_kind.get(memory_kind, 0))

    def replicated_bytes_per_device(self) -> dict[Any, int]:
        """Like :meth:`bytes_per_device`, counting only :attr:`MeshGroup.shardable_entries`.

        The bytes each device holds because parameters are replicated across a mesh
        axis that could shard them.

        Returns:
          A dict with the same keys as :meth:`bytes_per_device`.

        Examples:
          >>> m = AbstractMesh((2, 4), ("data", "tensor"))
          >>> p = meshinit.plan(meshinit.param((8, 8), init, axes=(None, "tensor"), mesh=m))
          >>> p.replicated_bytes_per_device()[(m, 0)]  # 8*2 float32 per device; data could halve it
          64
        """
        return self._per_device(lambda g: g.replicated_bytes)

    @property
    def max_device_bytes(self) -> int:
        """The most bytes of parameters on any one device (0 for an empty plan).

        The largest value of :meth:`bytes_per_device`: meshes that share devices add up.

        Examples:
          >>> meshinit.plan(specs).max_device_bytes / 2**30  # GiB a device needs
        """
        return max(self.bytes_per_device().values(), default=0)

    def _per_device(self, per_group: Callable[[MeshGroup], int]) -> dict[Any, int]:
        # Every device of a mesh holds the same bytes (shardings divide evenly), so one
        # number per group is spread over its devices: O(groups * devices), not entries.
        out: dict[Any, int] = {}
        for g in self.groups:
            n = per_group(g)
            if g.is_abstract:
                mesh = g.mesh
                keys: Iterable[Any] = [(mesh, i) for i in range(mesh.size)]
            else:
                keys = g.mesh.devices.flat
            for k in keys:
                out[k] = out.get(k, 0) + n
        return out

    def summary(self) -> str:
        """The table's totals without its per-parameter rows: per mesh, then overall.

        For models with thousands of parameters, where ``print(plan)`` is long.

        Returns:
          The text: for each mesh its parameter count, bytes in all and per device,
          and what replication costs; then the plan's totals.

        Examples:
          >>> m = jax.make_mesh((2, 4), ("a", "b"))
          >>> p = meshinit.plan({"w": meshinit.param((8, 8), init, axes=("a", "b"), mesh=m)})
          >>> print(p.summary())
          mesh 0: Mesh(a=2, b=4; Explicit; devices 0-7)
            1 param, 256 B in all, 32 B per device
          <BLANKLINE>
          total: 1 param, 256 B, 1 mesh, most on one device 32 B
        """
        return _report.summary(self)

    def compact(self) -> str:
        """The table with repeated layers collapsed into one row each.

        Rows whose paths differ only in integer components (``layers.0.mlp.up``,
        ``layers.1.mlp.up``, ...) and that share shape, dtype, logical axes and
        sharding become one row, ``layers.{0..125}.mlp.up``, with the count ``n`` and
        the bytes all of them take on each device. Rows are exact: indices that do not
        form a full product (``stages.0.layers.{0..3}``, ``stages.1.layers.{4..7}``)
        stay separate rows.

        Returns:
          The table as a string; its rows fit 100 columns for the usual models.

        Examples:
          >>> m = AbstractMesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
          >>> specs = {"layers": [{"up": meshinit.param((256, 1024), init,
          ...     axes=("fsdp", "tensor"), mesh=m)} for _ in range(32)]}
          >>> print(meshinit.plan(specs).compact())
          a row stands for the n parameters its path pattern names; per device sums all n
          <BLANKLINE>
          mesh 0: AbstractMesh(fsdp=2, tensor=4; Auto)
            path                n  array          logical  PartitionSpec  per device
            layers.{0..31}.up  32  f32[256,1024]  -        fsdp,tensor       4.0 MiB
            32 params, 32.0 MiB in all, 4.0 MiB per device
          <BLANKLINE>
          total: 32 params, 32.0 MiB, 1 mesh, most on one device 4.0 MiB
        """
        return _report.compact(self)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data, ready for ``json.dumps``.

        Schema ``"meshinit.plan/1"``; sizes are in bytes, "per device" means on each
        device of the parameter's mesh::

            {"schema": "meshinit.plan/1",
             "meshes": [{                  # one per MeshGroup, in plan order
                "index": 0,                # what params[i]["mesh"] refers to
                "description": "Mesh(fsdp=2, tensor=4; Explicit; devices 0-7)",
                "axis_names": ["fsdp", "tensor"], "axis_sizes": [2, 4],
                "axis_types": ["Explicit", "Explicit"],
                "abstract": false,         # true for an AbstractMesh
                "device_ids": [[0, 1, 2, 3], [4, 5, 6, 7]],  # mesh-shaped; null if abstract
                "params": 3, "nbytes": ..., "device_bytes": ..., "replicated_bytes": ...}],
             "params": [{                  # one per PlanEntry, in tree-flatten order
                "path": "layers.0.mlp.up", "shape": [256, 1024], "dtype": "bfloat16",
                "logical_axes": ["embed", "mlp"],  # null when the axes name mesh axes
                "mesh": 0,                         # index into "meshes"
                "partition_spec": ["fsdp", "tensor"],  # entries: name, [names] or null
                "shard_shape": [128, 256], "nbytes": ..., "device_bytes": ...,
                "replicated_axes": ["data"],       # axes of size > 1 sharding nothing
                "shardable_axes": {"data": [0, 1]}}],  # those that could: their dims
             "totals": {
                "params": 3, "elements": ..., "nbytes": ..., "meshes": 1,
                "device_bytes_per_mesh": [...],  # meshes[i]["device_bytes"]
                "max_device_bytes": ...,         # Plan.max_device_bytes
                "max_replicated_bytes": ...}}    # the most of Plan.replicated_bytes_per_device()

        ``logical_axes`` lists one entry per dimension when the spec has rules (all
        null for a replicated spec). ``replicated_bytes`` counts parameters with
        ``shardable_axes``, as the table's ``!`` does.

        Returns:
          A dict of lists, dicts, strings, ints, bools and None.

        Examples:
          >>> d = meshinit.plan(specs).to_dict()  # the specs of the compact() example
          >>> d["params"][0]["partition_spec"], d["totals"]["max_device_bytes"]
          (['fsdp', 'tensor'], 4194304)
        """
        return _records.to_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string.

        Args:
          indent: spaces before each mesh and param record, one record a line; None
            puts everything on one line.

        Returns:
          The JSON text; ``json.loads`` gives back :meth:`to_dict`.

        Examples:
          >>> pathlib.Path("plan.json").write_text(meshinit.plan(specs).to_json())
        """
        return _records.to_json(self, indent)

    def heatmap(self) -> Any:
        """Draws each mesh's per-device bytes as a heatmap over the mesh grid.

        One subplot per mesh group. Each cell is a device; its colour is the bytes of
        parameters it holds from every mesh, so meshes over shared devices add up
        (abstract meshes share none). Meshes with more than two axes are drawn with the
        first axis as rows and the rest flattened row-major as columns, as the title
        says. Built without pyplot, so it works headless.

        Returns:
          A ``matplotlib.figure.Figure``; ``fig.savefig("plan.png")`` writes it, and
          notebooks display it.

        Raises:
          ImportError: matplotlib is not installed (``pip install 'meshinit[plot]'``).
          ValueError: the plan has no parameters.

        Examples:
          >>> meshinit.plan(specs).heatmap().savefig("plan.png", dpi=120)
        """
        return _plot.heatmap(self)

    def _repr_html_(self) -> str:
        """The table as HTML, for notebooks: one table per mesh, then the totals."""
        return _report.html(self)

    def abstract(self) -> Any:
        """The tree with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` for each spec.

        Allocates nothing; a restore target for checkpoints.

        Returns:
          The planned tree, each spec replaced by its ``ShapeDtypeStruct``; other
          leaves as they were.

        Examples:
          >>> restored = checkpointer.restore(path, meshinit.plan(specs).abstract())
        """
        return self.fill([e.struct for e in self.entries])

    def fill(self, values: list[Any]) -> Any:
        """The tree with ``values[i]`` in place of ``entries[i]``'s spec.

        Args:
          values: one value per entry, in the order of :attr:`entries`.

        Returns:
          The planned tree with the values where the specs were; other leaves as
          they were.

        Examples:
          >>> sizes = plan.fill([e.device_bytes for e in plan.entries])
        """
        values = list(values)
        if len(values) != len(self.entries):
            raise TypeError(
                f"plan.fill takes one value per entry, in the order of plan.entries: "
                f"{len(self.entries)} values, got {len(values)}"
            )
        leaves = list(self.leaves)
        for entry, value in zip(self.entries, values, strict=True):
            leaves[entry.leaf_index] = value
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def __str__(self) -> str:
        return _report.table(self)
