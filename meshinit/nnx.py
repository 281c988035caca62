"""flax nnx adapter: spec-declared Modules, and existing Modules placed unchanged.

Two ways in:

- :func:`materialize`: a Module whose Variables hold ``ParamSpec``s
  (``self.w = nnx.Param(meshinit.param(...))``) gets arrays in their place. The fast
  path: values follow meshinit's value contract, compiled once per signature.
- :func:`init`: an ordinary Module whose Variables carry flax sharding metadata
  (``out_sharding``, or the older ``sharding``/``sharding_names``, with ``mesh`` and
  ``sharding_rules``) comes back with exactly the shardings that metadata describes,
  and the values its own ``nnx.Rngs`` produce. The factory is traced once and
  compiled by meshinit's constructor engine (:mod:`meshinit._engine.run`): once per
  (mesh, per-variable computation, sharding), so depth adds no compile.
  :func:`plan` previews it without compiling.

And for training, :func:`optimizer`: an ordinary ``nnx.Optimizer`` whose state is
placed exactly like the params it mirrors, by ``meshinit.optax.init``.

Paths are nnx state paths, dot-joined (``layers.0.w``), so a spec-declared Module
gets the same values as ``meshinit.init`` on a dict with the same paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

try:
    from flax import nnx
    from flax.core import spmd as flax_spmd
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("meshinit.nnx needs flax: pip install meshinit[nnx]") from e

import jax
from jax.sharding import AbstractMesh, Mesh

from ._adapters import common as _adapters
from ._adapters import nnx_meta as _nnx_meta
from ._adapters import placements as _placements
from ._adapters.nnx_optimizer import optimizer
from ._engine import entry as _engine
from ._errors import PlanError, Problem
from ._plan import planner as _planner
from ._plan.plan import Plan
from ._run import agree as _agree
from ._run import materialize as _materialize
from ._spec import rules as _rules
from ._spec.spec import ParamSpec

__all__ = ["materialize", "init", "plan", "abstract", "optimizer"]


def _path(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def _nest(flat: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """``{("layers", 0, "w"): x}`` -> ``{"layers": {"0": {"w": x}}}``.

    String keys, so the core's paths are exactly the dot-joined nnx paths, and paths
    that join to the same string are reported as duplicates.
    """
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
        node[str(path[-1])] = value
    return tree


def _get(tree: dict[str, Any], path: tuple[Any, ...]) -> Any:
    for part in path:
        tree = tree[str(part)]
    return tree


def _specs(flat: list[tuple[tuple[Any, ...], nnx.Variable]]) -> dict[tuple[Any, ...], ParamSpec]:
    """The ``ParamSpec``s that a flat state's Variables hold, by nnx path."""
    return {path: var.get_value() for path, var in flat if isinstance(var.get_value(), ParamSpec)}


def spec_tree(module: nnx.Module) -> dict[str, Any]:
    """The specs a spec-declared Module holds, as the tree :func:`materialize` plans.

    Paths in its plan are the Module's nnx paths (``layers.0.w``).
    """
    _, state = nnx.split(module)
    return _nest(_specs(list(nnx.to_flat_state(state))))


