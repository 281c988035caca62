"""Equinox adapter: place the parameters of equinox Modules exactly on their meshes.

Two ways in:

- :func:`materialize` for modules that declare their parameters as specs
  (``self.w = meshinit.param(...)`` in ``__init__``). Building such a module
  allocates nothing; the core plans and materializes it like any other pytree, so a
  module gets the same values as a dict with the same paths. This is the fast path.
- :func:`init` for existing constructors (``eqx.nn.MLP(..., key=k)``), whose values
  must stay exactly what the constructor makes. Placements pick each array leaf's
  sharding by a regex on its path; the constructor is traced once and compiled by
  meshinit's constructor engine, once per (mesh, per-array computation, sharding),
  with exact out_shardings, so no device ever holds what it does not own.
  :func:`plan` previews it without compiling.

Paths are the dot-joined pytree paths the core uses everywhere: ``layers.0.weight``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

try:
    import equinox as eqx
except ImportError as e:
    raise ImportError("meshinit.eqx needs equinox: pip install meshinit[eqx]") from e

from . import _paths
from ._adapters import common as _adapters
from ._adapters import placement as _placement
from ._adapters import placements as _placements
from ._engine import entry as _engine
from ._errors import Problem
from ._format import some
from ._plan.planner import build_plan
from ._plan.planner import plan as _plan_tree
from ._run import agree as _agree
from ._run.materialize import materialize as _materialize_plan
from ._spec.constructor import from_constructor
from ._spec.spec import MESH_AXES, param

__all__ = ["init", "materialize", "plan"]


def materialize(module: Any, key: Any) -> Any:
    """Replaces every :class:`~meshinit.ParamSpec` in ``module`` with a placed array.

    ``meshinit.materialize(meshinit.plan(module), key)``: the module is a pytree, its
    paths are its attribute names, indices and dict keys joined with dots, and the
    arrays come back in a module of the same type. The value contract holds: the
    same model declared as a dict, an nnx Module or an equinox Module gets
    bit-identical values.

    Args:
      module: an equinox Module (or any pytree) whose fields hold specs. Other
        leaves, arrays included, pass through untouched.
      key: an int seed, a typed key or a legacy uint32 key; all three give the same
        values.

    Returns:
      A module of the same type with a ready ``jax.Array`` in place of each spec,
      each with exactly its planned ``NamedSharding``.

    Raises:
      PlanError: every problem in the module's specs, each naming its path.

    Examples:
      >>> class Linear(eqx.Module):
      ...     w: jax.Array
      ...     def __init__(self, mesh):
      ...         self.w = meshinit.param((256, 1024), lecun_normal(),
      ...                                 axes=("fsdp", "tensor"), mesh=mesh)
      >>> model = meshinit.eqx.materialize(Linear(mesh), jax.random.key(0))
      >>> model.w.sharding
      NamedSharding(mesh=Mesh('fsdp': 2, 'tensor': 4, axis_types=(Explicit, Explicit)),
                    spec=P('fsdp', 'tensor'), memory_kind=device)
    """
    with _agree.collective("meshinit.eqx.materialize"):  # a plan failing on one process too
        return _materialize_plan(_plan_tree(module), key)


Placement = _placements.Placement
"""``(regex, axes)``, ``(regex, axes, mesh)`` or ``(regex, axes, mesh, memory_kind)``."""


def _specs_from_placements(
    abstract: Any,
    placements: Any,
    mesh: Mesh | AbstractMesh | None,
    rules: Any,
    what: str,
) -> tuple[Any, list[Problem], dict[str, int]]:
    """The abstract module with a spec in place of each array leaf, the problems, and
    the number of entries each leaf placed by a PartitionSpec or None is spelled with.

    A placement that matches no leaf, while every leaf is matched, is warned about
    (:class:`~meshinit.UnusedPatternWarning`); with unmatched leaves it is named in
    the problems, as their likely cause.
    """
    table, problems = _placements.parse(placements)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves: list[Any] = []
    unmatched: list[Problem] = []
    bad_placements: dict[int | str, Problem] = {}
    spelled: dict[str, int] = {}
    # ints, None, activation functions: they stay as they are, unless a placement
    # was meant for them (it is refused)
    others = [
        (_paths.path_str(kp), leaf)
        for kp, leaf in jax.tree_util.tree_flatten_with_path(abstract, is_leaf=_is_none)[0]
        if not isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    placeable: dict[int, str] = {}  # flat index -> path of each array leaf meshinit places
    for i, (keypath, leaf) in enumerate(flat):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        path = _paths.path_str(keypath)
        problem = _adapters.key_array_problem(
            path, leaf.dtype, "make it a static field or create it after init"
        )
        if problem is not None:
            problems.append(problem)
            continue
        placeable[i] = path
    paths = list(placeable.values())
    # every path matched first: a replicated placement without a mesh takes the one
    # mesh the others name
    matched = {i: table.match(path, flat[i][1]) for i, path in placeable.items()}
    replicas = _placement.Replicas(matched.values())
    context = _adapters.placement_mesh(mesh)
    for i, (_, leaf) in enumerate(flat):
        leaves.append(leaf)
        if i not in placeable:
            continue
        path, placement = placeable[i], matched[i]
        if placement is not None and placement.broken:
            continue  # said once, for the placement
        if placement is None:
            if isinstance(table, _placements.Table):  # a tree lacking it: said by the tree
                unmatched.append(
                    Problem(
                        path,
                        f"no placement matched this path ({table.how()}; the first match "
                        f'wins); add one, for example (r"{table.example(path)}", None) to '
                        f"replicate it",
                    )
                )
            continue
        where = placement.mesh if placement.mesh is not None else context
        if where is None and not placement.shards(placement.axes):
            where = replicas.mesh_for(path, placement)
            if where is None:
                continue  # said once, for the placement, by replicas.problems
        try:
            spec = param(
                leaf.shape,
                from_constructor,
                axes=placement.axes_for(leaf.ndim),
                mesh=where,
                # a PartitionSpec names mesh axes, whatever the rules
                rules=MESH_AXES if placement.mesh_axes else rules,
                dtype=leaf.dtype,
                memory_kind=placement.memory_kind,  # None: the defaults() one
            )
        except (TypeError, ValueError) as e:
            # The same malformed axes would repeat for every leaf it matches: say it once.
            if placement.per_path:  # a tree's leaf or a rule's answer: this path's own
                bad_placements[path] = Problem(path, f"{placement.name}: {e}")
            else:
                bad_placements.setdefault(placement.index, Problem("", f"{placement.name}: {e}"))
            continue
        if spec.mesh is None:
            bad_placements.setdefault(  # a tree's or a rule's leaves without one: said once
                placement.name if placement.per_path else placement.index,
                Problem(
                    "",
                    f"{placement.name}: no mesh for the leaves it places ({path}, ...); pass "
                    f"mesh= to meshinit.eqx.init, {_placement.CONTEXT}, or {placement.own_mesh}",
                ),
            )
            continue
        leaves[-1] = spec
        if placement.mesh_axes or placement.axes is None:
            spelled[path] = placement.spelled  # P('a') as P('a'), None as P()
    if isinstance(table, _placements.Table):
        problems += table.refuse(others, paths)
        idle = table.idle(paths)
        if not unmatched:
            # As in partition-rule tables (t5x, EasyLM): a rule that places nothing is
            # allowed, but likely a typo, so it is warned about; an unplaced leaf is an error.
            table.warn(what, idle, paths, "array leaf")
        elif idle:  # the leaves a mistyped regex missed: one line, not one each
            problems += [Problem("", table.idle_message(e, paths, "array leaf")) for e in idle]
            shown = some([u.path for u in unmatched], 5)
            unmatched = [
                Problem("", f"{len(unmatched)} array leaves matched no placement: {shown}")
            ]
    else:  # a tree or a rule: each leaf its own placement
        problems += table.finish(what, paths, "placement", others)
    problems += [*bad_placements.values(), *unmatched]
    problems += replicas.problems(what, _placement.CONTEXT)
    return jax.tree_util.tree_unflatten(treedef, leaves), problems, spelled


def _is_none(x: Any) -> bool:
    return x is None


def _array_leaves(tree: Any) -> list[Any]:
    # The same leaves filter_eval_shape turns into ShapeDtypeStructs, in flatten order.
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if eqx.is_array(leaf)]


def _existing(existing: Any) -> dict[str, Any] | None:
    """``existing=`` as plan path -> value: a mapping (flat or nested) as the other
    adapters take it, or a Module (any pytree: a checkpoint restored into the model's
    structure, or ``eqx.filter_eval_shape``'s restore target, which the checks name) by
    the paths of its array leaves; its other leaves (activations, ints) are no
    parameters."""
    if existing is None or isinstance(existing, Mapping):
        return _adapters.flat_existing(existing)
    flat = jax.tree_util.tree_flatten_with_path(existing)[0]
    if any(not keypath for keypath, _ in flat):  # a bare array names no path
        raise TypeError(
            f"existing must map the plan's dot-joined paths to arrays, or be a Module of "
            f"the factory's structure, got {type(existing).__name__}"
        )
    return {
        _paths.path_str(keypath): leaf
        for keypath, leaf in flat
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
    }


@dataclasses.dataclass(frozen=True)
class _Prepared:
    plan: Any
    traced: Any
    outputs: list[int]


def _prepare(
    factory: Callable[[Any], Any],
    key: Any,
    placements: Any,
    mesh: Mesh | AbstractMesh | None,
    rules: Any,
    what: str,
) -> _Prepared:
    """Traces ``factory(key)`` once and plans its arrays; compiles and allocates nothing."""
    key_data, make_key = _adapters.traced_key(key)
    found: list[Any] = []

    def build(data: Any) -> list[Any]:
        module = factory(make_key(data))
        found.append(module)
        return _array_leaves(module)

    traced = _engine.trace(build, key_data)
    avals = iter(traced.out_avals)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(next(avals).shape, x.dtype) if eqx.is_array(x) else x,
        found[0],
    )
    specs, problems, spelled = _specs_from_placements(abstract, placements, mesh, rules, what)
    plan_ = build_plan(specs, check_inits=False, problems=problems)
    # A leaf placed with axes None is replicated, spelled as jax spells a replicated
    # array on its mesh: P() under Auto axes (jax.jit's outputs, NamedSharding(mesh,
    # P())), one None per dimension where an axis is Explicit (the sharding is then
    # part of the type, and every computed array carries it so), so == holds both ways.
    # A PartitionSpec is spelled as given under Auto axes (P("a") stays P("a")).
    replicated = {
        e.path: spelled[e.path]
        for e in plan_.entries
        if e.path in spelled and jax.sharding.AxisType.Explicit not in e.mesh.axis_types
    }
    plan_ = _adapters.respell(plan_, replicated)
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    arrays = [_paths.path_str(kp) for kp, leaf in flat if isinstance(leaf, jax.ShapeDtypeStruct)]
    position = {path: i for i, path in enumerate(arrays)}
    return _Prepared(plan_, traced, [position[e.path] for e in plan_.entries])


def plan(
    factory: Callable[[Any], Any],
    key: Any,
    placements: Any,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Any = None,
) -> Any:
    """The plan :func:`init` would follow, without compiling or allocating anything.

    The factory is traced abstractly once. Paths are the dot-joined pytree paths
    (``layers.0.weight``), as in :func:`init`.

    Args:
      factory: as for :func:`init`.
      key: as for :func:`init`.
      placements: as for :func:`init`; their meshes may be ``AbstractMesh`` es.
      mesh: as for :func:`init`; an ``AbstractMesh`` plans before hardware exists.
      rules: as for :func:`init`.

    Returns:
      A :class:`meshinit.Plan`.

    Raises:
      PlanError: as for :func:`init`.

    Examples:
      >>> p = meshinit.eqx.plan(lambda k: eqx.nn.MLP(64, 16, 256, 2, key=k), 0,
      ...                       [(r".*weight", ("tensor", None)), (r".*", None)], mesh=mesh)
    """
    return _prepare(factory, key, placements, mesh, rules, what="meshinit.eqx.plan").plan


def init(
    factory: Callable[[Any], Any],
    key: Any,
    placements: Any,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Any = None,
    existing: Any = None,
) -> Any:
    """Builds ``factory(key)`` with each array placed exactly, compiled once per mesh.

    For existing equinox constructors, which make arrays themselves. The values are
    those of ``factory(key)``: integers and keys bit for bit as run eagerly, each
    float element as ``jax.jit(factory)`` gives it or within 8·eps·S of eager's (S:
    the magnitudes of its terms; docs/concepts.md, "Unchanged constructors"); each
    array leaf is placed by the first placement whose regex matches its whole path.

    The constructor is traced once, abstractly (nothing is allocated), and compiled
    by meshinit's constructor engine: keys and small values are computed once on the
    host, and each array's own computation is compiled once per (mesh, computation,
    sharding) and run per array, so a deep stack compiles what a shallow one does,
    and each device computes only its own shards.

    Args:
      factory: ``factory(key) -> Module`` (any pytree), traceable, for example
        ``lambda k: eqx.nn.MLP(2, 3, 8, 2, key=k)``.
      key: an int seed (the factory gets ``jax.random.key(seed)``), a typed key, or a
        legacy uint32 key (the factory gets it as it is).
      placements: ordered ``(regex, axes)``, ``(regex, axes, mesh)`` or ``(regex,
        axes, mesh, memory_kind)`` (mesh may be None; memory_kind as in
        :func:`meshinit.param`, None for the ``defaults()`` one). Each regex
        is full-matched (``re.fullmatch``) against the dot-joined path of each array
        leaf, for example ``layers.0.weight``; the first match wins. ``axes`` is as
        in :func:`meshinit.param`: one logical name (or mesh axis name without
        rules) or None per dimension, or None for replicated. A placement's mesh
        overrides ``mesh``; one that replicates (None, ``P()``) where no mesh is given
        takes the one mesh the other placements name, and with none or several is a
        :class:`meshinit.PlanError`. A placement that matches no leaf is warned about
        (:class:`meshinit.UnusedPatternWarning`) when every leaf is matched, and named
        in the error when some leaf is not; one written for a leaf that holds no array
        (an int, None) is an error. ``meshinit.searched(rules)`` is a table matched by
        ``re.search`` on ``/``-joined paths (EasyDeL's rules, unchanged). Or a tree: a
        Module (or pytree) of the factory's structure holding a ``PartitionSpec``, a
        ``NamedSharding`` (its mesh and memory kind too) or None (replicated) at each
        array leaf, as ``jax.eval_shape`` plus a strategy gives; every array leaf must
        have one. Or a rule: ``placements(path, shape_dtype)`` (the dot-joined path and
        the leaf's ``jax.ShapeDtypeStruct``) returning a ``NamedSharding``, a
        ``PartitionSpec``, a tuple of axes or None. Every form is checked alike; a
        sequence is a table where its entries are ``(regex, ...)`` tuples, else a tree
        (a model that is a list of layers).
      mesh: the mesh of placements that name none; defaults to the
        ``meshinit.defaults()`` mesh, else the ``jax.set_mesh`` one.
      rules: the logical-to-mesh rule table, as in :func:`meshinit.param`.
      existing: the values of some leaves, made elsewhere: their plan paths
        (``layers.0.weight``) to arrays, flat or as a nested dict, or a Module of the
        factory's structure (a checkpoint restored into it), whose array leaves are
        taken by their paths. Each is placed on its planned sharding (resharded if it
        is on another mesh, shard by shard if it is numpy); nothing is compiled or run
        for them, and every other leaf gets exactly the value a full init gives. A
        big-endian numpy array is placed with its values; a path given twice (flat and
        nested, or keys ``0`` and ``"0"``) is an error.

    Returns:
      What ``factory(key)`` returns, with each array a ready ``jax.Array`` carrying
      exactly its planned ``NamedSharding``. Non-array leaves (activation functions)
      come from the abstract trace.

    Raises:
      PlanError: all problems at once: array leaves that no placement matches (one
        per path), malformed placements or regexes, and what planning finds (unknown
        logical axes, indivisible dimensions, a missing mesh, ...), a tree of
        placements that lacks a leaf or has one no leaf has, and ``existing``
        paths that name no leaf or are given twice, or whose value is no array (PRNG
        keys, a ``ShapeDtypeStruct`` of a restore target such as
        ``eqx.filter_eval_shape``'s) or differs in shape or dtype.
      TypeError, ValueError: ``placements`` is a str or a sequence that is neither a
        table nor a tree of shardings, or the key is not a single
        sharding-invariant key.

    Examples:
      >>> mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
      >>> mlp = meshinit.eqx.init(
      ...     lambda k: eqx.nn.MLP(64, 16, 256, 2, key=k),
      ...     jax.random.key(0),
      ...     [(r"layers\\.\\d+\\.weight", ("tensor", "fsdp")),
      ...      (r"layers\\.\\d+\\.bias", None)],
      ...     mesh=mesh,
      ... )
      >>> mlp.layers[0].weight.sharding.spec
      P('tensor', 'fsdp')
    """
    # Collective: a factory that fails while traced on one process fails every process.
    with _agree.collective("meshinit.eqx.init"), _engine.paused_gc():
        prep = _prepare(factory, key, placements, mesh, rules, what="meshinit.eqx.init")
        return _engine.make_arrays(
            prep.plan,
            prep.traced,
            prep.outputs,
            what="meshinit.eqx.init",
            existing=_existing(existing),
        )
