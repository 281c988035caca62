"""Where each optimizer-state leaf goes: the parameter it mirrors, and its sharding.

:func:`mirrors_of` matches state leaves to parameters by path and shape;
:func:`assign` gives each leaf its parameter's sharding, sharded further over
``shard_over`` (ZeRO-1, :func:`sharded_further`) and in ``memory_kind`` if asked, and puts
the leaves that mirror nothing (step counts) on one mesh. :mod:`meshinit.optax`
compiles and runs what this decides.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import _paths
from .._errors import PlanError, Problem
from .._spec.spec import axis_names
from .planner import memory_kind_problem


def _common_tail(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def mirrors_of(
    param_paths: list[str], param_shapes: list[tuple[int, ...]], state: Any
) -> list[int]:
    """For each state leaf (flatten order), the index of the parameter it mirrors, or -1.

    Among parameters of the leaf's shape: one whose whole path ends the leaf's path
    (longest first); failing that, the one sharing the most trailing path components,
    at least the last (first in tree order on ties). The fallback covers wrappers that
    rename the parameters' root: lookahead's ``fast_state.0.mu.w`` mirrors ``fast.w``.
    """
    params = [p.split(".") if p else [] for p in param_paths]
    # Candidates share the leaf's shape and last path component (a root parameter,
    # path "", matches any leaf of its shape), so this stays linear in the tree size.
    candidates: dict[tuple[Any, ...], list[int]] = {}
    for i, (p, s) in enumerate(zip(params, param_shapes, strict=True)):
        candidates.setdefault((s, p[-1] if p else None), []).append(i)
    out = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        path = _paths.path_str(keypath).split(".")
        shape = tuple(np.shape(leaf))
        best, best_score = -1, (0, 0)
        found = candidates.get((shape, path[-1]), []) + candidates.get((shape, None), [])
        for i in sorted(found):
            p = params[i]
            tail = _common_tail(path, p)
            score = (1, len(p)) if tail == len(p) else (0, tail)
            if score > best_score:
                best, best_score = i, score
        out.append(best)
    return out


def scalars_mesh(leaves: list[Any], scalars_on: Mesh | None) -> Mesh:
    if scalars_on is None:
        return leaves[0].sharding.mesh
    if not isinstance(scalars_on, Mesh | jax.sharding.AbstractMesh):
        raise TypeError(f"scalars_on must be a jax.sharding.Mesh; got {type(scalars_on).__name__}")
    return scalars_on


def shard_over_axes(shard_over: Any) -> tuple[str, ...]:
    return () if shard_over is None else axis_names(shard_over, "shard_over")


def sharded_further(sharding: NamedSharding, shape: tuple[int, ...], axes: tuple[str, ...]) -> Any:
    """``sharding``'s PartitionSpec, sharded further over those of ``axes`` its mesh has.

    The axes (those of this mesh of size > 1 that the spec does not use yet, in the
    order given) go together onto the first dimension the spec leaves unsharded whose size their
    sizes' product divides. Failing one, they are appended to the first sharded
    dimension that stays divisible, after its own axes (so each device's state shard
    lies inside its parameter shard). Failing both, the spec is unchanged.
    """
    mesh_shape = sharding.mesh.shape
    spec = list(sharding.spec)
    used = {a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))}
    extra = tuple(a for a in axes if mesh_shape.get(a, 1) > 1 and a not in used)
    if not extra:
        return sharding.spec
    size = math.prod(mesh_shape[a] for a in extra)
    padded = spec + [None] * (len(shape) - len(spec))
    entry = extra[0] if len(extra) == 1 else extra
    chosen = next((d for d, e in enumerate(padded) if e is None and shape[d] % size == 0), None)
    if chosen is None:
        for d, e in enumerate(padded):
            own = () if e is None else e if isinstance(e, tuple) else (e,)
            if own and shape[d] % (math.prod(mesh_shape[a] for a in own) * size) == 0:
                chosen, entry = d, (*own, *extra)
                break
    if chosen is None:
        return sharding.spec
    padded[chosen] = entry
    return PartitionSpec(*padded[: max(len(spec), chosen + 1)])


def check_placement(
    leaves: list[Any], shard_over: tuple[str, ...], memory_kind: str | None
) -> None:
    """A ``shard_over`` axis in no mesh of the parameters, or a ``memory_kind`` a mesh's
    devices do not offer: all of them in one error."""
    meshes = list({id(x.sharding.mesh): x.sharding.mesh for x in leaves}.values())
    names = {a for m in meshes for a in m.axis_names}
    if memory_kind is not None and not isinstance(memory_kind, str):
        raise TypeError(f"memory_kind must be a memory kind's name or None, got {memory_kind!r}")
    unknown = [a for a in shard_over if a not in names]
    problems = []
    if unknown:
        problems.append(
            Problem(
                "",
                f"shard_over names {', '.join(map(repr, unknown))}, which no mesh of the "
                f"parameters has (they have: {', '.join(sorted(names))}); fix the name or "
                f"drop it",
            )
        )
    if memory_kind is not None:
        said = [memory_kind_problem(memory_kind, mesh) for mesh in meshes]
        problems += [Problem("", text) for text in said if text]
    if problems:
        raise PlanError(problems, header="meshinit.optax cannot place the state there:")


def assign(
    param_paths: list[str],
    leaves: list[Any],
    state: Any,
    scalars_on: Mesh | None,
    shard_over: tuple[str, ...] = (),
    memory_kind: str | None = None,
) -> tuple[list[NamedSharding], list[int]]:
    """Each state leaf's sharding, and the parameter it mirrors (-1: on ``scalars_on``).

    A mirroring leaf gets its parameter's sharding, sharded further over
    ``shard_over`` (:func:`sharded_further`) and in ``memory_kind`` if given; the others are
    replicated on ``scalars_on``, in device memory.
    """
    shapes = [tuple(np.shape(x)) for x in leaves]
    mirrors = mirrors_of(param_paths, shapes, state)
    replicated = NamedSharding(scalars_mesh(leaves, scalars_on), PartitionSpec())
    if not shard_over and memory_kind is None:
        return [leaves[m].sharding if m >= 0 else replicated for m in mirrors], mirrors
    made: dict[tuple[int, Any], NamedSharding] = {}  # one sharding per parameter's
    shardings = []
    for m in mirrors:
        if m < 0:
            shardings.append(replicated)
            continue
        own = leaves[m].sharding
        spec = sharded_further(own, shapes[m], shard_over)
        key = (id(own), spec)
        if key not in made:
            kind = memory_kind if memory_kind is not None else own.memory_kind
            made[key] = NamedSharding(own.mesh, spec, memory_kind=kind)
        shardings.append(made[key])
    return shardings, mirrors
