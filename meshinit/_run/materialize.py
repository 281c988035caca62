"""Materialization: compiled per mesh group, with exact out_shardings.

``materialize``, ``init`` and the run loop they share with the constructor engine
(:func:`run_plan`): check everything (:mod:`meshinit._run.checks`), compile what is not
cached (:mod:`meshinit._run.compile`), call each group's strategy
(:mod:`meshinit._run.strategies`), and delete everything made if anything fails; under
``jax.distributed`` every process agrees on the outcome (:mod:`meshinit._run.agree`).

No computation ever mixes meshes, so jit never resolves outputs across meshes. Every
output carries its planned sharding as an out_sharding, and tracing happens under an
all-Auto twin of the mesh, so XLA partitions the random generation itself and each
device computes only its own shard; no full copy exists anywhere.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import NamedSharding

from .. import _caches, _paths
from .._caches import LRUCache
from .._errors import PlanError
from .._format import describe_mesh, some
from .._plan.plan import MeshGroup, Plan
from .._plan.planner import plan
from . import agree as _agree
from . import progress as _progress
from . import strategies as _strategies
from .checks import (
    abstract_problems,
    bound_problems,
    given_arrays,
    memory_problems,
    stale_problems,
    subplan,
)
from .compile import Build, is_cached, lock, precompile, some_paths
from .strategies import Needs, Rounds, Runner, program_key_impl


def materialize(
    plan: Plan,
    key: Any,
    existing: Mapping[str, Any] | None = None,
    *,
    max_bytes_per_call: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Allocates every planned parameter with exactly its planned sharding.

    Every computation's out_shardings are the planned ``NamedSharding``s, so each
    device generates only its own shards, and no computation mixes meshes. Works with or
    without an active ``jax.set_mesh``, on any mesh, including disjoint submeshes, and
    unchanged under ``jax.distributed``: every process runs the same call and makes only
    its addressable shards (an array on a mesh of other processes' devices has none).

    Args:
      plan: from :func:`meshinit.plan`.
      key: an int seed, a typed key or a legacy uint32 key; all three give the same
        values. The parameter at ``path`` is ``init(param_key(key, path), shape, dtype)``.
      existing: maps dot-joined paths to arrays (``jax.Array`` or numpy) that are used
        instead of generating those parameters, for example restored from a
        checkpoint; each is placed on its planned sharding. Only the rest are
        generated, with the values a full init gives them. Arrays passed here are never
        deleted, not even on failure. A big-endian numpy array is placed with its
        values, in native byte order.
      max_bytes_per_call: at most this many bytes of parameters made per device by one
        compiled call (default: no bound beyond the strategy's own). Smaller bounds
        mean more, smaller executables.
      progress: ``True`` always shows a progress bar (tqdm, on stderr) through the
        compile and generate steps, ``False`` never does. ``None`` (default) decides
        once, before compiling, from the plan: a bar is shown when stderr is a
        terminal and the call will compile at least 2 executables, make at least 1000
        compiled calls, or generate at least 1 GiB of parameters. Either way, one INFO
        record on the ``"meshinit"`` logger sums the call up (params, groups,
        executables compiled and cached, calls, bytes, seconds); DEBUG adds each
        compile's time.

    Returns:
      The planned tree with a ready ``jax.Array`` in place of each spec.

    Raises:
      PlanError: (a ``ValueError``) before anything is allocated, with every problem:
        a mesh is an ``AbstractMesh``; an ``existing`` path is not planned, or its
        value is no array (PRNG keys, a restore target's ``ShapeDtypeStruct``) or has
        the wrong shape or dtype; a parameter alone exceeds
        ``max_bytes_per_call``; the parameters do not fit in the free memory of a
        device that reports it (``device.memory_stats()``), naming the largest
        parameters on the worst device.
      ValueError: the key's values would depend on the sharding (a non-threefry key,
        or ``jax_threefry_partitionable`` off).

    Atomic: if anything fails part-way (a runtime error, an out-of-memory, a
    ``KeyboardInterrupt``), every array made so far is deleted, the error gets a note
    naming the mesh group and its paths, and it propagates; nothing partial is returned.

    Examples:
      >>> params = meshinit.materialize(meshinit.plan(specs), jax.random.key(0))
      >>> params = meshinit.materialize(plan, 0, existing={"head": restored_head})
    """
    with _agree.collective("materialize"):  # failures before allocating agree too
        return _materialize(plan, key, existing, max_bytes_per_call, progress)


