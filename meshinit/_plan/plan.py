"""The plan as data: :class:`Plan`, of :class:`~meshinit._plan.entries.MeshGroup` s of
:class:`~meshinit._plan.entries.PlanEntry` s (re-exported here).

Every spec resolved to its exact ``NamedSharding``, grouped by mesh, with the byte
accounting the checks read. :mod:`meshinit._plan.planner` builds it; it is pure and
cheap, allocates nothing and works on ``AbstractMesh``. Its tables, JSON and heatmaps
are :mod:`meshinit._report`'s renderings of its record (:mod:`.record`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax

from .._report import json_text as _json_text
from .._report import plot as _plot
from .._report import report as _report
from . import record as _record
from . import renamed as _renamed
from .entries import MeshGroup, PlanEntry


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
      mesh 0: Mesh(fsdp=2, tensor=4; Explicit; devices 0-7)
        path         shape      dtype    logical axes    mesh axes        PartitionSpec ...
        embed        (256, 64)  float32  (vocab, embed)  tensor=4,fsdp=2  P('tensor', 'fsdp') ...
      ...
      total: 4 params, 256.0 KiB, 1 mesh, most on one device 32.0 KiB
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
          >>> mesh_2x4 = jax.make_mesh((2, 4), ("x", "y"))
          >>> mesh_8 = jax.make_mesh((8,), ("z",))  # the same 8 devices
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
          3.0517578125e-05
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
        return _report.summary(_record.record(self))

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
        return _report.compact(_record.record(self))

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
          >>> m = AbstractMesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
          >>> specs = {"layers": [{"up": meshinit.param((256, 1024), init,
          ...     axes=("fsdp", "tensor"), mesh=m)} for _ in range(32)]}
          >>> d = meshinit.plan(specs).to_dict()  # the specs of the compact() example
          >>> d["params"][0]["partition_spec"], d["totals"]["max_device_bytes"]
          (['fsdp', 'tensor'], 4194304)
        """
        return _record.to_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string.

        Args:
          indent: spaces before each mesh and param record, one record a line; None
            puts everything on one line.

        Returns:
          The JSON text; ``json.loads`` gives back :meth:`to_dict`.

        Examples:
          >>> pathlib.Path("plan.json").write_text(meshinit.plan(specs).to_json())
          1854
        """
        return _json_text.to_json(_record.to_dict(self), indent)

    def heatmap(self) -> Any:
        """Draws each mesh's per-device bytes as a heatmap over the mesh grid.

        One subplot per mesh group. Each cell is a device of that mesh; its colour is
        the bytes of that mesh's parameters it holds (one colour scale for all panels).
        Where a device also holds other meshes' parameters (meshes over shared devices;
        abstract meshes share none), its cell says how much, and the title the most any
        device holds in all. Meshes with more than two axes are drawn with the
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
        return _plot.heatmap(_record.record(self))

    def devices_figure(self) -> Any:
        """Draws which devices each mesh covers: a cell per device, a colour per mesh.

        A device that several meshes cover (a ``(2, 4)`` and an ``(8,)`` mesh over the
        same devices) is split into one band per mesh; disjoint pipeline stages, even
        interleaved ones (``devices[0::2]``, ``devices[1::2]``), show as cells of one
        colour or the other. The legend names each mesh, what it holds (``stages.0.*``)
        and its parameter count. Devices are drawn in id order, row by row; an
        ``AbstractMesh`` has no devices, so its cells are its own, by position. Built
        without pyplot, so it works headless.

        Returns:
          A ``matplotlib.figure.Figure``.

        Raises:
          ImportError: matplotlib is not installed (``pip install 'meshinit[plot]'``).
          ValueError: the plan has no parameters.

        Examples:
          >>> meshinit.plan(specs).devices_figure().savefig("devices.png", dpi=120)
        """
        return _plot.devices(_record.record(self))

    def _repr_html_(self) -> str:
        """The table as HTML, for notebooks: one table per mesh, then the totals."""
        return _report.html(_record.record(self))

    def abstract(self) -> Any:
        """The tree with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` for each spec.

        Allocates nothing; a restore target for checkpoints.

        Returns:
          The planned tree, each spec replaced by its ``ShapeDtypeStruct``; other
          leaves as they were.

        Examples:
          >>> target = meshinit.plan(specs).abstract()
          >>> restored = checkpointer.restore(path, target)  # doctest: +SKIP

          (The restore needs a checkpoint on disk: not run in the tests.)
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
        return _report.table(_record.record(self))
