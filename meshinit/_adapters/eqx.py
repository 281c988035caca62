"""eqx's trace-and-plan: ``factory(key)`` traced once and its array leaves planned by
``placements=`` (for :func:`meshinit.eqx.init` and :func:`~meshinit.eqx.plan`), and
``existing=`` read as a mapping or a Module of the factory's structure. Compiles and
allocates nothing; the engine's arrays come back in the factory's own Module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh

from .. import _paths
from .._engine import entry as _engine
from .._errors import Problem
from .._format import some
from .._plan.planner import build_plan
from .._spec.constructor import from_constructor
from .._spec.spec import MESH_AXES, param
from . import common as _adapters
from .placement import parsed as _parsed
from .placement import read as _placements
from .placement import replicas as _replicas
from .placement import table as _table
from .prepared import Prepared


def specs_from_placements(
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
        for kp, leaf in jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_none)[0]
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
    replicas = _replicas.Replicas(matched.values())
    context = _adapters.placement_mesh(mesh)
    for i, (_, leaf) in enumerate(flat):
        leaves.append(leaf)
        if i not in placeable:
            continue
        path, placement = placeable[i], matched[i]
        if placement is not None and placement.broken:
            continue  # said once, for the placement
        if placement is None:
            if isinstance(table, _table.Table):  # a tree lacking it: said by the tree
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
                    f"mesh= to {what}, {_parsed.CONTEXT}, or {placement.own_mesh}",
                ),
            )
            continue
        leaves[-1] = spec
        if placement.mesh_axes or placement.axes is None:
            spelled[path] = placement.spelled  # P('a') as P('a'), None as P()
    if isinstance(table, _table.Table):
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
    problems += replicas.problems(what, _parsed.CONTEXT)
    return jax.tree_util.tree_unflatten(treedef, leaves), problems, spelled


def is_none(x: Any) -> bool:
    return x is None


def array_leaves(tree: Any) -> list[Any]:
    # The same leaves filter_eval_shape turns into ShapeDtypeStructs, in flatten order.
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if eqx.is_array(leaf)]


def existing_of(existing: Any) -> dict[str, Any] | None:
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


def prepare(
    factory: Callable[[Any], Any],
    key: Any,
    placements: Any,
    mesh: Mesh | AbstractMesh | None,
    rules: Any,
    what: str,
) -> Prepared:
    """Traces ``factory(key)`` once and plans its arrays; compiles and allocates nothing."""
    key_data, make_key = _adapters.traced_key(key)
    found: list[Any] = []

    def build(data: Any) -> list[Any]:
        module = factory(make_key(data))
        found.append(module)
        return array_leaves(module)

    traced = _engine.trace(build, key_data)
    avals = iter(traced.out_avals)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(next(avals).shape, x.dtype) if eqx.is_array(x) else x,
        found[0],
    )
    specs, problems, spelled = specs_from_placements(abstract, placements, mesh, rules, what)
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
    outputs = [position[e.path] for e in plan_.entries]
    return Prepared(plan_, plan_, traced, outputs, existing=existing_of, rewrap=lambda x: x)