def _materialize(
    plan: Plan,
    key: Any,
    existing: Mapping[str, Any] | None,
    max_bytes_per_call: int | None,
    progress: bool | None,
) -> Any:
    if not isinstance(plan, Plan):
        raise TypeError(
            f"materialize takes a Plan from meshinit.plan(tree), got "
            f"{type(plan).__name__}; or call meshinit.init(tree, key)"
        )
    key_data, impl = _paths.host_key(key)
    if max_bytes_per_call is None:
        strategy = _strategies.chosen()  # meshinit.options, read per call
    else:
        if isinstance(max_bytes_per_call, bool) or not isinstance(max_bytes_per_call, int):
            raise TypeError(f"max_bytes_per_call must be an int, got {max_bytes_per_call!r}")
        if max_bytes_per_call <= 0:
            raise ValueError(f"max_bytes_per_call must be positive, got {max_bytes_per_call}")
        strategy = Rounds(max_bytes_per_call)  # bounded calls always use rounds
    _progress.check_progress(progress)
    given, problems = given_arrays(plan, existing)
    if problems:  # all at once, with the abstract-mesh and bound problems
        todo = [e for e in plan.entries if id(e) not in given]
        problems += abstract_problems(plan) + bound_problems(todo, max_bytes_per_call)
        raise PlanError(problems, header="cannot materialize this plan:")
    return run_plan(
        plan,
        lambda group: strategy.prepare(group, program_key_impl(group, impl)),
        key_data,
        given=given,
        max_bytes_per_call=max_bytes_per_call,
        work=lambda group: strategy.work(group, program_key_impl(group, impl)),
        builds=lambda group: strategy.builds(group, program_key_impl(group, impl)),
        progress=progress,
    )


@contextlib.contextmanager
def deleting_on_failure(
    made: list[jax.Array], note: Callable[[int], str] | None = None
) -> Iterator[None]:
    """If the block raises anything (``KeyboardInterrupt`` too), every array in ``made``
    (as it is then) is deleted and the error, with ``note(len(made))`` added, propagates.

    The one delete-everything-on-failure of meshinit: materialize, the adapters' engine
    and ``meshinit.optax`` use it, so nothing half-made outlives a failed call.
    """
    try:
        yield
    except BaseException as e:
        for array in made:
            array.delete()
        if note is not None:
            e.add_note(note(len(made)))
        raise


def from_constructor(key: Any, shape: Any, dtype: Any) -> Any:
    """The ``init`` of specs whose values come from a module's constructor.

    ``meshinit.nnx.init``, ``meshinit.linen.init`` and ``meshinit.eqx.init`` plan such
    specs and fill them with the constructor engine (:mod:`meshinit._engine.run`); the
    initializer itself is never meant to be called.
    """
    raise TypeError(
        "this spec's value comes from its module's constructor, not from an initializer, "
        "so it cannot be materialized on its own; for nnx use meshinit.nnx.init(factory), "
        "for equinox call meshinit.eqx.init(factory, key, placements)"
    )


def run_plan(plan: Plan, prepare: Callable[[MeshGroup], Runner], *args: Any, **kwargs: Any) -> Any:
    """:func:`_run_here`, agreed between processes (:mod:`meshinit._run.agree`).

    Under ``jax.distributed`` it returns only when every process succeeded; when any
    failed, every process raises (its own error, or ``PeerFailure`` naming the failed
    process) with every array it made deleted. Alone, it is :func:`_run_here`. Inside
    a caller's :func:`meshinit._run.agree.collective` call (an adapter's init), that call
    agrees instead, once, when it ends.
    """
    with _agree.collective(kwargs.get("what", "materialize")):  # or the caller's call
        tree, made = _run_here(plan, prepare, *args, **kwargs)
        _agree.keep(made)  # deleted if the call fails after all, here or elsewhere
    return tree


