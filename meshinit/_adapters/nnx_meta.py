"""flax nnx metadata as meshinit specs: a Variable's sharding, mesh and rules, read the way
flax reads them, translated into a spec whose axes are mesh axes."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any, cast

try:
    from flax import errors as flax_errors
    from flax import nnx
    from flax.core import spmd as flax_spmd
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("meshinit.nnx needs flax: pip install meshinit[nnx]") from e

import jax
from jax.sharding import AbstractMesh, Mesh

from .._errors import Problem
from .._plan.plan import PlanEntry
from .._run import materialize as _materialize
from .._spec import rules as _rules
from .._spec.spec import ParamSpec, memory_kind_default, replicated_default
from . import common as _adapters
from .placements import Parsed


def is_key(value: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key)


def has_sharding(meta: dict[str, Any]) -> bool:
    """Whether flax metadata names a sharding; the empty ``P()`` counts (replicated)."""
    return any(meta.get(k) is not None for k in ("out_sharding", "sharding", "sharding_names"))


def _sharding_names(meta: dict[str, Any]) -> tuple[Any, ...]:
    """The names of flax's sharding metadata, under whichever key flax has them."""
    keys = ("out_sharding", "sharding", "sharding_names")
    return tuple(next((meta[k] for k in keys if meta.get(k)), ()))


def _unruled_names(meta: dict[str, Any], mesh: Any) -> str | None:
    """With ``sharding_rules`` (or flax's context rules), the names in the sharding
    that no rule maps and the mesh does not have: flax would pass them through as mesh
    axes, and the core would then say only that the mesh lacks them."""
    local = meta.get("sharding_rules")
    context = flax_spmd.get_logical_axis_rules()
    if not local and not context:
        return None
    raw = _sharding_names(meta)
    names = [n for e in raw for n in (e if isinstance(e, tuple) else (e,)) if isinstance(n, str)]
    ruled = {r[0] for r in (*(context or ()), *(local or ()))}
    missing = [n for n in dict.fromkeys(names) if n not in ruled and n not in mesh.axis_names]
    if not missing:
        return None
    given = "its sharding_rules" if local else "flax's logical axis rules"
    return (
        f"logical axis name(s) {', '.join(map(repr, missing))} in its sharding "
        f"{tuple(raw)} have no rule in {given}, which were searched (rules for "
        f"{', '.join(map(repr, sorted(ruled)))}), and are not axes of the mesh "
        f"({', '.join(mesh.axis_names)}); add a rule or fix the name"
    )


