"""What materialize checks before allocating anything, each problem naming its path.

``existing=`` arrays (:func:`given_arrays`), abstract meshes, meshes of a cleared
backend, the per-call bound, and the memory each device reports free.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .. import _caches
from .._errors import PlanError, Problem
from .._format import describe_mesh, human_bytes
from .._plan.plan import MeshGroup, Plan, PlanEntry
from .._typos import closest


@dataclasses.dataclass(frozen=True)
class Duplicate:
    """What an adapter's flattened ``existing=`` holds at a path it was given twice, each
    spelling as written (``existing['layers'][0]['up']['kernel']``), in order."""

    spellings: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Refused:
    """What an adapter's flattened ``existing=`` holds at a path whose value it found
    wrong itself (a typed key of another shape or implementation): why, said with the
    other problems."""

    reason: str


def given_arrays(plan: Plan, existing: Mapping[str, Any] | None) -> tuple[dict[int, Any], list]:
    """``existing`` keyed by ``id`` of its plan entry, and every problem found in it.

    A non-native byte order (a big-endian numpy array) is data: it comes back in the
    native order, the same values.
    """
    if existing is None:
        return {}, []
    if not isinstance(existing, Mapping):
        raise TypeError(
            f"existing must map dot-joined paths to arrays, got {type(existing).__name__}"
        )
    by_path = {e.path: e for e in plan.entries}
    problems: list[Problem] = []
    given: dict[int, Any] = {}
    for path, value in existing.items():
        entry = by_path.get(path)
        if isinstance(value, Duplicate):
            problems.append(
                Problem(
                    str(path),
                    f"given twice, as {' and '.join(value.spellings)}; give each path once",
                )
            )
        if entry is None:
            problems.append(_unplanned(plan, by_path, str(path)))
            continue
        if isinstance(value, Duplicate):
            continue
        if isinstance(value, Refused):
            problems.append(Problem(path, value.reason))
            continue
        problem = _value_problem(value, entry)
        if problem is not None:
            problems.append(Problem(path, problem))
            continue
        spec = entry.spec
        if tuple(value.shape) != spec.shape:
            problems.append(
                Problem(
                    path, f"existing array has shape {tuple(value.shape)}, planned {spec.shape}"
                )
            )
        if _native_dtype(value.dtype) != spec.dtype:
            problems.append(
                Problem(
                    path,
                    f"existing array has dtype {np.dtype(value.dtype).name}, planned "
                    f"{spec.dtype.name}; cast it first (x.astype(jnp.{spec.dtype.name}))",
                )
            )
        given[id(entry)] = value
    if problems:  # nothing is placed: no copy for byte order
        return given, problems
    return {i: _native(value) for i, value in given.items()}, problems


def _unplanned(plan: Plan, by_path: Mapping[str, PlanEntry], path: str) -> Problem:
    if not plan.entries:
        return Problem(path, "not a planned parameter: the plan has none")
    close = closest(path, by_path)
    hint = f"; did you mean {close!r}?" if close else ""
    return Problem(
        path,
        f"not a planned parameter; existing maps the plan's dot-joined paths "
        f"(like {plan.entries[0].path!r}) to arrays{hint}",
    )


def _value_problem(value: Any, entry: PlanEntry) -> str | None:
    """What makes ``value`` no array to place for ``entry``, if anything does."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return (
            "existing value must be a jax.Array or numpy array, got ShapeDtypeStruct: a "
            "restore target (shapes and shardings), not values; pass what the "
            "checkpointer restored into it"
        )
    if not isinstance(value, jax.Array | np.ndarray) or isinstance(value, jax.core.Tracer):
        return f"existing value must be a jax.Array or numpy array, got {type(value).__name__}"
    if isinstance(value, jax.Array) and value.is_deleted():
        return (
            "existing array was deleted (x.delete(), or donated to a jitted call); "
            "pass a live array, or leave the path out to generate it"
        )
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
        what = (
            "typed PRNG keys"
            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
            else "an extended dtype"
        )
        return (
            f"existing value is an array of {what} ({value.dtype}{list(value.shape)}), "
            f"where the plan makes a {entry.spec.dtype.name} {entry.spec.shape} array; "
            f"pass the parameter's values, not keys"
        )
    return None


def _native_dtype(dtype: Any) -> np.dtype:
    """``dtype`` in the machine's byte order: numpy holds either, jax only native."""
    dtype = np.dtype(dtype)
    return dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype


def _native(value: Any) -> Any:
    """``value`` with the same values in the machine's byte order (a copy if it was not)."""
    if isinstance(value, np.ndarray) and value.dtype.byteorder not in "=|":
        return value.astype(_native_dtype(value.dtype))
    return value


def split_given(plan: Plan, existing: Mapping[str, Any] | None, what: str) -> tuple[dict, Plan]:
    """:func:`given_arrays`, and the plan of what is left to make; every problem in
    ``existing`` is one PlanError, with the plan's abstract meshes, raised before
    anything is made (as the spec path's ``materialize`` raises them)."""
    given, problems = given_arrays(plan, existing)
    if problems:
        problems += abstract_problems(plan)
        raise PlanError(problems, header=f"{what}: existing= does not fit the plan:")
    todo = subplan(plan, [e for e in plan.entries if id(e) not in given]) if given else plan
    return given, todo


def subplan(plan: Plan, keep: Sequence[PlanEntry]) -> Plan:
    """The plan restricted to ``keep``, groups in the same order (empty ones dropped)."""
    ids = {id(e) for e in keep}
    groups = []
    for g in plan.groups:
        entries = tuple(e for e in g.entries if id(e) in ids)
        if entries:
            groups.append(MeshGroup(g.mesh, entries))
    return Plan(tuple(keep), tuple(groups), plan.treedef, plan.leaves)


