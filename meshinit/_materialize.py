"""Materialization: compiled per mesh group, with exact out_shardings.

No computation ever mixes meshes, so jit never resolves outputs across meshes. Work
is deduplicated by signature (initializer fingerprint, shape, dtype, PartitionSpec),
and the default strategy (``Rounds``) compiles one executable per bucket of
signatures with equally many parameters, so compile time does not grow with depth.
Per-parameter keys are derived on the host (``_paths.fold_digests``, bit-identical to
``param_key``) and passed in as key data, so a new key, or another model with the same
signatures, reuses the cached executables: zero compilations.

Every output carries its planned sharding as an out_sharding, and tracing happens
under an all-Auto twin of the mesh, so XLA partitions the random generation itself
and each device computes only its own shard; no full copy exists anywhere.
"""

from __future__ import annotations

import difflib
import os
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from . import _agree, _caches, _paths, _progress, _threefry
from ._caches import LRUCache
from ._errors import PlanError, Problem
from ._plan import MeshGroup, Plan, PlanEntry, plan
from ._report import describe_mesh, human_bytes


def _auto_twin(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis Auto.

    Traced under an Explicit mesh, initializers return explicitly replicated values,
    and every device would compute the full parameter before slicing. Under Auto the
    out_shardings propagate back into the random generation.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


_executables = _caches.lru("compiled executables", 512)
_lock = threading.Lock()


KeyImpl = Any  # what jax.random.wrap_key_data takes as impl: a name or a PRNGSpec


def _on_cpu(mesh: Mesh) -> bool:
    return mesh.devices.flat[0].platform == "cpu"


def _compiler_options(mesh: Mesh) -> dict[str, Any] | None:
    if not _on_cpu(mesh):
        return None
    options = {k: v for k, v in CPU_COMPILER_OPTIONS.items() if k not in _unknown_options}
    return options or None


_unknown_options: set[str] = set()  # of CPU_COMPILER_OPTIONS, those this jaxlib lacks
_NO_SUCH_OPTION = re.compile(r"No such compile option: '([^']+)'")


def _compile_lowered(lowered: Any, mesh: Mesh) -> Any:
    """``lowered.compile`` with the mesh's compiler options.

    An option of :data:`CPU_COMPILER_OPTIONS` that this jaxlib does not know (XLA
    renames and retires its debug options) is dropped for the rest of the process,
    with an INFO record, instead of failing every compile: meshinit's options change
    compile and run time, never values (a test compares them with XLA's defaults).
    """
    tried: set[str] = set()
    while True:
        try:
            return lowered.compile(_compiler_options(mesh))
        except Exception as e:
            found = _NO_SUCH_OPTION.search(str(e))
            name = found and found.group(1)
            if name not in CPU_COMPILER_OPTIONS or name in tried:
                raise
            tried.add(name)
            with _lock:  # compiles run in threads: say it once
                new = name not in _unknown_options
                _unknown_options.add(name)
            if new:
                _progress.logger.info(
                    "meshinit: this jaxlib has no XLA option %r; not using it", name
                )


def _lower(
    group: MeshGroup, program: Callable[..., Any], out_shardings: Any, args: Sequence[Any]
) -> Any:
    """Traces and lowers ``program`` for ``group`` with exact ``out_shardings``.

    Tracing happens under an all-Auto twin of the group's mesh: it overrides any
    context mesh the user set, and lets the out_shardings partition the generation.
    """
    with jax.set_mesh(_auto_twin(group.mesh)):
        return jax.jit(program, out_shardings=out_shardings).lower(*args)


def _compile_note(e: BaseException, group: MeshGroup) -> None:
    e.add_note(f"meshinit: while compiling for the mesh {group.mesh} ({_some_paths(group)})")


def _compile(
    group: MeshGroup,
    program: Callable[..., Any],
    out_shardings: Any,
    args: Sequence[Any],
    key: Hashable | None = None,
) -> Any:
    """Lowers (:func:`_lower`) and compiles ``program`` for ``group``, here and now."""
    try:
        with _progress.compiling(key):
            lowered = _lower(group, program, out_shardings, args)
            return _compile_lowered(lowered, group.mesh)
    except Exception as e:
        _compile_note(e, group)
        raise


def _full_key(cache_key: Hashable) -> Hashable:
    """``cache_key`` with the global settings that change the compiled program."""
    return (
        cache_key,
        jax.config.jax_threefry_partitionable,
        tuple(sorted(CPU_COMPILER_OPTIONS.items())),
    )


def _is_cached(cache_key: Hashable) -> bool:
    with _lock:
        return _full_key(cache_key) in _executables


Build = Callable[[], tuple[Callable[..., Any], Any, Sequence[Any]]]  # program, outs, args


def _compiled(
    cache_key: Hashable, group: MeshGroup, build: Build, cache: LRUCache | None = None
) -> Any:
    """``_compile(group, *build())``, cached on ``cache_key`` in ``cache`` (default: the
    process-wide cache of executables)."""
    cache = _executables if cache is None else cache
    cache_key = _full_key(cache_key)
    with _lock:
        hit = cache.get(cache_key)
    if hit is not None:
        _progress.cache_hit(cache_key)
        return hit
    compiled = _compile(group, *build(), key=cache_key)
    with _lock:
        cache.put(cache_key, compiled)
    return compiled


def _compile_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _precompile(
    jobs: Sequence[tuple[int, MeshGroup, Hashable, Build]], cache: LRUCache | None = None
) -> None:
    """Compiles, in parallel, the executables of ``jobs`` that ``cache`` (default: the
    process-wide cache of executables) does not hold yet, into ``cache``.

    XLA compiles in threads, at most one per core: each program is traced and lowered
    here (that needs the mesh context, and holds the GIL), and its compile starts at
    once, while the next one is lowered. Measured on the 2-core CPU reference (3
    executables, 6 alternating fresh processes each): cold init median 2.82 s against
    3.10 s compiling one after the other, and 2.89 s with 3 threads. Each finished
    compile is cached and reported to the progress tracker from this thread.

    On any error, compiles not yet started are cancelled and running ones are waited
    for, so nothing compiles after this returns; the first error propagates, with its
    mesh group named. With fewer than two executables to compile this does nothing:
    :func:`_compiled` compiles a lone one where it is needed.
    """
    cache = _executables if cache is None else cache
    pending: dict[Hashable, tuple[int, MeshGroup, Build]] = {}
    for index, group, key, build in jobs:
        full = _full_key(key)
        with _lock:
            cached = full in cache
        if not cached and full not in pending:
            pending[full] = (index, group, build)
    if len(pending) < 2:
        return

    def compile_one(lowered: Any, mesh: Mesh) -> tuple[Any, float]:
        start = time.perf_counter()
        return _compile_lowered(lowered, mesh), time.perf_counter() - start

    _progress.compile_started()
    workers = min(len(pending), _compile_threads())
    with ThreadPoolExecutor(workers, thread_name_prefix="meshinit-compile") as pool:
        futures: list[tuple[Future, Hashable, int, MeshGroup]] = []
        try:
            for full, (index, group, build) in pending.items():
                try:
                    lowered = _lower(group, *build())
                except Exception as e:
                    _compile_note(e, group)
                    raise
                future = pool.submit(compile_one, lowered, group.mesh)
                futures.append((future, full, index, group))
            for future, full, index, group in futures:  # reported in order
                try:
                    compiled, seconds = future.result()
                except Exception as e:
                    _compile_note(e, group)
                    raise
                with _lock:
                    cache.put(full, compiled)
                label = _progress.group_label(index, describe_mesh(group.mesh))
                _progress.compile_done(seconds, full, label)
        except BaseException:
            for future, *_ in futures:
                future.cancel()
            raise


# On CPU, XLA's backend optimization level 1 instead of the default (compile time -30%,
# run time up to +50%: a trade that pays for cold init), and XLA's classic elemental
# emitters instead of its MLIR fusion emitters (same values, about 25% less compile
# time at the same run time). Measured on the reference model; see
# benchmarks/README.md. Other platforms keep their defaults.
CPU_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_backend_optimization_level": 1,
    "xla_cpu_use_fusion_emitters": False,
}