def materialize(module: nnx.Module, key: Any) -> nnx.Module:
    """Replaces every ``ParamSpec`` held by the Module's Variables with its placed array.

    Args:
      module: an nnx Module whose Variables hold ``ParamSpec``s; other Variables (RNG
        state, arrays) pass through unchanged.
      key: an int seed, a typed key or a legacy key, as for ``meshinit.materialize``.

    Returns:
      A new Module of the same graph; ``module`` itself is left as it was. Each placed
      Variable carries ``out_sharding`` (mesh axes) and ``mesh`` metadata, so
      ``nnx.get_partition_spec(nnx.state(model))`` gives exactly the placed spec, and
      ``logical_axes`` with the spec's logical names.

    Examples:
      >>> class MLP(nnx.Module):
      ...     def __init__(self):
      ...         self.up = nnx.Param(meshinit.param((d, 4 * d), init, axes=("embed", "mlp")))
      >>> with meshinit.defaults(mesh=mesh, rules=rules):
      ...     model = meshinit.nnx.materialize(MLP(), jax.random.key(0))
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"meshinit.nnx.materialize takes an nnx Module whose Variables hold "
            f"meshinit.param specs, got {type(module).__name__}; for a tree of specs use "
            f"meshinit.init(tree, key)"
        )
    graphdef, state = nnx.split(module)
    flat = list(nnx.to_flat_state(state))
    specs = _specs(flat)
    with _agree.collective("meshinit.nnx.materialize"):  # a plan failing on one process too
        plan = _planner.plan(_nest(specs))
        arrays = _materialize.materialize(plan, key)
    entries = {e.path: e for e in plan.entries}
    placed = []
    for path, var in flat:
        if path in specs:
            entry = entries[_path(path)]
            var = var.replace(_get(arrays, path), **_nnx_meta.placed_metadata(entry))
        placed.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


@dataclasses.dataclass(frozen=True)
class _Prepared:
    plan: Plan
    traced: Any
    outputs: list[int]
    graphdef: Any
    flat: list[tuple[tuple[Any, ...], nnx.Variable]]
    specs: dict[tuple[Any, ...], ParamSpec]
    keys: dict[tuple[Any, ...], tuple[Any, Any]]  # typed key Variables: (struct, impl)
    placed: frozenset[tuple[Any, ...]]  # the Variables a placements= entry placed


def _prepare(
    factory: Callable[[], nnx.Module],
    meshes: Any,
    rules: Any,
    what: str,
    placements: Any = None,
    mesh: Any = None,
) -> _Prepared:
    """Traces ``factory`` once and plans its Variables; compiles and allocates nothing.

    ``rules``, if given, is flax's logical axis rule table for the call: the factory
    is traced and its Variables planned under ``flax.linen.logical_axis_rules(rules)``,
    as if the caller had entered it.
    """
    if rules is None:
        return _prepare_here(factory, meshes, what, placements, mesh)
    table = _rules.normalize_rules(rules)  # a malformed table: one clear error, here
    with flax_spmd.logical_axis_rules(table):
        return _prepare_here(factory, meshes, what, placements, mesh)


def _prepare_here(
    factory: Callable[[], nnx.Module], meshes: Any, what: str, placements: Any, mesh: Any
) -> _Prepared:
    patterns = _adapters.parse_meshes(meshes)
    table, problems = _placements.parse(_nnx_meta.placements_tree(placements))
    _adapters.check_mesh("mesh", mesh)
    if not callable(factory):
        raise TypeError(
            f"factory must be a zero-argument callable returning an nnx Module, got "
            f"{type(factory).__name__}; write meshinit.nnx.init(lambda: Model(...))"
        )
    found: list[Any] = []

    def build() -> list[Any]:
        with nnx.use_eager_sharding(False):
            made = factory()
            if not isinstance(made, nnx.Module):
                raise TypeError(
                    f"{what}: the factory returned {type(made).__name__}, not an nnx Module; "
                    f"it must build and return the Module (lambda: Model(rngs=nnx.Rngs(0)))"
                )
            graphdef, state = nnx.split(made)
        flat = list(nnx.to_flat_state(state))
        arrays = [(p, v.get_value()) for p, v in flat]
        arrays = [(p, x) for p, x in arrays if isinstance(x, jax.Array)]
        # typed keys travel as their data and are wrapped again once placed
        keys = {
            p: (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.random.key_impl(x))
            for p, x in arrays
            if _nnx_meta.is_key(x)
        }
        found.append((graphdef, flat, [p for p, _ in arrays], keys))
        return [jax.random.key_data(x) if _nnx_meta.is_key(x) else x for _, x in arrays]

    with _nnx_meta.factory_errors(what):
        traced = _engine.trace(build)
    graphdef, flat, paths, keys = found[0]
    declared = [_path(p) for p, v in flat if isinstance(v.get_value(), ParamSpec)]
    if declared:
        raise PlanError(
            [
                Problem(p, "holds a meshinit.param spec, which this Module declares")
                for p in declared
            ],
            header=(
                f"{what} is for Modules whose constructors make arrays; this one "
                f"declares specs (nnx.Param(meshinit.param(...))): place it with "
                f"meshinit.nnx.materialize(Model(...), key), or preview it with "
                f"meshinit.plan(Model(...)):"
            ),
        )
    avals = dict(zip(paths, traced.out_avals, strict=True))
    specs: dict[tuple[Any, ...], ParamSpec] = {}
    placed: dict[tuple[Any, ...], int] = {}  # path -> entries the placement spells
    by_path = dict(flat)
    for p in paths:
        struct = keys[p][0] if p in keys else jax.ShapeDtypeStruct(avals[p].shape, avals[p].dtype)
        placement = table.match(_path(p), struct) if table else None
        spec = _nnx_meta.spec_for(by_path[p], struct, problems, _path(p), patterns, mesh, placement)
        if spec is not None:
            specs[p] = spec
            if placement is not None:
                placed[p] = placement.spelled
    # A pattern that matches no Variable places nothing: legal (every Variable falls
    # back to its metadata, the context mesh or the default device), likely a typo.
    names = [_path(p) for p in paths]
    _adapters.warn_idle_meshes(what, patterns, names)
    others = [(_path(p), v.get_value()) for p, v in flat if p not in avals]  # int, None
    problems += table.finish(what, names, "metadata", others)
    plan = _planner.build_plan(_nest(specs), check_inits=False, problems=problems)
    # flax's spelling (nnx.get_named_sharding of the abstract state), so == holds: as
    # many entries as the annotation has, and P() for a Variable without one. Typed
    # keys keep the key array's rank, the only spelling jax gives a key array.
    lengths = {  # flax's pspec is None only for a Variable without a shape
        _path(p): placed[p]
        if p in placed  # as many as the placement gives: flax's spelling of the metadata
        else len(cast(jax.sharding.PartitionSpec, nnx.spmd.get_var_pspec(by_path[p])))
        for p in specs
        if p not in keys
    }
    plan = _adapters.respell(plan, lengths)
    # names resolved through logical axis rules: without the mesh axes of size 1, as
    # MaxText's own nnx init and jax's sharding types spell them
    plan = _adapters.drop_unit_axes(
        plan, [_path(p) for p, s in specs.items() if "logical" in s.metadata]
    )
    position = {_path(p): i for i, p in enumerate(paths)}
    outputs = [position[e.path] for e in plan.entries]
    return _Prepared(plan, traced, outputs, graphdef, flat, specs, keys, frozenset(placed))


def plan(
    factory: Callable[[], nnx.Module],
    *,
    placements: Any = None,
    mesh: Mesh | AbstractMesh | None = None,
    meshes: Any = None,
    rules: Any = None,
) -> Plan:
    """The plan :func:`init` would follow, without compiling or allocating anything.

    The factory is traced abstractly once; every Variable's placement is resolved as
    :func:`init` resolves it. Its paths are the dot-joined nnx paths
    (``layers.3.attn.q_norm.scale``), as in :func:`init`'s plan.

    Args:
      factory: as for :func:`init`.
      placements: as for :func:`init`; their meshes may be ``AbstractMesh`` es.
      mesh: as for :func:`init`; an ``AbstractMesh`` plans before hardware exists.
      meshes: as for :func:`init`; ``AbstractMesh`` es work, for planning before the
        hardware exists.
      rules: as for :func:`init`.

    Returns:
      A :class:`meshinit.Plan`.

    Raises:
      PlanError: as for :func:`init`.

    Examples:
      >>> print(meshinit.nnx.plan(lambda: Model(rngs=nnx.Rngs(0))).compact())
      a row stands for the n parameters its path pattern names; per device sums all n
      <BLANKLINE>
      mesh 0: Mesh(fsdp=2, tensor=4; Explicit; devices 0-7)
        path                 n  array        logical  PartitionSpec  per device
        layers.{0,1}.bias    2  f32[64]      -        replicated          512 B  !
        layers.{0,1}.kernel  2  f32[64,64]   -        fsdp,tensor       4.0 KiB
        w                    1  f32[64,256]  -        fsdp,tensor       8.0 KiB
        5 params, 96.5 KiB in all, 12.5 KiB per device
        ! 2 params replicated across an axis that could shard them: 512 B per device
          fsdp=2 could shard 2 (512 B per device): layers.{0,1}.bias
          tensor=4 could shard 2 (512 B per device): layers.{0,1}.bias
      <BLANKLINE>
      total: 5 params, 96.5 KiB, 1 mesh, most on one device 12.5 KiB
    """
    return _prepare(
        factory, meshes, rules, "meshinit.nnx.plan", placements=placements, mesh=mesh
    ).plan


def abstract(
    factory: Callable[[], nnx.Module],
    *,
    placements: Any = None,
    mesh: Mesh | AbstractMesh | None = None,
    meshes: Any = None,
    rules: Any = None,
) -> nnx.Module:
    r"""The Module :func:`init` would return, each Variable's value a
    ``jax.ShapeDtypeStruct`` with its exact ``NamedSharding``; nothing is compiled or
    allocated.

    What ``nnx.eval_shape`` gives, with the shardings it drops, on every mesh and
    stage. flax's metadata is kept as it is. ``nnx.split`` of it gives the graphdef
    and the restore target of a checkpoint saved from ``nnx.state(model)`` (orbax's
    ``StandardCheckpointer``), in this layout: the layout it was saved in does not
    matter. Typed PRNG keys (``nnx.Rngs`` state) are structs of their key dtype.

    Args:
      factory: as for :func:`init`.
      placements: as for :func:`init`; a placed Variable's metadata says what was
        placed, as in :func:`init`.
      mesh: as for :func:`init`; an ``AbstractMesh`` plans before hardware exists.
      meshes: as for :func:`init`; ``AbstractMesh`` es work, for a target planned
        before the hardware exists.
      rules: as for :func:`init`.

    Returns:
      An nnx Module of the factory's graph, holding structs, not arrays.

    Raises:
      PlanError: as for :func:`init`.

    Examples:
      >>> graphdef, target = nnx.split(meshinit.nnx.abstract(lambda: Model(nnx.Rngs(0))))
      >>> model = nnx.merge(
      ...     graphdef, ocp.StandardCheckpointer().restore(path, target))  # doctest: +SKIP

      (The restore needs a checkpoint on disk: not run in the tests.)
    """
    with _agree.collective("meshinit.nnx.abstract"):
        prep = _prepare(
            factory, meshes, rules, "meshinit.nnx.abstract", placements=placements, mesh=mesh
        )
    structs = prep.plan.abstract()
    entries = {e.path: e for e in prep.plan.entries} if prep.placed else {}
    placed = []
    for path, var in prep.flat:
        if path in prep.specs:
            struct = _get(structs, path)
            if path in prep.keys:  # planned as its key data: the key's own shape and dtype
                key, sharding = prep.keys[path][0], struct.sharding
                spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[: len(key.shape)])
                sharding = jax.sharding.NamedSharding(
                    sharding.mesh, spec, memory_kind=sharding.memory_kind
                )
                struct = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding)
            var = var.replace(
                struct,
                eager_sharding=nnx.using_eager_sharding(),
                **_nnx_meta.placement_of(prep.placed, prep.keys, entries, path),
            )
        placed.append((path, var))
    return nnx.merge(prep.graphdef, nnx.from_flat_state(placed))


def init(
    factory: Callable[[], nnx.Module],
    *,
    placements: Any = None,
    mesh: Mesh | AbstractMesh | None = None,
    meshes: Any = None,
    rules: Any = None,
    existing: Any = None,
) -> nnx.Module:
    r"""Builds an ordinary nnx Module with every Variable placed as its metadata, or a
    placement table, says.

    Every Variable with flax sharding metadata comes back on
    ``NamedSharding(mesh, flax's partition spec)``, Variables without it (RNG state,
    unannotated arrays, or the empty ``P()``) replicated on that mesh. The mesh is the
    first ``meshes`` pattern that full-matches the Variable's dot-joined path, else
    its ``mesh=`` metadata, else ``mesh``, else the ``jax.set_mesh`` context mesh,
    else the default device. A ``placements`` entry that matches a Variable's path
    overrides its metadata. Values are the factory's own, from its own ``nnx.Rngs``;
    a placement moves a Variable and never changes its bits.

    The factory is traced once, abstractly, and compiled by meshinit's constructor
    engine: the keys, counters and small values are computed once on the host, and
    each large Variable's own computation is compiled once per (mesh, computation,
    sharding) and run per Variable, so a 32-layer model compiles what an 8-layer one
    does, and no device computes what it does not own. Params on disjoint submeshes
    work, under an active ``jax.set_mesh`` too.

    Args:
      factory: a zero-argument callable returning an nnx Module. It is traced, so it
        must build its own ``nnx.Rngs``, must not mutate outside state, and must not
        call ``jax.set_mesh``.
      placements: the sharding kept outside the model (EasyDeL's partition rules,
        t5x's): ordered ``(regex, axes)``, ``(regex, axes, mesh)`` or ``(regex, axes,
        mesh, memory_kind)``, as :func:`meshinit.eqx.init` takes them. Each regex is
        full-matched against a Variable's dot-joined path (``layers.0.attn.q.kernel``);
        the first match wins and overrides the Variable's own sharding metadata,
        which then says what was placed (``out_sharding``, ``mesh``, and
        ``logical_axes`` for logical names), so ``nnx.get_partition_spec`` reports
        it. ``axes``: None (replicated), a ``jax.sharding.PartitionSpec`` (mesh axes,
        padded with None to the rank, as jax pads it), or one entry per dimension:
        logical names where rules are in effect (``rules``, or flax's context rules),
        else mesh axes. A placement's mesh comes after a ``meshes`` match and before
        ``mesh``. A Variable no entry matches keeps its metadata; an entry that matches
        no Variable is warned about (:class:`meshinit.UnusedPatternWarning`), one for
        a Variable holding no array (an int, None) is an error. Also: EasyDeL's rules
        as ``meshinit.searched(rules)``; a tree of a ``PartitionSpec``,
        ``NamedSharding`` or None per Variable (``nnx.get_partition_spec(state)``, an
        ``nnx.State`` or pure dict, no path missing or extra); or a rule
        ``(path, shape_dtype) -> axes or NamedSharding``. All are checked alike.
      mesh: the mesh of placements that name none, and of Variables whose metadata
        names none; without it, the ``jax.set_mesh`` context mesh.
      meshes: ordered ``(regex, mesh)`` pairs. The first regex that full-matches a
        Variable's path puts it on that mesh, overriding its ``mesh=`` metadata and
        the context mesh: how existing code is split into pipeline stages unchanged.
        A pattern that matches no Variable path is warned about
        (:class:`meshinit.UnusedPatternWarning`), likely a typo.
      rules: flax's logical axis rule table, ``(logical name, mesh axes)`` pairs (the
        ``logical_axis_rules`` of MaxText's configs): the factory is traced and its
        Variables placed as under ``flax.linen.logical_axis_rules(rules)``, which
        replaces any table the caller entered, for this call only. Without it, the
        table the caller entered (``with nn.logical_axis_rules(rules):``) applies, as
        flax applies it.
      existing: the values of some Variables, made elsewhere (a checkpoint, pretrained
        weights): their plan paths (``layers.1.up.kernel``) to arrays, flat or as a
        nested dict (``nnx.to_pure_dict(state)``, or an ``nnx.State``). Each is placed
        on its planned sharding: an array already there is used as it is, one on
        another mesh is resharded, a numpy array is placed shard by shard. Nothing is
        compiled or run for them; every other Variable gets exactly the value a full
        init gives. A typed key (``nnx.Rngs`` state) may be given as a key or as its
        key data. A big-endian numpy array is placed with its values; a path given
        twice (flat and nested, or keys ``0`` and ``"0"``) is an error.

    Returns:
      The Module, with flax's metadata kept as it was.

    Raises:
      PlanError: a sharding names an axis that is not in its mesh, a dimension does
        not divide, or a sharded Variable has no mesh; a placement is malformed, or a
        tree of placements lacks a Variable or has a leaf no Variable has; an
        ``existing`` path names no
        Variable, is given twice, or its value is no array (a key for a weight, a
        restore target's ``ShapeDtypeStruct``) or differs in shape or dtype; each
        problem names its path, all at once, before anything is allocated.
      ValueError: the factory leaks tracers, mutates outside state or sets a mesh.

    Examples:
      >>> model = meshinit.nnx.init(lambda: Model(rngs=nnx.Rngs(0)))
      >>> staged = meshinit.nnx.init(
      ...     lambda: Model(rngs=nnx.Rngs(0)),
      ...     meshes=[(r"layers\.[0-3]\..*", stage0), (r".*", stage1)])
    """
    # Collective: a factory that fails while tracing on one process fails every process.
    with _agree.collective("meshinit.nnx.init"), _engine.paused_gc():
        prep = _prepare(
            factory, meshes, rules, "meshinit.nnx.init", placements=placements, mesh=mesh
        )
        arrays = _engine.make_arrays(
            prep.plan,
            prep.traced,
            prep.outputs,
            what="meshinit.nnx.init",
            existing=_nnx_meta.existing_arrays(existing, prep.keys),
        )
        entries = {e.path: e for e in prep.plan.entries} if prep.placed else {}
        placed = []
        for path, var in prep.flat:
            if path in prep.specs:
                array = _get(arrays, path)
                if path in prep.keys:  # the key data, placed: a key of eager's type again
                    array = jax.random.wrap_key_data(array, impl=prep.keys[path][1])
                # Traced with eager sharding off; give back what the user's flax would record.
                var = var.replace(
                    array,
                    eager_sharding=nnx.using_eager_sharding(),
                    **_nnx_meta.placement_of(prep.placed, prep.keys, entries, path),
                )
            placed.append((path, var))
        module = nnx.merge(prep.graphdef, nnx.from_flat_state(placed))
        del prep, arrays, placed
    return module
