"""Planning: every spec resolved to its exact ``NamedSharding``, all problems at once.

:func:`plan` (``meshinit.plan``) and :func:`build_plan`, its form for the adapters:
walk the tree, resolve each spec's axes through its rules on its mesh, check it, and
group the entries per mesh into a :class:`meshinit.Plan`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .. import _caches, _paths
from .._errors import PlanError, Problem
from .._format import describe_mesh, some
from .._spec import input as _input
from .._spec.fingerprints import check_init, initializer_fingerprint
from .._spec.rules import missing_axis_problems, partition
from .._spec.spec import ParamSpec
from .plan import MeshGroup, Plan, PlanEntry


@_caches.memo(maxsize=4096)
def _partition(shape, axes, rules, mesh, logical) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    # Memoized: a deep model repeats a handful of (shape, axes, rules, mesh) many times,
    # and reading ``mesh.shape`` builds a new dict on every call.
    entries, problems = partition(shape, axes, rules, mesh.shape, logical)
    return entries, tuple(problems)


def _is_mesh(m: Any) -> bool:
    return isinstance(m, Mesh | AbstractMesh)


def plan(tree: Any) -> Plan:
    """Resolves every :class:`ParamSpec` in ``tree`` to an exact ``NamedSharding``.

    Args:
      tree: any pytree. ``ParamSpec`` leaves are planned; every other leaf passes
        through untouched. A flax nnx Module whose Variables hold specs
        (``nnx.Param(meshinit.param(...))``) is a pytree too.

    Returns:
      A :class:`Plan`. ``print(plan)`` shows the table.

    Raises:
      PlanError: with one problem per bad spec or path, all gathered first. Also when
        ``tree`` holds no spec but holds a flax nnx Module whose Variables hold arrays
        (ordinary nnx code, built already): plan its constructor with
        ``meshinit.nnx.plan(lambda: Model(...))`` instead.

    Examples:
      >>> m = jax.make_mesh((2, 4), ("a", "b"))
      >>> p = meshinit.plan({"w": meshinit.param((8, 8), init, axes=("a", "b"), mesh=m)})
      >>> p.entries[0].sharding.spec
      P('a', 'b')
    """
    return build_plan(tree)


_NO_MESH = (
    "no mesh given and no default; pass mesh= to param() or build it inside "
    "meshinit.defaults(mesh=...)"
)


def _context_mesh_hint() -> str:
    """What to say when a ``jax.set_mesh`` mesh is active: specs do not read it."""
    context = jax.sharding.get_abstract_mesh()
    if context is None or context.empty:
        return ""
    return (
        f" (a jax.set_mesh context mesh is active, "
        f"{', '.join(f'{a}={n}' for a, n in context.shape.items())}, but specs never "
        f"use the context mesh: pass it, meshinit.defaults(mesh=jax.sharding.get_mesh()))"
    )


def build_plan(tree: Any, *, check_inits: bool = True, problems: Sequence[Problem] = ()) -> Plan:
    """:func:`plan`, for adapters.

    Adapters whose values come from a constructor, not from the specs' initializers
    (the constructor engine, ``meshinit._engine.run``), skip the abstract init check,
    and pass the problems they found themselves, so that everything is raised once.
    """
    flat, treedef = _input.flatten(tree)
    problems = list(problems)
    seen_paths: dict[str, int] = {}
    seen_digests: dict[tuple[int, int], str] = {}
    shardings: dict[tuple[Any, ...], NamedSharding] = {}
    entries: list[PlanEntry] = []
    local: dict[int, Any] = {}  # identity fingerprints: shared within this plan only

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
        if not _input.encodable(path):
            problems.append(
                Problem(
                    path,
                    "has a character that UTF-8 cannot encode (a lone surrogate, as from "
                    "undecodable bytes in a file name); keys are hashed as UTF-8, so "
                    "rename it",
                )
            )
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
            mine.append(_NO_MESH + _context_mesh_hint())
        elif not _is_mesh(spec.mesh):
            mine.append(
                f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {type(spec.mesh).__name__}"
            )
        else:
            entries_, msgs = _partition(
                spec.shape, spec.axes, spec.rules, spec.mesh, spec.logical_names
            )
            mine += msgs
            if spec.memory_kind is not None:
                bad_kind = memory_kind_problem(spec.memory_kind, spec.mesh)
                if bad_kind:
                    mine.append(bad_kind)
        fp = None
        too_big = _input.overflow(spec)
        if too_big:
            mine.append(too_big)
        elif callable(spec.init):
            fp = initializer_fingerprint(spec.init, local)
            msg = check_init(spec.init, fp, spec.shape, spec.dtype) if check_inits else None
            if msg:
                mine.append(msg)
        if mine:
            problems += [Problem(path, m) for m in mine]
            continue
        assert spec.mesh is not None  # no mesh is one of the problems above
        kind = spec.memory_kind
        skey = (spec.mesh, entries_, kind)
        if skey not in shardings:
            shardings[skey] = NamedSharding(spec.mesh, PartitionSpec(*entries_), memory_kind=kind)
        entries.append(
            PlanEntry(
                path=path,
                spec=spec,
                sharding=shardings[skey],
                # the memory kind is part of the out_sharding: of the compiled program
                signature=(fp, spec.shape, spec.dtype, entries_, shardings[skey].memory_kind),
                leaf_index=index,
            )
        )

    uses = [(e.path, e.spec.axes, e.spec.rules) for e in entries if e.spec.rules and e.spec.axes]
    if uses:
        axes = [a for m in {id(e.mesh): e.mesh for e in entries}.values() for a in m.axis_names]
        problems += [Problem(p, m) for p, m in missing_axis_problems(uses, axes)]
    problems += _replicated_problems(entries)
    if not entries:
        # An empty plan is what a built Module gives: say why, instead of planning nothing.
        problems += _built_nnx_modules(tree)
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


@_caches.memo(maxsize=256)
def memory_kinds(mesh: Mesh | AbstractMesh) -> tuple[str, ...] | None:
    """The memory kinds the mesh's devices offer, or None for an ``AbstractMesh``, which
    has no devices to ask. A mesh is of one platform, so one device answers: one of
    this process's if the mesh has any (under ``jax.distributed``), else the first."""
    if isinstance(mesh, AbstractMesh):
        return None
    local = jax.process_index()
    devices = mesh.devices.flat
    device = next((d for d in devices if d.process_index == local), devices[0])
    return tuple(sorted({m.kind for m in device.addressable_memories()}))