_KEY = jax.ShapeDtypeStruct((2,), np.uint32)


def _key_impl(group: MeshGroup, impl: str) -> KeyImpl:
    """The key implementation that ``group``'s programs wrap their key data with.

    On CPU, jax's threefry2x32 with its hash emitted straight-line
    (:data:`_threefry.STRAIGHT_LINE`): the same bits, and XLA fuses the hash into the
    initializer. On the 32-layer reference (3 alternating pairs of fresh processes)
    cold init took 1.36-1.61 s against 1.59-1.94 s, and a warm re-init 0.21 s against
    0.38-0.42 s (benchmarks/README.md). Other platforms already get a straight-line
    hash from jax and keep its implementation.
    """
    if impl == _paths.SHARDING_INVARIANT_IMPL and _on_cpu(group.mesh):
        return _threefry.STRAIGHT_LINE
    return impl


def _make(spec: Any, key_data: Any, impl: KeyImpl) -> Any:
    """The spec's value from its own key's data (traced)."""
    return spec.init(jax.random.wrap_key_data(key_data, impl=impl), spec.shape, spec.dtype)


# A strategy turns a mesh group into a runner: ``prepare(group, impl)`` compiles (or
# fetches) what the group needs, and the runner it returns maps host inputs (the key
# data) to ``(position in group.entries, array)`` pairs. Strategies differ in compile and
# dispatch costs only; values and shardings are the same. ``work(group, impl)`` says,
# without compiling, what ``prepare`` will need: a ``(cache key, calls)`` per executable,
# which decides the progress bar and feeds the log line. ``builds(group, impl)`` gives,
# also without compiling, a ``(cache key, build)`` per executable: materialize compiles
# the uncached ones of every group in parallel (``_precompile``) before ``prepare``.
Runner = Callable[..., Iterator[tuple[int, jax.Array]]]
Needs = Sequence[tuple[Hashable | None, int]]  # None: compiled every time, never cached


