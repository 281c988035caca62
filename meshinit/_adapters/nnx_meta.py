"""flax nnx metadata as meshinit specs: a Variable's sharding, mesh and rules, read the way
flax reads them, translated into a spec whose axes are mesh axes."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any, cast

try:
    from flax import errors as flax_errors
    from flax import nnx
    from flax.core import spmd as flax_spmd
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("meshinit.nnx needs flax: pip install 'meshinit[nnx]'") from e

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .._errors import Problem
from .._plan.plan import Plan, PlanEntry
from .._run.checks import Refused
from .._spec import rules as _rules
from .._spec.constructor import from_constructor
from .._spec.spec import ParamSpec, key_spec, memory_kind_default, replicated_default
from . import common as _adapters
from . import nnx_rules as _nnx_rules
from .placement.forms import Placements
from .placement.parsed import Parsed
from .placement.replicas import Replicas


def is_key(value: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key)


def is_host_array(value: Any) -> bool:
    """A numpy array or scalar (``np.float32(1)``) of a type jax holds: placed like a
    ``jax.Array`` when flax's eager sharding would make one of it (:func:`shards_eagerly`)
    or a ``placements=`` entry names it, else left as it is."""
    if not isinstance(value, np.ndarray | np.generic):
        return False
    try:
        jax.typeof(value)  # big-endian, str, object: what jax refuses, as flax does
    except TypeError:
        return False
    return True


def shards_eagerly(var: nnx.Variable) -> bool:
    """Whether flax's eager sharding turns ``var``'s value into a placed ``jax.Array``:
    sharding metadata that is not empty. flax leaves a numpy value with no sharding, or
    an empty one (``()``, ``P()``), as it is (``flax.core.spmd.shard_value``), and
    ``nnx.jit`` would return it as a jax.Array: where the two differ, meshinit leaves it."""
    meta = var.get_metadata()
    return any(bool(meta.get(k)) for k in ("out_sharding", "sharding", "sharding_names"))


def left_as_is(var: nnx.Variable, placement: Parsed | None) -> bool:
    """Whether ``var`` holds a numpy value that flax leaves as it is, and so does
    meshinit: no placement names it and its sharding is empty (:func:`shards_eagerly`)."""
    return isinstance(var.get_value(), np.ndarray | np.generic) and not (
        placement is not None or shards_eagerly(var)
    )


def unholdable_problems(
    flat: Sequence[tuple[tuple[Any, ...], nnx.Variable]], table: Placements
) -> list[Problem]:
    """The problem of each numpy value jax cannot hold (big-endian, str, object) that
    its sharding or a ``placements=`` entry asks to place; the others stay as they are."""
    problems = []
    for p, var in flat:
        value = var.get_value()
        if not isinstance(value, np.ndarray | np.generic) or is_host_array(value):
            continue
        path = ".".join(map(str, p))
        placement = table.match(path) if table else None
        if left_as_is(var, placement):
            continue
        why = placement.name if placement is not None else "its sharding metadata"
        problems.append(
            Problem(
                path,
                f"holds a numpy array of dtype {value.dtype}, which jax cannot hold, and "
                f"{why} places it; flax's own sharding refuses it too: convert it first "
                f"(x.astype(x.dtype.newbyteorder('=')) for a big-endian array)",
            )
        )
    return problems


def key_rank_problem(path: str, key: Any, entries: Sequence[Any], given: str) -> Problem | None:
    """The problem of a placement (``given``) with more entries than the typed key array
    ``key`` has dimensions, if it has: jax shards a key only along its own dimensions,
    never its key data's trailing one."""
    if len(entries) <= len(key.shape):
        return None
    n = len(entries)
    return Problem(
        path,
        f"{given} gives {PartitionSpec(*entries)}, {n} {'entry' if n == 1 else 'entries'}, "
        f"for a typed PRNG key array {key.dtype}{list(key.shape)} of rank {len(key.shape)}: "
        f"a key is placed by at most one entry per dimension of its own (jax never shards "
        f"its key data's trailing dimension); drop the extra entries",
    )


def has_sharding(meta: dict[str, Any]) -> bool:
    """Whether flax metadata names a sharding; the empty ``P()`` counts (replicated)."""
    return any(meta.get(k) is not None for k in ("out_sharding", "sharding", "sharding_names"))


def _sharding_names(meta: dict[str, Any]) -> tuple[Any, ...]:
    """The names of flax's sharding metadata, under whichever key flax has them."""
    keys = ("out_sharding", "sharding", "sharding_names")
    return tuple(next((meta[k] for k in keys if meta.get(k)), ()))


def spelled_length(var: nnx.Variable) -> int:
    """How many entries flax spells a Variable's sharding with: ``nnx.get_named_sharding``'s
    (None only for a Variable without a shape), or under a table that resolves as linen
    (MaxText's NNX init) as many as its names."""
    meta = var.get_metadata()
    if _nnx_rules.as_linen(meta):
        return len(_sharding_names(meta))
    return len(cast(PartitionSpec, nnx.spmd.get_var_pspec(var)))