def spec_for(
    var: nnx.Variable,
    value: Any,
    problems: list[Problem],
    path: str,
    meshes: Sequence[tuple[re.Pattern[str], Any]],
    mesh: Mesh | AbstractMesh | None = None,
    placement: Parsed | None = None,
) -> ParamSpec | None:
    """Translates flax's sharding metadata into a spec whose axes are mesh axes.

    flax's own ``get_var_pspec`` does the translation, so flax's semantics hold: a
    shorter sharding tuple pads with None, and names without a rule pass through as
    mesh axis names (the core then checks they are axes of the mesh). The mesh is the
    first ``meshes`` pattern that matches ``path``, else the Variable's ``mesh=``, else
    ``mesh`` (the call's ``mesh=``), else the context mesh (else the default device).
    A ``memory_kind=`` in the metadata (``nnx.Param(x, memory_kind="pinned_host")``)
    places it in that memory.

    A ``placement`` (the first ``placements=`` entry that matches ``path``) overrides
    the metadata: its axes, and its mesh (else ``mesh``, else the context mesh, else
    the Variable's own), unless a ``meshes`` pattern matches; :func:`placed_spec`.
    """
    shape, dtype = value.shape, value.dtype
    if is_key(value):  # keys travel as their uint32 data; rewrapped after placement
        data = jax.eval_shape(jax.random.key_data, value)
        shape, dtype = data.shape, data.dtype
    meta = var.get_metadata()
    override = next((m for pattern, m in meshes if pattern.fullmatch(path)), None)
    if placement is not None:
        if placement.broken:
            return None  # said once, for the placement
        return placed_spec(var, value, (shape, dtype), problems, path, override, mesh, placement)
    mesh = override if override is not None else _own_mesh(meta) or mesh
    if mesh is None:
        mesh = _adapters.context_mesh()
    axes = None
    logical = None
    if has_sharding(meta):
        if mesh is None:
            problems.append(
                Problem(
                    path,
                    "has sharding metadata but no mesh: pass mesh= to the Variable, "
                    "build it under jax.set_mesh, or give it one with meshes=",
                )
            )
            return None
        unruled = _unruled_names(meta, mesh)
        if unruled:
            problems.append(Problem(path, unruled))
            return None
        # flax returns None only for a Variable without a shape; this one has a value
        pspec = tuple(cast(jax.sharding.PartitionSpec, nnx.spmd.get_var_pspec(var)))
        raw = _sharding_names(meta)
        if raw and (meta.get("sharding_rules") or flax_spmd.get_logical_axis_rules()):
            logical = tuple(raw) + (None,) * (len(value.shape) - len(raw))
        entries = pspec + (None,) * (len(value.shape) - len(pspec))
        problem = _adapters.unconstrained_problem(path, entries, "sharding")
        if problem is not None:
            problems.append(problem)
            return None
        axes = entries + (None,) * (len(shape) - len(entries))
    if mesh is None:
        mesh = _adapters.default_mesh()
    # RNG state and scalars are replicated on purpose: the plan never suggests sharding them
    meant = tuple(mesh.axis_names) if isinstance(var, nnx.RngState) or not shape else ()
    return ParamSpec(
        shape=shape,
        init=_materialize.from_constructor,
        # a Variable's own memory_kind= metadata, else the defaults() one
        memory_kind=meta.get("memory_kind", memory_kind_default()),
        axes=axes,
        mesh=mesh,
        rules=None,
        dtype=dtype,
        # flax's logical names, shown in the plan (the axes are already mesh axes)
        metadata={} if logical is None else {"logical": logical},
        replicated=meant or replicated_default(),
    )


def _own_mesh(meta: dict[str, Any]) -> Mesh | AbstractMesh | None:
    """A Variable's ``mesh=`` metadata, None for none or an empty Mesh."""
    mesh = meta.get("mesh")
    return None if mesh is None or (isinstance(mesh, Mesh) and mesh.empty) else mesh


def placed_spec(
    var: nnx.Variable,
    value: Any,
    planned: tuple[tuple[int, ...], Any],
    problems: list[Problem],
    path: str,
    override: Mesh | AbstractMesh | None,
    mesh: Mesh | AbstractMesh | None,
    placement: Parsed,
) -> ParamSpec | None:
    """The spec of a Variable that a ``placements=`` entry matches.

    The entry's axes replace the metadata's: logical names resolve through the rules
    in effect (the call's ``rules=`` or flax's context rules), a PartitionSpec names
    mesh axes. The mesh is the matching ``meshes`` one, else the entry's, else
    ``mesh``, else the context mesh, else the Variable's own. ``planned`` is the
    planned shape and dtype (a typed key's data: its extra dimension is replicated).
    """
    shape, dtype = planned
    meta = var.get_metadata()
    where = next(
        (
            m
            for m in (override, placement.mesh, mesh, _adapters.context_mesh(), _own_mesh(meta))
            if m is not None
        ),
        None,
    )
    axes = placement.axes_for(len(value.shape))
    if axes is not None and len(axes) == len(value.shape):
        axes = axes + (None,) * (len(shape) - len(value.shape))  # a key's data dimension
    context = flax_spmd.get_logical_axis_rules()
    rules = placement.rules_for(_rules.normalize_rules(context) if context else None)
    if where is None:
        if placement.shards(axes):
            problems.append(placement.no_mesh(path, "the call"))
            return None
        where = _adapters.default_mesh()
    meant = tuple(where.axis_names) if isinstance(var, nnx.RngState) or not shape else ()
    memory_kind = placement.memory_kind
    if memory_kind is None:
        memory_kind = meta.get("memory_kind", memory_kind_default())
    try:
        return ParamSpec(
            shape=shape,
            init=_materialize.from_constructor,
            memory_kind=memory_kind,
            axes=axes,
            mesh=where,
            rules=rules,
            dtype=dtype,
            metadata={} if rules is None else {"logical": placement.axes_for(len(shape))},
            replicated=meant or replicated_default(),
        )
    except (TypeError, ValueError) as e:
        problems.append(Problem(path, f"{placement.name}: {e}"))
        return None


