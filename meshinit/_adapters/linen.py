"""linen's trace-and-plan: ``module.init`` traced once with host keys and example
inputs, and its variables planned as their partitioning boxes, ``placements=``,
``meshes=`` and ``default=`` say (for :func:`meshinit.linen.init` and
:func:`~meshinit.linen.plan`); the made arrays put back in their boxes. Compiles and
allocates nothing."""

from __future__ import annotations

import functools
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta

from .. import _paths, _patterns
from .._engine import entry as _engine
from .._errors import PlanError, Problem
from .._format import describe_mesh
from .._plan import planner as _planner
from .._plan.plan import Plan
from . import common as _adapters
from . import linen_meta as _linen_meta
from .placement import parsed as _parsed
from .placement import read as _placements
from .placement import replicas as _replicas
from .prepared import Prepared

_EXPLICIT_BOX = (
    "its box carries mesh={mesh}, whose axes are Explicit: linen's unbox constrains the "
    "value with jax.lax.with_sharding_constraint, which jax refuses on Explicit axes "
    "(flax's own module.init fails the same way). Fix: give the box an Auto-axes mesh "
    "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n)), or leave mesh= "
    "off the box and pass the Explicit mesh to meshinit.linen.init(mesh=... or meshes=...)"
)


def explicit_box_problem(error: ValueError) -> Problem | None:
    """The path and fix for linen's unbox failing on a box whose own mesh is Explicit.

    linen applies a box's sharding constraint as the module reads it, to the box's own
    ``mesh=`` when it has one. meshinit leaves flax's classes alone (it traces under the
    Auto twin of the context mesh, which covers every box without a mesh of its own),
    so a box that names an Explicit mesh fails inside ``module.init``; the frames of
    that failure say which variable it was.
    """
    box = scope = name = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        here = frame.f_locals
        if frame.f_code.co_name == "unbox" and isinstance(here.get("self"), meta.Partitioned):
            box = here["self"]
        elif frame.f_code.co_name == "param" and hasattr(here.get("self"), "path_text"):
            scope, name = here["self"], here.get("name")
    if box is None or box.mesh is None or "Auto axes" not in str(error):
        return None
    parts = ["params", *(p for p in scope.path_text.split("/") if p)] if scope else []
    path = ".".join([*parts, str(name)]) if scope is not None and name is not None else ""
    return Problem(path, _EXPLICIT_BOX.format(mesh=describe_mesh(box.mesh)))


def host_keys(key: Any) -> tuple[list[np.ndarray], Callable[[list[Any]], Any]]:
    """Host key data, and the function that rebuilds ``module.init``'s rngs from it.

    A dict of keys (``{"params": k1, "dropout": k2}``) becomes a dict again. A legacy
    uint32 key reaches ``module.init`` as a legacy key, a typed key (or an int seed, as
    ``jax.random.key(seed)``) as a typed key of its implementation.
    """
    names = list(key) if isinstance(key, Mapping) else None
    keys = [key[n] for n in names] if names is not None else [key]
    data, makers = zip(*(_traced_key(k, names, i) for i, k in enumerate(keys)), strict=True)
    data = list(data)

    def rebuild(values: list[Any]) -> Any:
        rebuilt = [make(v) for make, v in zip(makers, values, strict=True)]
        return dict(zip(names, rebuilt, strict=True)) if names is not None else rebuilt[0]

    return data, rebuild


def _traced_key(
    key: Any, names: list[Any] | None, i: int
) -> tuple[np.ndarray, Callable[[Any], Any]]:
    """:func:`_adapters.traced_key`, its error naming the entry of a dict of keys."""
    try:
        return _adapters.traced_key(key)
    except (TypeError, ValueError) as e:
        if names is None:
            raise
        raise type(e)(f"key[{names[i]!r}]: {e}") from e


def host_inputs(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The array leaves of the example inputs, as host values, and how to put them back.

    Arrays enter each group's computation as numpy values (an array on another mesh
    must not pin the computation to it); a ``jax.ShapeDtypeStruct`` stands for zeros
    of its shape, made inside the computation. Everything else (``train=False``,
    ``method=``) stays static.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    data: list[Any] = []
    slots: list[tuple[str, Any]] = []
    for leaf in leaves:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            slots.append(("zeros", leaf))
        elif isinstance(leaf, jax.Array | np.ndarray):
            slots.append(("arg", len(data)))
            data.append(np.asarray(leaf))
        else:
            slots.append(("static", leaf))

    def rebuild(values: list[Any]) -> Any:
        out = []
        for kind, x in slots:
            if kind == "zeros":
                out.append(jax.numpy.zeros(x.shape, x.dtype))
            elif kind == "arg":
                out.append(values[x])
            else:
                out.append(x)
        return jax.tree_util.tree_unflatten(treedef, out)

    return data, rebuild


def abstract_leaf(leaf: Any, aval: Any) -> Any:
    struct = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return leaf.replace_boxed(struct) if _linen_meta.is_box(leaf) else struct