def call(exe: Any, args: Sequence[Any], group: MeshGroup, positions: Sequence[int]) -> Any:
    """``exe(*args)``; an error (an out-of-memory, say) gets a note naming what the call
    makes: the entries of ``group`` at ``positions``."""
    try:
        return exe(*args)
    except Exception as e:
        e.add_note(f"meshinit: in the call that makes {_paths_of(group, positions)}")
        raise


def _paths_of(group: MeshGroup, positions: Sequence[int], n: int = 8) -> str:
    paths = [group.entries[p].path for p in positions]
    more = f" and {len(paths) - n} more" if len(paths) > n else ""
    return ", ".join(paths[:n]) + more


def _executables_of(group: MeshGroup, builds: Sequence[tuple[Hashable, Build]]) -> list[Any]:
    return [_compiled(key, group, build) for key, build in builds]


class _Cached:
    """Executables from ``self.builds(group, impl)``, each compiled once and cached."""

    def executables(self, group: MeshGroup, impl: KeyImpl) -> list[Any]:
        return _executables_of(group, self.builds(group, impl))


class PerSignature(_Cached):
    """One small executable per distinct signature, called once per parameter.

    Compile cost is one small program per (mesh, signature), whatever the depth and
    however many groups share it; dispatch costs one call per parameter.
    """

    def builds(self, group: MeshGroup, impl: KeyImpl) -> list[tuple[Hashable, Build]]:
        return [(self._key(group, b, impl), self._build(group, b, impl)) for b in group.batches]

    def work(self, group: MeshGroup, impl: KeyImpl) -> Needs:
        return [(self._key(group, batch, impl), len(batch)) for batch in group.batches]

    def _key(self, group: MeshGroup, batch: tuple[int, ...], impl: KeyImpl) -> Hashable:
        return ("per_signature", group.mesh, group.entries[batch[0]].signature, impl)

    def _build(self, group: MeshGroup, batch: tuple[int, ...], impl: KeyImpl) -> Build:
        entry = group.entries[batch[0]]

        def build():
            spec = entry.spec

            def program(key_data):
                return _make(spec, key_data, impl)

            return program, entry.sharding, (_KEY,)

        return build

    def prepare(self, group: MeshGroup, impl: KeyImpl) -> Runner:
        exes = self.executables(group, impl)

        def run(key_data: np.ndarray) -> Iterator[tuple[int, jax.Array]]:
            keys = iter(_paths.fold_digests(key_data, group.digests))
            for batch, exe in zip(group.batches, exes, strict=True):
                for pos in batch:
                    yield pos, call(exe, (next(keys),), group, (pos,))

        return run