def spec_for(
    var: nnx.Variable,
    value: Any,
    problems: list[Problem],
    path: str,
    meshes: Sequence[tuple[re.Pattern[str], Any]],
    mesh: Mesh | AbstractMesh | None,
    placement: Parsed | None,
    replicas: Replicas,
    call: str = "meshinit.nnx.init",
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
    the Variable's own, else for a replicated one the mesh of ``replicas``), unless a
    ``meshes`` pattern matches; :func:`placed_spec`. ``call`` is the function the user
    called, as a message names it.
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
        return placed_spec(
            var, value, (shape, dtype), problems, path, override, mesh, placement, replicas
        )
    mesh = override if override is not None else _own_mesh(meta) or mesh
    if mesh is None:
        mesh = _adapters.context_mesh()
    axes = None
    logical, notes = None, {}
    if has_sharding(meta):
        if mesh is None:
            problems.append(
                Problem(
                    path,
                    f"has sharding metadata but no mesh: pass mesh= to {call} (or to the "
                    f"Variable), build it under jax.set_mesh, or give it one with meshes=",
                )
            )
            return None
        raw = _sharding_names(meta)
        ruled = bool(meta.get("sharding_rules") or flax_spmd.get_logical_axis_rules())
        if ruled and _nnx_rules.as_linen(meta):  # MaxText's NNX init: linen's algorithm
            pspec, found = _nnx_rules.linen_resolved(meta, raw, len(value.shape), path, mesh)
        else:  # in the core's words, naming the rule (_nnx_rules.settle words each miss)
            found = [Problem(path, m) for m in _nnx_rules.unruled(meta, raw, mesh)]
            found += _nnx_rules.misses(meta, raw, path, mesh)
            # flax returns None only for a Variable without a shape; this one has a value
            pspec = tuple(cast(jax.sharding.PartitionSpec, nnx.spmd.get_var_pspec(var)))
            found += _nnx_rules.shared(raw, pspec, path) if ruled and not found else []
        if found:
            problems += found
            return None
        if raw and ruled:
            logical = tuple(raw) + (None,) * (len(value.shape) - len(raw))
            in_effect = meta.get("sharding_rules") or flax_spmd.get_logical_axis_rules()
            notes = _rules.rule_notes(logical, in_effect)  # meshinit.maxtext.rules' notes
        entries = pspec + (None,) * (len(value.shape) - len(pspec))
        problem = _adapters.unconstrained_problem(path, entries, "sharding")
        if problem is None and is_key(value):
            problem = key_rank_problem(path, value, pspec, f"its sharding {tuple(raw)}")
        if problem is not None:
            problems.append(problem)
            return None
        axes = entries + (None,) * (len(shape) - len(entries))
    if mesh is None:
        mesh = _adapters.default_mesh()
    # RNG state and scalars are replicated on purpose: the plan never suggests sharding them
    meant = tuple(mesh.axis_names) if isinstance(var, nnx.RngState) or not shape else ()
    # flax's logical names, shown in the plan (the axes are already mesh axes), with the
    # notes of the rules that resolved them (meshinit.maxtext.rules' replicated names)
    shown: dict[str, Any] = {} if logical is None else {"logical": logical}
    if notes:
        shown["rule_notes"] = notes
    return ParamSpec(
        shape=shape,
        init=from_constructor,
        # a Variable's own memory_kind= metadata, else the defaults() one
        memory_kind=meta.get("memory_kind", memory_kind_default()),
        axes=axes,
        mesh=mesh,
        rules=None,
        dtype=dtype,
        metadata=shown,
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
    replicas: Replicas,
) -> ParamSpec | None:
    """The spec of a Variable that a ``placements=`` entry matches.

    The entry's axes replace the metadata's: logical names resolve through the rules
    in effect (the call's ``rules=`` or flax's context rules), a PartitionSpec names
    mesh axes. The mesh is the matching ``meshes`` one, else the entry's, else
    ``mesh``, else the context mesh (``meshinit.defaults``, ``jax.set_mesh``), else the
    Variable's own, else, where the entry replicates it, the one mesh the placements
    name (``replicas``, which refuses it where that is not clear). ``planned`` is the
    planned shape and dtype (a typed key's data: its extra dimension is replicated).
    """
    shape, dtype = planned
    meta = var.get_metadata()
    where = next(
        (
            m
            for m in (override, placement.mesh, _adapters.placement_mesh(mesh), _own_mesh(meta))
            if m is not None
        ),
        None,
    )
    axes = placement.axes_for(len(value.shape))
    if axes is not None and is_key(value):
        problem = key_rank_problem(path, value, axes, placement.name)
        if problem is not None:
            problems.append(problem)
            return None
    if axes is not None and len(axes) == len(value.shape):
        axes = axes + (None,) * (len(shape) - len(value.shape))  # a key's data dimension
    context = flax_spmd.get_logical_axis_rules()
    rules = placement.rules_for(_rules.normalize_rules(context) if context else None)
    where = replicas.mesh_or_problem(where, path, placement, axes, problems, "the call")
    if where is None:
        return None
    meant = tuple(where.axis_names) if isinstance(var, nnx.RngState) or not shape else ()
    memory_kind = placement.memory_kind
    if memory_kind is None:
        memory_kind = meta.get("memory_kind", memory_kind_default())
    try:
        return ParamSpec(
            shape=shape,
            init=from_constructor,
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
    data, as planned. A Module stands for its state, as an ``nnx.State`` does.

    A typed key is checked as a key: its shape and implementation against the planned
    key's (a split key, an ``rbg`` key for a ``threefry2x32`` one), not as key data.
    """
    if isinstance(existing, nnx.Module):
        existing = nnx.state(existing)
    if isinstance(existing, nnx.State):
        existing = nnx.to_pure_dict(existing)
    flat = _adapters.flat_existing(existing)
    if flat is None:
        return None
    planned = {".".join(map(str, p)): k for p, k in keys.items()}
    for path, value in flat.items():
        # Arrays only: a key-typed ShapeDtypeStruct (a restore target) or a duplicated
        # path is left for the checks to name.
        if path not in planned or not isinstance(value, jax.Array | np.ndarray):
            continue
        key, impl = planned[path]
        if is_key(value):
            wrong = _key_mismatch(value, key, impl)
            flat[path] = Refused(wrong) if wrong else jax.random.key_data(value)
            continue
        data = jax.eval_shape(jax.random.key_data, key)
        if tuple(value.shape) != data.shape:
            flat[path] = Refused(
                f"existing key data has shape {tuple(value.shape)}, planned {data.shape}: "
                f"the data of a {impl} key array of shape {key.shape} ({key.dtype}); pass "
                f"the key (or its jax.random.key_data) as the model holds it"
            )
    return flat


def _key_mismatch(value: Any, key: Any, impl: Any) -> str | None:
    """How the typed key array ``value`` differs from the planned ``key`` (a struct of
    implementation ``impl``), compared as keys, or None."""
    if value.dtype != key.dtype:
        return (
            f"existing key's implementation is {jax.random.key_impl(value)} ({value.dtype}), "
            f"planned {impl} ({key.dtype}): the implementations differ; pass a {impl} key "
            f"(jax.random.key(seed, impl={str(impl)!r})), or leave the path out to make it"
        )
    if tuple(value.shape) != tuple(key.shape):
        return (
            f"existing key array has shape {tuple(value.shape)}, planned {tuple(key.shape)} "
            f"({key.dtype}); pass the key as the model holds it (a split key has a "
            f"dimension more)"
        )
    return None


def typed_key_plan(plan: Plan, keys: dict[str, Any]) -> Plan:
    """``plan``, planned with typed keys as their key data, with each key's entry shown
    as the key array the init gives back: its own shape and dtype (``key<fry>[]``), and
    the sharding jax gives the key wrapped from that data (the data's spec, padded with
    None to the data's rank, less the trailing dimension: :func:`key_sharding`).
    """
    new: dict[int, Any] = {}
    for e in plan.entries:
        if e.path in keys:
            key = keys[e.path]
            sharding = key_sharding(e.sharding, len(e.spec.shape), len(key.shape))
            new[id(e)] = dataclasses.replace(e, spec=key_spec(e.spec, key), sharding=sharding)
    return _adapters.replace_entries(plan, new)


def key_sharding(data: NamedSharding, data_ndim: int, ndim: int) -> NamedSharding:
    """The sharding of a key array of ``ndim`` dimensions wrapped from key data placed on
    ``data``, as jax spells it on a mesh of several devices (on one device jax 0.10
    keeps the data's spec, which :func:`rewrapped` respells)."""
    spec = tuple(data.spec)
    spec += (None,) * (data_ndim - len(spec))
    return NamedSharding(data.mesh, PartitionSpec(*spec[:ndim]), memory_kind=data.memory_kind)


def rewrapped(data: jax.Array, impl: Any, sharding: NamedSharding) -> jax.Array:
    """The typed key array of the placed key ``data``, on exactly ``sharding`` (the
    plan's): jax 0.10 spells a key wrapped on one device with its data's spec, which
    places alike; its shards are taken as they are, nothing is copied."""
    key = jax.random.wrap_key_data(data, impl=impl)
    if key.sharding == sharding:
        return key
    shards = [s.data for s in key.addressable_shards]
    return jax.make_array_from_single_device_arrays(key.shape, sharding, shards)