def _run_here(
    plan: Plan,
    prepare: Callable[[MeshGroup], Runner],
    *args: Any,
    given: Mapping[int, Any] | None = None,
    max_bytes_per_call: int | None = None,
    work: Callable[[MeshGroup], Needs] | None = None,
    builds: Callable[[MeshGroup], Sequence[tuple[Hashable, Build]]] | None = None,
    cache: LRUCache | None = None,
    progress: bool | None = None,
    what: str = "materialize",
) -> Any:
    """Checks, compiles, then allocates; deletes everything it made if anything fails.

    ``given`` maps ``id(entry)`` to the caller's array for that entry: it is placed,
    not generated, and never deleted here. ``work`` says what ``prepare`` will compile
    and call (default: one uncached executable, called once, per group); with
    ``progress`` it decides the progress bar (see :func:`materialize`). ``builds``, if
    given, lists each group's cached executables, which are compiled in parallel first,
    into ``cache`` (default: the process-wide cache of executables).
    """
    start = time.perf_counter()
    given = given or {}
    todo = subplan(plan, [e for e in plan.entries if id(e) not in given]) if given else plan
    problems = (
        abstract_problems(plan)
        + stale_problems(plan)
        + bound_problems(todo.entries, max_bytes_per_call)
    )
    if problems:
        raise PlanError(problems, header="cannot materialize this plan:")
    moved = [
        e
        for e in plan.entries
        if id(e) in given
        and not (isinstance(given[id(e)], jax.Array) and given[id(e)].sharding == e.sharding)
    ]
    problems = memory_problems([*todo.entries, *moved])
    if problems:
        raise PlanError(
            problems, header="the parameters do not fit in the memory planned for them:"
        )
    summary = _work(plan, todo, work)
    # The bar is decided here, once; it draws on stderr only, and closes on any exit.
    with _progress.Tracker(what, summary, _progress.show_bar(progress, summary), start) as t:
        # Compile everything before allocating anything, so a compile error leaves nothing.
        if builds is not None:
            jobs = [(i, g, *job) for i, g in enumerate(todo.groups) for job in builds(g)]
            precompile(jobs, cache)
        runners = []
        for i, g in enumerate(todo.groups):
            t.group(i, describe_mesh(g.mesh))
            runners.append(prepare(g))
        t.generating()
        callers = {id(a) for a in given.values()}
        made: list[jax.Array] = []
        values: dict[int, jax.Array] = {}
        where = ""

        def failed(n: int) -> str:
            return (
                f"meshinit: {what} failed while {where}; deleted the {n} arrays "
                f"it had made, and returned nothing"
            )

        with deleting_on_failure(made, failed):
            for entry in plan.entries:
                if id(entry) in given:
                    where = f"placing existing[{entry.path!r}] on {describe_mesh(entry.mesh)}"
                    array = place(given[id(entry)], entry.sharding)
                    if id(array) not in callers:
                        made.append(array)
                    values[id(entry)] = array
            for i, (group, run) in enumerate(zip(todo.groups, runners, strict=True)):
                where = f"mesh group {i}, {describe_mesh(group.mesh)}, making {some_paths(group)}"
                t.group(i, describe_mesh(group.mesh))
                for pos, array in run(*args):
                    made.append(array)
                    values[id(group.entries[pos])] = array
                    t.made()
            where = "waiting for the arrays"
            t.waiting()
            try:
                jax.block_until_ready(made)
            except Exception:
                where = f"waiting for the arrays: {_failed(plan, values, made)} failed"
                raise
        t.finished()
    return plan.fill([values[id(e)] for e in plan.entries]), made


def _work(plan: Plan, todo: Plan, work: Callable[[MeshGroup], Needs] | None) -> _progress.Work:
    """What ``run_plan`` will compile, call and make, before it does any of it."""
    keys: set[Hashable] = set()
    executables = to_compile = calls = 0
    for g in todo.groups:
        for key, n in work(g) if work is not None else [(None, 1)]:
            executables += 1
            calls += n
            if key is None:
                to_compile += 1
            elif key not in keys:
                keys.add(key)
                to_compile += not is_cached(key)
    return _progress.Work(
        params=len(plan.entries),
        placed=len(plan.entries) - len(todo.entries),
        groups=len(todo.groups),
        executables=executables,
        to_compile=to_compile,
        calls=calls,
        nbytes=sum(e.spec.nbytes for e in todo.entries),
    )


def _failed(plan: Plan, values: Mapping[int, jax.Array], made: Sequence[jax.Array]) -> str:
    """The paths whose arrays fail when waited for: the failed call's parameters
    (an array of a call that failed at run time, an out-of-memory, raises its error)."""
    path_of = {id(values[id(e)]): e.path for e in plan.entries if id(e) in values}
    failed = []
    for array in made:
        try:
            array.block_until_ready()
        except Exception:
            failed.append(path_of.get(id(array), "?"))
    return f"the arrays of {some(failed, 8)}" if failed else "an array"