class Rounds(_Cached):
    """Signatures with the same number of parameters share one executable.

    Call ``r`` of a bucket's executable makes the ``r``-th parameter of each of its
    signatures, so a 32-layer stack of 7 per-layer signatures compiles one program
    and dispatches 32 calls. The program grows with the number of signatures in a
    bucket, never with depth.
    """

    def __init__(self, max_bytes_per_call: int | None = None):
        self.max_bytes_per_call = max_bytes_per_call

    def _buckets(self, group: MeshGroup) -> list[tuple[int, ...]]:
        return bucket_batches(group, self.max_bytes_per_call)

    def _build(self, group: MeshGroup, bucket: tuple[int, ...], impl: KeyImpl) -> Build:
        entries = [group.entries[group.batches[i][0]] for i in bucket]

        def build():
            def program(keys):
                return [_make(e.spec, keys[k], impl) for k, e in enumerate(entries)]

            keys = jax.ShapeDtypeStruct((len(entries), 2), np.uint32)
            return program, [e.sharding for e in entries], (keys,)

        return build

    def _key(self, group: MeshGroup, bucket: tuple[int, ...], impl: KeyImpl) -> Hashable:
        signatures = tuple(group.entries[group.batches[i][0]].signature for i in bucket)
        return ("rounds", group.mesh, signatures, impl)

    def builds(self, group: MeshGroup, impl: KeyImpl) -> list[tuple[Hashable, Build]]:
        return self._builds(group, self._buckets(group), impl)

    def _builds(
        self, group: MeshGroup, buckets: list[tuple[int, ...]], impl: KeyImpl
    ) -> list[tuple[Hashable, Build]]:
        return [(self._key(group, b, impl), self._build(group, b, impl)) for b in buckets]

    def work(self, group: MeshGroup, impl: KeyImpl) -> Needs:
        # a bucket's executable is called once per parameter of each of its signatures
        return [(self._key(group, b, impl), len(group.batches[b[0]])) for b in self._buckets(group)]

    def prepare(self, group: MeshGroup, impl: KeyImpl) -> Runner:
        buckets = self._buckets(group)
        exes = _executables_of(group, self._builds(group, buckets, impl))
        starts = np.cumsum([0, *(len(b) for b in group.batches)])
        # rows[r, k]: the row in group.digests of the r-th parameter of the k-th signature
        rows = [
            np.stack([np.arange(starts[i], starts[i + 1]) for i in bucket], axis=1)
            for bucket in buckets
        ]

        def run(key_data: np.ndarray) -> Iterator[tuple[int, jax.Array]]:
            keys = _paths.fold_digests(key_data, group.digests)
            for bucket, exe, index in zip(buckets, exes, rows, strict=True):
                for r in range(index.shape[0]):
                    made = [group.batches[i][r] for i in bucket]
                    yield from zip(made, call(exe, (keys[index[r]],), group, made), strict=True)

        return run


def bucket_batches(group: MeshGroup, max_bytes_per_call: int | None) -> list[tuple[int, ...]]:
    """Indices into ``group.batches``, bucketed by batch size.

    Buckets whose calls make the most bytes run first: any temporaries they need
    then come while little else is allocated, which keeps the peak near the
    device's share of the parameters. (With jax's rolled CPU hash they needed
    about 2x their output on the reference model; with the straight-line hash of
    :func:`_key_impl`, none.) With a
    ``max_bytes_per_call``, a bucket whose call would make more bytes per device
    is split (largest signatures first) into buckets that stay under it.
    """
    by_count: dict[int, list[int]] = {}
    for i, batch in enumerate(group.batches):
        by_count.setdefault(len(batch), []).append(i)

    def nbytes(i: int) -> int:
        return group.entries[group.batches[i][0]].device_bytes

    buckets = list(by_count.values())
    if max_bytes_per_call is not None:
        buckets = [b for bucket in buckets for b in _pack(bucket, nbytes, max_bytes_per_call)]
    return [tuple(b) for b in sorted(buckets, key=lambda b: sum(map(nbytes, b)), reverse=True)]