def memory_kind_problem(kind: str, mesh: Mesh | AbstractMesh) -> str:
    """What is wrong with placing in ``kind`` on ``mesh``, or ``""`` if nothing is."""
    offered = memory_kinds(mesh)
    if offered is None or kind in offered:
        return ""
    return (
        f"memory_kind {kind!r} is not offered by the devices of {describe_mesh(mesh)}; "
        f"they offer {', '.join(map(repr, offered))}"
    )


def _replicated_problems(entries: list[PlanEntry]) -> list[Problem]:
    """Axes marked ``replicated=`` that no mesh of the plan has (a typo). A stage mesh
    without the axis is fine while another mesh has it, and a parameter that an axis
    shards is simply not replicated over it: a model-wide mark is not a contradiction."""
    marked = [e for e in entries if e.spec.replicated]
    if not marked:
        return []
    names = {a for m in {id(e.mesh): e.mesh for e in entries}.values() for a in m.axis_names}
    unknown: dict[str, list[str]] = {}  # one problem per unknown axis, not per parameter
    for e in marked:
        for axis in e.spec.replicated:
            if axis not in names:
                unknown.setdefault(axis, []).append(e.path)
    problems = []
    for axis, paths in unknown.items():
        more = f" (so do {len(paths) - 1} more parameters)" if len(paths) > 1 else ""
        problems.append(
            Problem(
                paths[0],
                f"replicated names {axis!r}, which no mesh of the plan has (they have: "
                f"{', '.join(sorted(names))}){more}; fix the name or drop it",
            )
        )
    return problems


_FLAX_SHARDING = ("out_sharding", "sharding", "sharding_names", "mesh")


def _built_nnx_modules(tree: Any) -> list[Problem]:
    """One problem per flax nnx Module in ``tree`` whose Variables hold arrays, no spec.

    Such a Module is built already (or abstractly, by ``nnx.eval_shape``): its arrays
    are leaves like any other, so planning it would silently find nothing. Its
    constructor is what can be planned, by ``meshinit.nnx.plan``. flax is imported
    only if the caller already did: an nnx Module implies it.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return []
    problems = []
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Module))
    for keypath, leaf in found[0]:
        if not isinstance(leaf, nnx.Module):
            continue
        variables = [
            (".".join(map(str, p)), v.get_value(), v.get_metadata())
            for p, v in nnx.to_flat_state(nnx.state(leaf))
        ]
        if any(isinstance(value, ParamSpec) for _, value, _ in variables):
            continue  # spec-declared: its specs were planned (or their problems reported)
        arrays = [(p, x, m) for p, x, m in variables if hasattr(x, "shape") and hasattr(x, "dtype")]
        if not arrays:
            continue
        name = type(leaf).__name__
        abstract = all(isinstance(x, jax.ShapeDtypeStruct) for _, x, _ in arrays)
        what = "abstract arrays (jax.ShapeDtypeStruct)" if abstract else "arrays"
        tagged = [
            f"{p}: {', '.join(k for k in _FLAX_SHARDING if m.get(k) is not None)}"
            for p, _, m in arrays
            if any(m.get(k) is not None for k in _FLAX_SHARDING)
        ]
        if tagged:
            held = f"{what} with flax sharding metadata ({some(tagged, 2)}), not meshinit specs"
            build = f"meshinit.nnx.init(lambda: {name}(...)) builds it placed as that metadata says"
        else:
            held = (
                f"{what} ({some([p for p, _, _ in arrays], 2)}) with no flax sharding metadata, "
                f"not meshinit specs"
            )
            build = (
                "Variables without metadata are replicated; or declare specs: "
                "nnx.Param(meshinit.param(...))"
            )
        problems.append(
            Problem(
                _paths.path_str(keypath),
                f"{name} is an nnx Module whose Variables hold {held}, so there is nothing "
                f"to plan; plan its constructor instead, which allocates nothing: "
                f"meshinit.nnx.plan(lambda: {name}(...)); {build}",
            )
        )
    return problems