def prepare(
    module: nn.Module,
    key: Any,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    *,
    mesh: Any,
    rules: Any,
    default: Any,
    meshes: Any,
    placements: Any,
    what: str,
) -> Prepared:
    """Traces ``module.init`` once and plans its variables; compiles and allocates nothing."""
    patterns = _adapters.parse_meshes(meshes)
    table, problems = _placements.parse(placements)
    _adapters.check_mesh("mesh", mesh)
    placement = _linen_meta.default_placement(default, mesh)
    key_data, make_rngs = host_keys(key)
    input_data, make_inputs = host_inputs((example_args, example_kwargs))
    n_keys = len(key_data)
    found: list[Any] = []
    notes: list[str | None] = []  # what capture_intermediates= gave (linen_meta)

    def run_init(*values: Any) -> list[Any]:
        args, kwargs = make_inputs(list(values[n_keys:]))
        try:
            variables = module.init(make_rngs(list(values[:n_keys])), *args, **kwargs)
        except ValueError as e:
            problem = explicit_box_problem(e)
            if problem is None:
                raise
            raise PlanError([problem]) from e
        variables, note = _linen_meta.without_intermediates(variables, example_kwargs, what)
        notes.append(note)
        flat, treedef = jax.tree_util.tree_flatten_with_path(variables, is_leaf=_linen_meta.is_box)
        found.append((flat, treedef))
        leaves = [_linen_meta.value_of(leaf) for _, leaf in flat]
        return [x for x in leaves if isinstance(x, jax.Array)]

    host = [*key_data, *input_data]
    traced = _engine.trace(run_init, *host)
    if notes[0] is not None:
        warnings.warn(notes[0], stacklevel=_patterns.outside_stacklevel())
    flat, treedef = found[0]
    avals = iter(traced.out_avals)
    outputs_of: dict[str, int] = {}
    leaves: list[tuple[str, Any]] = []
    for keypath, leaf in flat:
        path = _paths.path_str(keypath)
        if isinstance(_linen_meta.value_of(leaf), jax.Array):
            leaf = abstract_leaf(leaf, next(avals))
            outputs_of[path] = len(outputs_of)
        leaves.append((path, leaf))
    # every path matched first: a replicated placement without a mesh takes the one
    # mesh the others name
    matched = {p: table.match(p, _linen_meta.value_of(x)) if table else None for p, x in leaves}
    replicas = _replicas.Replicas(matched.values())
    specs = []
    placed: dict[str, bool] = {}
    lengths: dict[str, int] = {}
    for path, leaf in leaves:
        # A meshes= match wins over every other mesh; an unannotated variable it
        # matches is replicated there (or laid out as default= says).
        override = next((m for pattern, m in patterns if pattern.fullmatch(path)), None)
        entry = matched[path]
        if entry is not None:
            spec = None  # a broken entry is said once, for itself
            if not entry.broken:
                spec = _linen_meta.placed_spec(
                    path, leaf, entry, mesh, rules, override, problems, replicas
                )
            specs.append(spec)
            if spec is not None:
                own = isinstance(leaf, meta.Partitioned) and leaf.mesh is not None
                named = entry.mesh is not None or override is not None or own
                placed[path] = named or path in replicas.given
                lengths[path] = entry.spelled
            continue
        if table.lacks(path):  # a tree without it: said once, by the tree
            specs.append(None)
            continue
        if isinstance(leaf, meta.Partitioned):
            lengths[path] = len(leaf.names)
        fallback = placement
        if override is not None:
            fallback = (override, None if placement is None else placement[1])
        specs.append(
            _linen_meta.spec_for(
                path, leaf, mesh, rules, fallback, problems, override=override, call=what
            )
        )
    # A meshes= pattern that matches no variable places nothing: likely a typo, warned.
    names = [_paths.path_str(k) for k, _ in flat]
    _adapters.warn_idle_meshes(what, patterns, names)
    problems += table.finish(what, names, "annotation")
    problems += replicas.problems(what, _parsed.CONTEXT)
    plan = _planner.build_plan(
        jax.tree_util.tree_unflatten(treedef, specs), check_inits=False, problems=problems
    )
    # flax's spelling (nn.logical_to_mesh_sharding of nn.get_partition_spec): one entry
    # per name of a box (a placed variable's new box included), none for a leaf
    # without one (P()), so == holds
    plan = _adapters.respell(plan, {p: lengths.get(p, 0) for p in names})
    outputs = [outputs_of[e.path] for e in plan.entries]
    return Prepared(
        plan,
        plan,
        traced,
        outputs,
        existing=functools.partial(_adapters.flat_existing, leaf=_linen_meta.value_of),
        rewrap=functools.partial(variables_of, plan, flat, treedef, placed),
    )


def variables_of(
    plan: Plan, flat: list[tuple[Any, Any]], treedef: Any, placed: dict[str, bool], arrays: Any
) -> Any:
    """The variables ``module.init`` returns, each array of ``arrays`` (the plan's tree)
    in its box: a box ``placements=`` placed says what was placed (``placed[path]``:
    whether it names the mesh); ``flat`` is every (key path, box or value) traced."""
    entries = {e.path: e for e in plan.entries} if placed else {}
    boxes = []
    for (keypath, leaf), array in zip(flat, jax.tree_util.tree_leaves(arrays), strict=True):
        path = _paths.path_str(keypath) if placed else ""
        if path in placed:  # its box says what was placed
            e = entries[path]
            boxes.append(_linen_meta.placed_box(leaf, array, e.spec, e.sharding, placed[path]))
        else:
            boxes.append(leaf.replace_boxed(array) if _linen_meta.is_box(leaf) else array)
    return jax.tree_util.tree_unflatten(treedef, boxes)