def memory_stats(device: Any) -> dict[str, int] | None:
    """``device.memory_stats()``, or None where the backend reports nothing (CPU)."""
    try:
        return device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


def memory_problems(entries: Sequence[PlanEntry]) -> list[Problem]:
    """Problems if ``entries`` do not fit in the free memory they are planned into.

    Device memory: each addressable device's parameters in its ``"device"`` memory
    against what the device reports free (GPU and TPU do; CPU does not). Host memory:
    the parameters of every addressable device in a host memory kind
    (``pinned_host``, ``unpinned_host``) against the host's available memory.
    Parameter bytes only: each call's temporaries come on top (a few shards' worth;
    bound them with ``max_bytes_per_call``).
    """
    by_mesh: dict[Any, list[PlanEntry]] = {}
    for e in entries:
        by_mesh.setdefault(e.mesh, []).append(e)
    on_device: dict[Any, list[PlanEntry]] = {}
    local = jax.process_index()
    for mesh, es in by_mesh.items():
        for d in mesh.devices.flat:
            if d.process_index == local:
                on_device.setdefault(d, []).extend(es)
    worst = None
    for d, es in on_device.items():
        stats = memory_stats(d)
        if not stats or "bytes_limit" not in stats:
            continue
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        need = sum(e.device_bytes for e in es if _in_device_memory(e, d))
        if need > free and (worst is None or need - free > worst[0]):
            worst = (need - free, d, need, free, es)
    offloaded = any(e.spec.memory_kind not in (None, "device") for e in entries)
    problems = _host_memory_problems(on_device) if offloaded else []
    if worst is None:
        return problems
    _, d, need, free, es = worst
    on_it = [e for e in es if _in_device_memory(e, d)]
    largest = sorted(on_it, key=lambda e: e.device_bytes, reverse=True)[:5]
    return [
        Problem(
            "",
            f"device {d} needs {human_bytes(need)} for its parameters but has "
            f"{human_bytes(free)} free; shard the largest parameters over more devices, "
            f"use a bigger mesh, offload some (memory_kind='pinned_host'), or free memory "
            f"first. Largest on it:",
        ),
        *(Problem(e.path, f"{human_bytes(e.device_bytes)} on this device") for e in largest),
        *problems,
    ]


def _in_device_memory(entry: PlanEntry, device: Any) -> bool:
    """Whether ``entry`` lives in ``device``'s own memory: its default memory kind (named
    ``"device"`` on CPU, GPU and TPU today)."""
    return entry.memory_kind == "device" or entry.memory_kind == _default_kind(device)


@_caches.memo(maxsize=1024)
def _default_kind(device: Any) -> str:
    try:
        return device.default_memory().kind
    except Exception:  # a backend without memory spaces: all of it is device memory
        return "device"


def host_available() -> int | None:
    """Bytes of physical memory the host has available now, where the OS says."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _host_memory_problems(on_device: Mapping[Any, list[PlanEntry]]) -> list[Problem]:
    hosted = [(d, e) for d, es in on_device.items() for e in es if not _in_device_memory(e, d)]
    if not hosted:
        return []
    free = host_available()
    need = sum(e.device_bytes for _, e in hosted)
    if free is None or need <= free:
        return []
    per_path: dict[str, int] = {}
    for _, e in hosted:
        per_path[e.path] = per_path.get(e.path, 0) + e.device_bytes
    largest = sorted(per_path.items(), key=lambda kv: kv[1], reverse=True)[:5]
    return [
        Problem(
            "",
            f"this host needs {human_bytes(need)} of host memory for the parameters "
            f"offloaded to it (memory kinds other than 'device') but has "
            f"{human_bytes(free)} available; keep some in device memory, shard them over "
            f"more hosts, or free memory first. Largest:",
        ),
        *(Problem(p, f"{human_bytes(b)} on this host") for p, b in largest),
    ]


def abstract_problems(plan: Plan) -> list[Problem]:
    return [
        Problem(
            g.entries[0].path,
            f"mesh {g.mesh} is abstract ({len(g.entries)} params); materialize "
            f"needs a concrete jax.sharding.Mesh. Plan on abstract meshes for "
            f"sizes, or use plan.abstract() as a restore target",
        )
        for g in plan.groups
        if g.is_abstract
    ]


def stale_problems(plan: Plan) -> list[Problem]:
    """Groups whose mesh holds devices of a backend that was cleared since it was made.

    Arrays would land on the discarded backend and fail later, far from here, with
    "incompatible devices"; the live backend's devices are other objects.
    """
    live: dict[str, set[Any]] = {}
    problems = []
    for g in plan.groups:
        if g.is_abstract:
            continue
        device = g.mesh.devices.flat[0]
        platform = device.platform
        if platform not in live:
            try:
                live[platform] = set(jax.devices(platform))
            except RuntimeError:  # the platform itself is gone
                live[platform] = set()
        if device not in live[platform]:
            problems.append(
                Problem(
                    g.entries[0].path,
                    f"mesh {describe_mesh(g.mesh)} ({len(g.entries)} params) holds devices "
                    f"of a {platform} backend that has been cleared since "
                    f"(jax.extend.backend.clear_backends()); build the mesh again from "
                    f"jax.devices() and plan again",
                )
            )
    return problems


def bound_problems(entries: Sequence[PlanEntry], bound: int | None) -> list[Problem]:
    if bound is None:
        return []
    return [
        Problem(
            e.path,
            f"makes {human_bytes(e.device_bytes)} per device in one call, more than "
            f"max_bytes_per_call={bound}; raise the bound or shard it over more devices",
        )
        for e in entries
        if e.device_bytes > bound
    ]