def placements_tree(placements: Any) -> Any:
    """``placements=`` with nnx's containers as plain trees: an ``nnx.State`` (what
    ``nnx.get_partition_spec`` and ``nnx.get_named_sharding`` give) or a Module as its
    pure dict, keyed by the same paths as the Variables."""
    if isinstance(placements, nnx.Module):
        placements = nnx.state(placements)
    if isinstance(placements, nnx.State):
        return nnx.to_pure_dict(placements)
    return placements


def placed_metadata(entry: PlanEntry, ndim: int | None = None) -> dict[str, Any]:
    """Metadata that makes flax's own tools report the placed PartitionSpec (its first
    ``ndim`` entries: a typed key's, planned as its key data)."""
    spec = tuple(entry.sharding.spec)[:ndim]
    meta: dict[str, Any] = {"out_sharding": spec, "mesh": entry.mesh}
    if entry.spec.rules is not None:
        meta["logical_axes"] = entry.spec.axes  # the logical names, kept for readers
    if entry.spec.memory_kind is not None:
        meta["memory_kind"] = entry.memory_kind  # where it lives, as it was asked for
    return meta


def placement_of(
    placed: frozenset[tuple[Any, ...]],
    keys: dict[tuple[Any, ...], tuple[Any, Any]],
    entries: dict[str, PlanEntry],
    path: tuple[Any, ...],
) -> dict[str, Any]:
    """The metadata a Variable that ``placements=`` placed gets (none for the others):
    the placed spec and mesh, so flax's tools report what was placed."""
    if path not in placed:
        return {}
    ndim = len(keys[path][0].shape) if path in keys else None
    return placed_metadata(entries[".".join(map(str, path))], ndim)


@contextlib.contextmanager
def factory_errors(what: str = "meshinit.nnx.init") -> Iterator[None]:
    """Turns jax's and flax's trace errors from a misbehaving factory into one clear error."""
    try:
        yield
    except (jax.errors.UnexpectedTracerError, flax_errors.TraceContextError) as e:
        raise ValueError(f"{what}: {_FACTORY_RULES} ({type(e).__name__})") from e
    except ValueError as e:
        if "set_mesh" in str(e) and "outside of `jax.jit`" in str(e):
            raise ValueError(
                f"{what} traces the factory, and jax.set_mesh cannot be called "
                "while tracing: call jax.set_mesh around meshinit.nnx.init instead, or "
                "give each Variable its mesh with meshes=[(regex, mesh), ...]"
            ) from e
        raise


_FACTORY_RULES = (
    "the factory is traced (abstractly, once), so it must build its own nnx.Rngs and "
    "must not touch outside state"
)


def existing_arrays(existing: Any, keys: dict[tuple[Any, ...], Any]) -> dict[str, Any] | None:
    """``existing=`` as plan path -> array; typed keys (at ``keys``' paths) as their key
    data, as planned."""
    if isinstance(existing, nnx.State):
        existing = nnx.to_pure_dict(existing)
    flat = _adapters.flat_existing(existing)
    if flat is None:
        return None
    key_paths = {".".join(map(str, p)) for p in keys}
    for path, value in flat.items():
        # Arrays only: a key-typed ShapeDtypeStruct (a restore target) or a duplicated
        # path is left for the checks to name.
        if path in key_paths and isinstance(value, jax.Array) and is_key(value):
            flat[path] = jax.random.key_data(value)
    return flat