def place(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` with exactly ``sharding``; the same object if it already has it.

    An array on the same devices is resharded by jax on the devices; one on other
    devices whose target blocks are all blocks it holds is copied block to block. Any
    other (another mesh's layout: jax would gather the whole array on the host) is
    built block by block from the source's shards, so no full copy exists anywhere.
    """
    if isinstance(value, jax.Array):
        if value.sharding == sharding:
            return value
        if value.sharding.device_set == sharding.device_set or _blocks_held(value, sharding):
            return jax.device_put(value, sharding)
        return _blockwise(value, sharding)
    # A host value: each process fills only its addressable shards, so this also works
    # for meshes that span processes, where device_put of a numpy array fails.
    host = np.asarray(value)
    # dtype given: on a mesh with no device here there is no shard to infer it from.
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index], dtype=host.dtype
    )


def init(tree: Any, key: Any, *, progress: bool | None = None) -> Any:
    """``materialize(plan(tree), key)``: plans and allocates in one call.

    Args:
      tree: a tree whose leaves may be ``ParamSpec``s.
      key: an int seed, a typed key or a legacy uint32 key.
      progress: ``True`` or ``False`` forces the progress bar on or off; ``None``
        (default) decides as :func:`materialize` describes.

    Returns:
      The tree with a ready ``jax.Array`` in place of each spec, as
      :func:`materialize` returns it.

    Raises:
      PlanError: what :func:`meshinit.plan` or :func:`materialize` finds.

    Examples:
      >>> m = jax.make_mesh((2, 4), ("a", "b"))
      >>> params = meshinit.init({"w": meshinit.param((8, 8), init, mesh=m)}, 0)
    """
    with _agree.collective("meshinit.init"):  # a plan failing on one process agrees too
        return materialize(plan(tree), key, progress=progress)


def clear_cache() -> None:
    """Empties every cache meshinit keeps (each is otherwise kept, bounded).

    Compiled executables (the spec path's, the constructor engine's, the optimizer
    state's), initializer fingerprints and abstract init checks, rule resolutions and
    partitions, and host programs. The next call computes again; values do not change.

    Examples:
      >>> meshinit.clear_cache()  # e.g. to measure a cold materialize again
    """
    with lock:
        _caches.clear_all()


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))


def _blocks_held(value: jax.Array, sharding: NamedSharding) -> bool:
    held = {_key(s.index, value.shape) for s in value.addressable_shards}
    # a NamedSharding gives every addressable device an index; jax's annotation allows None
    wanted = cast(
        "Iterable[tuple[slice, ...]]",
        sharding.addressable_devices_indices_map(value.shape).values(),
    )
    return all(_key(i, value.shape) in held for i in wanted)


def _blockwise(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``value`` on ``sharding``, each target block assembled from the overlapping
    blocks of ``value``'s addressable shards (one copy of each, on the host)."""
    shape = value.shape
    sources: dict[Any, Any] = {}
    for s in value.addressable_shards:  # one shard per block: replicas add nothing
        sources.setdefault(_key(s.index, shape), s)

    def block(index: Any) -> np.ndarray:
        want = _key(index, shape)
        out = np.empty([b - a for a, b in want], value.dtype)
        filled = 0
        for have, s in sources.items():
            lo = [max(a, c) for (a, _), (c, _) in zip(want, have, strict=True)]
            hi = [min(b, d) for (_, b), (_, d) in zip(want, have, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            src = tuple(slice(low - c, h - c) for low, h, (c, _) in zip(lo, hi, have, strict=True))
            dst = tuple(slice(low - a, h - a) for low, h, (a, _) in zip(lo, hi, want, strict=True))
            out[dst] = np.asarray(s.data)[src]  # on the host: no dispatch under a context mesh
            filled += int(np.prod([h - low for low, h in zip(lo, hi, strict=True)]))
        if filled != out.size:
            raise ValueError(
                f"cannot place an array of sharding {value.sharding} on {sharding}: this "
                f"process does not hold every block its devices need (a multi-process "
                f"array on other devices); place it on the planned sharding first"
            )
        return out

    return jax.make_array_from_callback(shape, sharding, block, dtype=value.dtype)