def _pack(items: list[int], size: Callable[[int], int], limit: int) -> list[list[int]]:
    """First-fit decreasing: ``items`` in bins whose sizes sum to at most ``limit``.

    An item larger than ``limit`` gets a bin of its own; materialize refuses such
    plans before it gets here.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for item in sorted(items, key=size, reverse=True):
        for k, free in enumerate(room):
            if size(item) <= free:
                bins[k].append(item)
                room[k] -= size(item)
                break
        else:
            bins.append([item])
            room.append(limit - size(item))
    return bins


class FusedGroup(_Cached):
    """One executable per mesh group, one ``vmap`` per signature inside it.

    One dispatch per group, but XLA's compile time grows with the number of outputs
    (measured on CPU), so this suits shallow groups.

    Known problem, not investigated: on 8 simulated CPU devices, a group with three
    ``orthogonal`` parameters (one batched QR per device) hung in XLA's execution in
    about half of the processes that had compiled other orthogonal programs first,
    with jax's own threefry keys too. The other strategies did not (0 of 6).
    """

    def program(self, group: MeshGroup, impl: KeyImpl) -> Callable[..., list[jax.Array]]:
        """(key data per parameter, in batch order) -> one array per entry, in entry order."""

        def program(keys):
            outs: list[Any] = [None] * len(group.entries)
            start = 0
            for batch in group.batches:
                spec = group.entries[batch[0]].spec

                def one(key_data, spec=spec):
                    return _make(spec, key_data, impl)

                stacked = jax.vmap(one)(keys[start : start + len(batch)])
                start += len(batch)
                for i, pos in enumerate(batch):
                    outs[pos] = stacked[i]
            return outs

        return program

    def _key(self, group: MeshGroup, impl: KeyImpl) -> Hashable:
        structure = tuple((group.entries[b[0]].signature, b) for b in group.batches)
        return ("fused_group", group.mesh, structure, impl)

    def work(self, group: MeshGroup, impl: KeyImpl) -> Needs:
        return [(self._key(group, impl), 1)]

    def builds(self, group: MeshGroup, impl: KeyImpl) -> list[tuple[Hashable, Build]]:
        def build():
            keys = jax.ShapeDtypeStruct(group.digests.shape, np.uint32)
            shardings = [e.sharding for e in group.entries]
            return self.program(group, impl), shardings, (keys,)

        return [(self._key(group, impl), build)]

    def prepare(self, group: MeshGroup, impl: KeyImpl) -> Runner:
        (exe,) = self.executables(group, impl)

        def run(key_data: np.ndarray) -> Iterator[tuple[int, jax.Array]]:
            keys = _paths.fold_digests(key_data, group.digests)
            everything = range(len(group.entries))
            yield from enumerate(call(exe, (keys,), group, everything))  # in entry order

        return run


STRATEGIES = {"per_signature": PerSignature(), "rounds": Rounds(), "fused_group": FusedGroup()}
DEFAULT_STRATEGY = "rounds"


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
        deleted, not even on failure.
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
        a mesh is an ``AbstractMesh``; an ``existing`` path is not planned or its
        array has the wrong shape or dtype; a parameter alone exceeds
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
    if not isinstance(plan, Plan):
        raise TypeError(
            f"materialize takes a Plan from meshinit.plan(tree), got "
            f"{type(plan).__name__}; or call meshinit.init(tree, key)"
        )
    key_data, impl = _paths.host_key(key)
    if max_bytes_per_call is None:
        strategy = STRATEGIES[DEFAULT_STRATEGY]
    else:
        if isinstance(max_bytes_per_call, bool) or not isinstance(max_bytes_per_call, int):
            raise TypeError(f"max_bytes_per_call must be an int, got {max_bytes_per_call!r}")
        if max_bytes_per_call <= 0:
            raise ValueError(f"max_bytes_per_call must be positive, got {max_bytes_per_call}")
        strategy = Rounds(max_bytes_per_call)  # bounded calls always use rounds
    _progress.check_progress(progress)
    given, problems = _given(plan, existing)
    if problems:  # all at once, with the abstract-mesh and bound problems
        todo = [e for e in plan.entries if id(e) not in given]
        problems += _abstract_problems(plan) + _bound_problems(todo, max_bytes_per_call)
        error = PlanError(problems, header="cannot materialize this plan:")
        _agree.agree("materialize", error)  # a collective call: the others must know
        raise error
    # A strategy without these (tests inject some): one compile per group, in prepare.
    work = getattr(strategy, "work", None)
    builds = getattr(strategy, "builds", None)
    return _run(
        plan,
        lambda group: strategy.prepare(group, _key_impl(group, impl)),
        key_data,
        given=given,
        max_bytes_per_call=max_bytes_per_call,
        work=None if work is None else lambda group: work(group, _key_impl(group, impl)),
        builds=None if builds is None else lambda group: builds(group, _key_impl(group, impl)),
        progress=progress,
    )


def _given(plan: Plan, existing: Mapping[str, Any] | None) -> tuple[dict[int, Any], list]:
    """``existing`` keyed by ``id`` of its plan entry, and every problem found in it."""
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
        if entry is None:
            close = difflib.get_close_matches(str(path), by_path, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(
                Problem(
                    str(path),
                    f"not a planned parameter; existing maps the plan's dot-joined paths "
                    f"(like {plan.entries[0].path!r}) to arrays{hint}"
                    if plan.entries
                    else "not a planned parameter: the plan has none",
                )
            )
            continue
        if not isinstance(value, jax.Array | np.ndarray) or isinstance(value, jax.core.Tracer):
            problems.append(
                Problem(
                    path,
                    f"existing value must be a jax.Array or numpy array, got "
                    f"{type(value).__name__}",
                )
            )
            continue
        if isinstance(value, jax.Array) and value.is_deleted():
            problems.append(
                Problem(
                    path,
                    "existing array was deleted (x.delete(), or donated to a jitted call); "
                    "pass a live array, or leave the path out to generate it",
                )
            )
            continue
        spec = entry.spec
        if tuple(value.shape) != spec.shape:
            problems.append(
                Problem(
                    path, f"existing array has shape {tuple(value.shape)}, planned {spec.shape}"
                )
            )
        if np.dtype(value.dtype) != spec.dtype:
            problems.append(
                Problem(
                    path,
                    f"existing array has dtype {np.dtype(value.dtype).name}, planned "
                    f"{spec.dtype.name}; cast it first (x.astype(jnp.{spec.dtype.name}))",
                )
            )
        given[id(entry)] = value
    return given, problems


def _subplan(plan: Plan, keep: Sequence[PlanEntry]) -> Plan:
    """The plan restricted to ``keep``, groups in the same order (empty ones dropped)."""
    ids = {id(e) for e in keep}
    groups = []
    for g in plan.groups:
        entries = tuple(e for e in g.entries if id(e) in ids)
        if entries:
            groups.append(MeshGroup(g.mesh, entries))
    return Plan(tuple(keep), tuple(groups), plan.treedef, plan.leaves)


def _memory_stats(device: Any) -> dict[str, int] | None:
    """``device.memory_stats()``, or None where the backend reports nothing (CPU)."""
    try:
        return device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


def _memory_problems(entries: Sequence[PlanEntry]) -> list[Problem]:
    """Problems if ``entries`` do not fit in the free memory of an addressable device.

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
        stats = _memory_stats(d)
        if not stats or "bytes_limit" not in stats:
            continue
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        need = sum(e.device_bytes for e in es)
        if need > free and (worst is None or need - free > worst[0]):
            worst = (need - free, d, need, free, es)
    if worst is None:
        return []
    _, d, need, free, es = worst
    largest = sorted(es, key=lambda e: e.device_bytes, reverse=True)[:5]
    return [
        Problem(
            "",
            f"device {d} needs {human_bytes(need)} for its parameters but has "
            f"{human_bytes(free)} free; shard the largest parameters over more devices, "
            f"use a bigger mesh, or free memory first. Largest on it:",
        ),
        *(Problem(e.path, f"{human_bytes(e.device_bytes)} on this device") for e in largest),
    ]


