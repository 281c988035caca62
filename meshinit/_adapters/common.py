"""What the framework adapters (nnx, linen, eqx) share: ``meshes=`` and default meshes."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .. import _paths
from .._errors import PlanError, Problem
from .._patterns import Searched, compile_regex, idle_patterns, pattern_name, warn_idle
from .._plan.plan import MeshGroup, Plan
from .._run.checks import Duplicate
from .._spec.spec import mesh_default


def context_mesh() -> Mesh | None:
    """The ``jax.set_mesh`` context mesh, or None when none is set."""
    mesh = jax.sharding.get_mesh()
    return None if mesh is None or mesh.empty else mesh


def placement_mesh(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh | None:
    """The mesh of a ``placements=`` entry that names none: the call's ``mesh=``, else
    the ``meshinit.defaults(mesh=...)`` one, else the ``jax.set_mesh`` context mesh; the
    same in every adapter. None where there is none."""
    if mesh is not None:
        return mesh
    found = mesh_default()
    return found if found is not None else context_mesh()


def default_mesh() -> Mesh:
    """A mesh with no axes over the default device: where the adapters put what has
    neither a mesh of its own nor a context mesh."""
    device = cast(Any, jax.config).jax_default_device or jax.devices()[0]
    return Mesh(np.array(device), ())


def check_mesh(name: str, mesh: Any) -> None:
    """Refuses a ``mesh=`` argument that is neither None nor a (abstract) mesh."""
    if mesh is not None and not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"{name} must be a jax.sharding.Mesh, an AbstractMesh or None, got "
            f"{type(mesh).__name__}"
        )


def traced_key(key: Any) -> tuple[np.ndarray, Callable[[Any], Any]]:
    """A key's host data, and the function that rebuilds the key from it inside a trace.

    The data enters every computation as a numpy value, so a key placed on a context
    mesh cannot clash with a group's mesh. A legacy uint32 key comes back as a legacy
    key, a typed key (or an int seed, as ``jax.random.key(seed)``) as a typed key of its
    implementation. Validates as :func:`meshinit._paths.host_key` does: one key, of a
    sharding-invariant implementation.
    """
    key = _paths.unwrap_key(key)  # kauldron's PRNGKey: the key it holds
    data, impl = _paths.host_key(key)
    legacy = isinstance(key, jax.Array | np.ndarray) and not jax.dtypes.issubdtype(
        key.dtype, jax.dtypes.prng_key
    )
    if legacy:
        return data, lambda d: d
    return data, lambda d: jax.random.wrap_key_data(d, impl=impl)


def key_array_problem(path: str, dtype: Any, fix: str = "") -> Problem | None:
    """The problem of a variable holding PRNG keys (an extended dtype), if it does."""
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    text = f"holds a {dtype} array (a PRNG key?), which meshinit cannot place"
    return Problem(path, f"{text}; {fix}" if fix else text)


def unconstrained_problem(path: str, entries: Sequence[Any], where: str) -> Problem | None:
    """The problem of an annotation naming ``UNCONSTRAINED``, if ``entries`` do."""
    if not any(e is PartitionSpec.UNCONSTRAINED for e in entries):
        return None
    return Problem(
        path, f"UNCONSTRAINED in its {where} cannot be placed exactly; name mesh axes or None"
    )


def parse_meshes(meshes: Any) -> list[tuple[re.Pattern[str], Any]]:
    """The adapters' ``meshes=``: ordered ``(regex, mesh)`` pairs, compiled; every
    malformed pair is one problem of a single :class:`PlanError`."""
    if meshes is None:
        return []
    if isinstance(meshes, Searched):
        raise TypeError(
            "meshinit.searched(...) marks a placements= table; meshes= is matched with "
            "re.fullmatch on dot-joined paths (layers.0.mlp.kernel): write its regexes so"
        )
    if isinstance(meshes, str | bytes | Mapping) or not isinstance(meshes, Sequence):
        raise TypeError(
            f"meshes must be an ordered sequence of (regex, mesh) pairs, first full match "
            f"wins; got {type(meshes).__name__}"
        )
    parsed, problems = [], []
    for i, pair in enumerate(meshes):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            problems.append(Problem("", f"meshes[{i}] must be a (regex, mesh) pair; got {pair!r}"))
            continue
        regex, where = pair
        if not isinstance(where, Mesh | AbstractMesh):
            problems.append(
                Problem(
                    "",
                    f"meshes[{i}]: the mesh must be a jax.sharding.Mesh or AbstractMesh, "
                    f"got {type(where).__name__}",
                )
            )
        elif isinstance(pattern := compile_regex(f"meshes[{i}]", regex), Problem):
            problems.append(pattern)
        else:
            parsed.append((pattern, where))
    if problems:
        raise PlanError(problems, header="meshes= is malformed:")
    return parsed


def warn_idle_meshes(
    what: str, patterns: Sequence[tuple[re.Pattern[str], Any]], paths: Sequence[str]
) -> None:
    """Warns about each ``meshes=`` pattern (from :func:`parse_meshes`) that full-matches
    none of ``paths``, the variable paths it was matched against."""
    idle = idle_patterns([pattern for pattern, _ in patterns], paths)
    names = [pattern_name("meshes", i, patterns[i][0]) for i in idle]
    warn_idle(what, names, paths, "variable path")


def respell(plan: Plan, lengths: Mapping[str, int]) -> Plan:
    """``plan`` with each entry's PartitionSpec spelled as its framework spells it.

    jax compares PartitionSpecs entry by entry, so ``P("fsdp", None)`` and
    ``P("fsdp", None, None)`` differ under ``==`` though they place alike. flax spells a
    spec with as many entries as the annotation has (``nnx.get_partition_spec``,
    ``nn.logical_to_mesh_sharding``); ``lengths[path]`` is that count, and the entries
    past it, all None, are dropped. The placement is the same.
    """
    new: dict[int, Any] = {}
    for e in plan.entries:
        n = lengths.get(e.path)
        spec = tuple(e.sharding.spec)
        if n is None or n >= len(spec) or any(x is not None for x in spec[n:]):
            continue
        sharding = NamedSharding(
            e.mesh, PartitionSpec(*spec[:n]), memory_kind=e.sharding.memory_kind
        )
        new[id(e)] = dataclasses.replace(e, sharding=sharding)
    return replace_entries(plan, new)


def drop_unit_axes(plan: Plan, paths: Iterable[str]) -> Plan:
    """``plan`` with the mesh axes of size 1 left out of the specs of ``paths``.

    A logical name whose rule lists several mesh axes (MaxText's ``embed`` ->
    ``fsdp, fsdp_transpose, context, ...``) resolves to all of them, and most have
    size 1 on a given mesh. MaxText's own nnx init, as jax's sharding types, spells
    the spec without them (``P(("fsdp", "context"), "stage")`` on a mesh where only
    ``fsdp`` is larger than 1 is ``P("fsdp", None)``). An axis of size 1 splits
    nothing, so the placement is the same.
    """
    new: dict[int, Any] = {}
    wanted = set(paths)
    for e in plan.entries:
        if e.path not in wanted:
            continue
        sizes = dict(e.mesh.shape)
        spec = tuple(
            x if x is None else tuple(a for a in _axis_tuple(x) if sizes.get(a, 1) != 1)
            for x in e.sharding.spec
        )
        if PartitionSpec(*spec) == e.sharding.spec:
            continue
        sharding = NamedSharding(e.mesh, PartitionSpec(*spec), memory_kind=e.sharding.memory_kind)
        new[id(e)] = dataclasses.replace(e, sharding=sharding)
    return replace_entries(plan, new)


def _axis_tuple(x: Any) -> tuple[str, ...]:
    return tuple(x) if isinstance(x, tuple) else (x,)


def replace_entries(plan: Plan, new: Mapping[int, Any]) -> Plan:
    """``plan`` with ``new[id(entry)]`` in place of each entry it names."""
    if not new:
        return plan
    entries = tuple(new.get(id(e), e) for e in plan.entries)
    groups = tuple(
        MeshGroup(g.mesh, tuple(new.get(id(e), e) for e in g.entries)) for g in plan.groups
    )
    return Plan(entries, groups, plan.treedef, plan.leaves)


def flat_existing(existing: Any, leaf: Callable[[Any], Any] | None = None) -> dict[str, Any] | None:
    """``existing=`` of an adapter's ``init``, as dot-joined path -> array: a nested
    mapping (the pure dict of an nnx State, a linen variables dict) is joined by its
    keys; a flat one is as it is. ``leaf``, if given, maps each value (linen unboxes).

    A path spelled more than once (``{"a.b": x, "a": {"b": y}}``, or keys ``0`` and
    ``"0"`` side by side) holds a :class:`~meshinit._run.checks.Duplicate` naming each
    spelling, which the checks report with the other problems.
    """
    if existing is None:
        return None
    if not isinstance(existing, Mapping):
        raise TypeError(
            f"existing must map the plan's dot-joined paths to arrays (or be the same as "
            f"a nested dict), got {type(existing).__name__}"
        )
    flat: dict[str, Any] = {}
    spellings: dict[str, list[str]] = {}

    def walk(prefix: str, spelled: str, tree: Mapping[Any, Any]) -> None:
        for k, v in tree.items():
            path, spelling = f"{prefix}{k}", f"{spelled}[{k!r}]"
            if isinstance(v, Mapping):
                walk(path + ".", spelling, v)
            else:
                flat.setdefault(path, leaf(v) if leaf is not None else v)
                spellings.setdefault(path, []).append(spelling)

    walk("", "existing", existing)
    for path, spelled in spellings.items():
        if len(spelled) > 1:
            flat[path] = Duplicate(tuple(spelled))
    return flat
