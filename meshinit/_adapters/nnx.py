"""nnx's trace-and-plan: an existing nnx Module's factory traced once and its Variables
planned, for :func:`meshinit.nnx.init`, :func:`~meshinit.nnx.plan` and
:func:`~meshinit.nnx.abstract`: what each Variable's flax metadata, a ``placements=``
entry or ``meshes=`` pattern says, resolved to a plan in flax's own spelling, and the
Module rebuilt around what was made. Compiles and allocates nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as flax_spmd

from .._engine import entry as _engine
from .._errors import PlanError, Problem
from .._plan import planner as _planner
from .._plan.plan import Plan
from .._spec import rules as _rules
from .._spec.spec import ParamSpec
from . import common as _adapters
from . import nnx_meta as _nnx_meta
from . import nnx_rules as _nnx_rules
from .placement import parsed as _parsed
from .placement import read as _placements
from .placement import replicas as _replicas
from .prepared import Prepared


def dotted(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def nest(flat: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
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


def get(tree: dict[str, Any], path: tuple[Any, ...]) -> Any:
    for part in path:
        tree = tree[str(part)]
    return tree


def specs_of(flat: list[tuple[tuple[Any, ...], nnx.Variable]]) -> dict[tuple[Any, ...], ParamSpec]:
    """The ``ParamSpec``s that a flat state's Variables hold, by nnx path."""
    return {path: var.get_value() for path, var in flat if isinstance(var.get_value(), ParamSpec)}


def prepare(
    factory: Callable[[], nnx.Module],
    meshes: Any,
    rules: Any,
    what: str,
    placements: Any = None,
    mesh: Any = None,
) -> Prepared:
    """Traces ``factory`` once and plans its Variables; compiles and allocates nothing.

    ``rules``, if given, is flax's logical axis rule table for the call: the factory
    is traced and its Variables planned under ``flax.linen.logical_axis_rules(rules)``,
    as if the caller had entered it.
    """
    if rules is None:
        return prepare_here(factory, meshes, what, placements, mesh)
    table = _rules.normalize_rules(rules)  # a malformed table: one clear error, here
    with flax_spmd.logical_axis_rules(table):
        return prepare_here(factory, meshes, what, placements, mesh)


def prepare_here(
    factory: Callable[[], nnx.Module], meshes: Any, what: str, placements: Any, mesh: Any
) -> Prepared:
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
        # numpy values too (the trace holds them as constants): planned where flax's
        # eager sharding or a placement places them
        arrays = [
            (p, x) for p, x in arrays if isinstance(x, jax.Array) or _nnx_meta.is_host_array(x)
        ]
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
    declared = [dotted(p) for p, v in flat if isinstance(v.get_value(), ParamSpec)]
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
    problems += _nnx_meta.unholdable_problems(flat, table)
    structs = {
        p: keys[p][0] if p in keys else jax.ShapeDtypeStruct(avals[p].shape, avals[p].dtype)
        for p in paths
    }
    # every path matched first: a replicated placement without a mesh takes the one
    # mesh the others name
    matched = {p: table.match(dotted(p), structs[p]) if table else None for p in paths}
    replicas = _replicas.Replicas(matched.values())
    for p in paths:
        placement = matched[p]
        if _nnx_meta.left_as_is(by_path[p], placement):
            continue  # numpy that flax leaves as it is: so does meshinit
        spec = _nnx_meta.spec_for(
            by_path[p], structs[p], problems, dotted(p), patterns, mesh, placement, replicas, what
        )
        if spec is not None:
            specs[p] = spec
            if placement is not None:
                placed[p] = placement.spelled
    # A pattern that matches no Variable places nothing: legal (every Variable falls
    # back to its metadata, the context mesh or the default device), likely a typo.
    names = [dotted(p) for p in paths]
    _adapters.warn_idle_meshes(what, patterns, names)
    others = [(dotted(p), v.get_value()) for p, v in flat if p not in avals]  # int, None
    problems += table.finish(what, names, "metadata", others)
    problems += replicas.problems(what, _parsed.CONTEXT)
    problems = _nnx_rules.settle(problems, [s.mesh for s in specs.values()])
    plan = _planner.build_plan(nest(specs), check_inits=False, problems=problems)
    # flax's spelling (nnx.get_named_sharding of the abstract state), so == holds: as
    # many entries as the annotation has, and P() for a Variable without one. Typed
    # keys are planned as their data, and shown as jax spells the key (typed_key_plan).
    lengths = {
        dotted(p): placed[p]
        if p in placed  # as many as the placement gives: flax's spelling of the metadata
        else _nnx_meta.spelled_length(by_path[p])
        for p in specs
        if p not in keys
    }
    plan = _adapters.respell(plan, lengths)
    # names resolved through logical axis rules: without the mesh axes of size 1, as
    # MaxText's own nnx init and jax's sharding types spell them
    plan = _adapters.drop_unit_axes(
        plan, [dotted(p) for p, s in specs.items() if "logical" in s.metadata]
    )
    position = {dotted(p): i for i, p in enumerate(paths)}
    outputs = [position[e.path] for e in plan.entries]
    # the plan shows typed keys as init gives them back, the engine makes their data
    shown = _nnx_meta.typed_key_plan(plan, {dotted(p): k[0] for p, k in keys.items()})
    return Prepared(
        shown,
        plan,
        traced,
        outputs,
        existing=functools.partial(_nnx_meta.existing_arrays, keys=keys),
        rewrap=functools.partial(
            module_of, shown, graphdef, flat, frozenset(specs), keys, frozenset(placed)
        ),
    )


def module_of(
    plan: Plan,
    graphdef: Any,
    flat: list[tuple[tuple[Any, ...], nnx.Variable]],
    specs: frozenset[tuple[Any, ...]],
    keys: dict[tuple[Any, ...], tuple[Any, Any]],
    placed: frozenset[tuple[Any, ...]],
    values: dict[str, Any],
) -> nnx.Module:
    """The Module of ``graphdef`` with each planned Variable holding its value in
    ``values`` (the plan's tree: the arrays made, or :meth:`Plan.abstract`'s structs).

    A typed key made as its data is wrapped into a key again, on the sharding ``plan``
    shows. flax's metadata is kept; a Variable ``placements=`` placed says what was
    placed. The Module was traced with eager sharding off: each Variable records the
    caller's setting, as the user's flax would.
    """
    entries = {e.path: e for e in plan.entries}
    rebuilt = []
    for path, var in flat:
        if path in specs:
            value = get(values, path)
            if path in keys and isinstance(value, jax.Array):  # the key data, placed
                sharding = entries[dotted(path)].sharding  # as the plan shows it
                value = _nnx_meta.rewrapped(value, keys[path][1], sharding)
            var = var.replace(
                value,
                eager_sharding=nnx.using_eager_sharding(),
                **_nnx_meta.placement_of(placed, keys, entries, path),
            )
        rebuilt.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(rebuilt))