def from_constructor(key: Any, shape: Any, dtype: Any) -> Any:
    """The ``init`` of specs whose values come from a module's constructor.

    ``meshinit.nnx.init``, ``meshinit.linen.init`` and ``meshinit.eqx.init`` plan such
    specs and fill them with the constructor engine (:mod:`meshinit._constructor`); the
    initializer itself is never meant to be called.
    """
    raise TypeError(
        "this spec's value comes from its module's constructor, not from an initializer, "
        "so it cannot be materialized on its own; for nnx use meshinit.nnx.init(factory), "
        "for equinox call meshinit.eqx.init(factory, key, placements)"
    )


def _abstract_problems(plan: Plan) -> list[Problem]:
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


def _stale_problems(plan: Plan) -> list[Problem]:
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


def _bound_problems(entries: Sequence[PlanEntry], bound: int | None) -> list[Problem]:
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


def _run(plan: Plan, prepare: Callable[[MeshGroup], Runner], *args: Any, **kwargs: Any) -> Any:
    """:func:`_run_here`, agreed between processes (:mod:`meshinit._agree`).

    Under ``jax.distributed`` it returns only when every process succeeded; when any
    failed, every process raises (its own error, or ``PeerFailure`` naming the failed
    process) with every array it made deleted. Alone, it is :func:`_run_here`.
    """
    what = kwargs.get("what", "materialize")
    try:
        tree, made = _run_here(plan, prepare, *args, **kwargs)
    except BaseException as e:
        _agree.agree(what, e)
        raise
    try:
        _agree.agree(what, None)
    except _agree.PeerFailure:
        for array in made:
            array.delete()
        raise
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
    todo = _subplan(plan, [e for e in plan.entries if id(e) not in given]) if given else plan
    problems = (
        _abstract_problems(plan)
        + _stale_problems(plan)
        + _bound_problems(todo.entries, max_bytes_per_call)
    )
    if problems:
        raise PlanError(problems, header="cannot materialize this plan:")
    moved = [
        e
        for e in plan.entries
        if id(e) in given
        and not (isinstance(given[id(e)], jax.Array) and given[id(e)].sharding == e.sharding)
    ]
    problems = _memory_problems([*todo.entries, *moved])
    if problems:
        raise PlanError(problems, header="the parameters do not fit in device memory:")
    summary = _work(plan, todo, work)
    # The bar is decided here, once; it draws on stderr only, and closes on any exit.
    with _progress.Tracker(what, summary, _progress.show_bar(progress, summary), start) as t:
        # Compile everything before allocating anything, so a compile error leaves nothing.
        if builds is not None:
            jobs = [(i, g, *job) for i, g in enumerate(todo.groups) for job in builds(g)]
            _precompile(jobs, cache)
        runners = []
        for i, g in enumerate(todo.groups):
            t.group(i, describe_mesh(g.mesh))
            runners.append(prepare(g))
        t.generating()
        callers = {id(a) for a in given.values()}
        made: list[jax.Array] = []
        values: dict[int, jax.Array] = {}
        where = ""
        try:
            for entry in plan.entries:
                if id(entry) in given:
                    where = f"placing existing[{entry.path!r}] on {describe_mesh(entry.mesh)}"
                    array = _place(given[id(entry)], entry.sharding)
                    if id(array) not in callers:
                        made.append(array)
                    values[id(entry)] = array
            for i, (group, run) in enumerate(zip(todo.groups, runners, strict=True)):
                where = f"mesh group {i}, {describe_mesh(group.mesh)}, making {_some_paths(group)}"
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
        except BaseException as e:
            for array in made:
                array.delete()
            e.add_note(
                f"meshinit: materialize failed while {where}; deleted the {len(made)} arrays "
                f"it had made, and returned nothing"
            )
            raise
        t.finished()
    return plan.fill([values[id(e)] for e in plan.entries]), made


def _work(plan: Plan, todo: Plan, work: Callable[[MeshGroup], Needs] | None) -> _progress.Work:
    """What ``_run`` will compile, call and make, before it does any of it."""
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
                to_compile += not _is_cached(key)
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
    shown = ", ".join(failed[:8]) + (f" and {len(failed) - 8} more" if len(failed) > 8 else "")
    return f"the arrays of {shown}" if failed else "an array"


def _some_paths(group: MeshGroup, n: int = 5) -> str:
    paths = ", ".join(e.path for e in group.entries[:n])
    more = len(group.entries) - n
    return paths + (f" and {more} more" if more > 0 else "")


def _place(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` with exactly ``sharding``; the same object if it already has it."""
    if isinstance(value, jax.Array):
        return value if value.sharding == sharding else jax.device_put(value, sharding)
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
      >>> params = meshinit.init({"w": meshinit.param((8, 8), init, mesh=m)}, 0)
    """
    return materialize(plan(tree), key, progress=progress)


def clear_cache() -> None:
    """Empties every cache meshinit keeps (each is otherwise kept, bounded).

    Compiled executables (the spec path's, the constructor engine's, the optimizer
    state's), initializer fingerprints and abstract init checks, rule resolutions and
    partitions, and host programs. The next call computes again; values do not change.

    Examples:
      >>> meshinit.clear_cache()  # e.g. to measure a cold materialize again
    """
    with _lock:
        _caches.clear_all()


# Package-internal names for the constructor engine (meshinit._constructor).
place = _place
auto_twin = _auto_twin
on_cpu = _on_cpu
compiled = _compiled
run_plan = _run
