"""How a mesh group's parameters are compiled and called: the strategies.

Work is deduplicated by signature (initializer fingerprint, shape, dtype,
PartitionSpec). The default strategy, :class:`Rounds`, compiles one executable per
bucket of signatures with equally many parameters, so compile time does not grow with
depth. Per-parameter keys are derived on the host (``_threefry.fold_digests``,
bit-identical to ``param_key``) and passed in as key data, so a new key, or another
model with the same signatures, reuses the cached executables: zero compilations.

A strategy (:class:`Strategy`) has ``builds(group, impl)`` (the executables it will
call, as cache keys and builders), ``work(group, impl)`` (each executable with how many
calls it gets) and ``prepare(group, impl)`` (a runner that makes the group's arrays).
Which one a call uses is data: :func:`meshinit.options`, read by :func:`chosen`.
:class:`Specs` is the spec path's group maker (:mod:`meshinit._run.maker`): a strategy
with one call's key.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .._format import some
from .._jax import explicit as _explicit
from .._jax import jaxpr as _jaxpr
from .._jax import threefry as _threefry
from .._jax import tiles as _tiles
from .._plan.plan import MeshGroup
from . import options as _options
from .compile import Build, auto_twin, compiled, on_cpu
from .maker import Needs, Runner

KeyImpl = Any  # what jax.random.wrap_key_data takes as impl: a name or a PRNGSpec

_KEY = jax.ShapeDtypeStruct((2,), np.uint32)


def program_key_impl(group: MeshGroup, impl: str) -> KeyImpl:
    """The key implementation that ``group``'s programs wrap their key data with.

    On CPU, :data:`meshinit._jax.threefry.PROGRAM_KEY_IMPL`: jax's threefry2x32 bits,
    in a program built as ``jax.jit`` of the initializer builds it (its bits), with a
    faster hash. Other
    platforms already get a straight-line hash from jax and keep its implementation.
    """
    # materialize refuses abstract groups before it picks key implementations
    if impl == _threefry.SHARDING_INVARIANT_IMPL and on_cpu(cast(Mesh, group.mesh)):
        return _threefry.PROGRAM_KEY_IMPL
    return impl


def tiles(mesh: Mesh) -> _tiles.Tiles:
    """How large arrays are tiled on ``mesh`` (:func:`meshinit._jax.tiles.tile_bytes_for`):
    :func:`meshinit.options`' ``tile_bytes``, else the platform's sizes."""
    chosen = _options.current().tile_bytes
    return mesh.devices.flat[0].platform if chosen is None else chosen


def tiled_alone(entry: Any) -> bool:
    """Whether ``entry`` is large enough to be made in tiles on its platform, and so gets
    a program of its own: tiled programs compile in parallel, each in about a second on
    a TPU, where one program holding several would add up their compile times."""
    if jax.dtypes.issubdtype(entry.spec.dtype, jax.dtypes.extended):
        return False  # keys are never made in tiles
    mesh = cast(Mesh, entry.mesh)  # materialize refuses abstract meshes first
    size = _tiles.tile_bytes_for(tiles(mesh), np.dtype(entry.spec.dtype).itemsize)
    return size is not None and entry.device_bytes > size


def _make(
    spec: Any, key_data: Any, impl: KeyImpl, sharding: NamedSharding, explicit: bool = False
) -> Any:
    """The spec's value from its own key's data (traced): a large one made in tiles
    (:mod:`meshinit._jax.tiles`) where its initializer allows, with the same bits; with
    ``explicit``, with the sharding constraints jit lowers under an Explicit context
    mesh (:mod:`meshinit._jax.explicit`)."""

    def made(data: Any) -> Any:
        return spec.init(jax.random.wrap_key_data(data, impl=impl), spec.shape, spec.dtype)

    mesh = cast(Mesh, sharding.mesh)
    how = tiles(mesh)
    if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.extended):
        return made(key_data)  # keys are never made in tiles
    size = _tiles.tile_bytes_for(how, np.dtype(spec.dtype).itemsize)
    large = bool(size) and math.prod(spec.shape) * np.dtype(spec.dtype).itemsize > size
    if not (large or explicit):
        return made(key_data)
    prog = _jaxpr.flatten(jax.make_jaxpr(made)(_KEY))
    twin = NamedSharding(auto_twin(mesh), sharding.spec, memory_kind=sharding.memory_kind)
    env = {**prog.consts, prog.inputs[0]: key_data}
    bind: _explicit.Bind = _jaxpr.bind_node
    if explicit:
        bind = _explicit.explicit_bind(bind, auto_twin(mesh), tuple(spec.shape), sharding.spec)
    if large:
        tiled = _tiles.tiling(prog, range(len(prog.nodes)), prog.outputs[0], twin, how)
        if tiled is not None:
            apart = impl is _threefry.PROGRAM_KEY_IMPL  # the hash's words, as made whole
            straight = apart or impl is _threefry.STRAIGHT_LINE
            return _tiles.evaluate(
                prog, tiled, env, bind, straight=straight, barrier=apart, explicit=explicit
            )
        if not explicit:
            return made(key_data)
    _jaxpr.run_nodes(prog, range(len(prog.nodes)), env, bind)
    (out,) = prog.outputs
    return out.value if isinstance(out, _jaxpr.Lit) else env[out]


KeyRunner = Callable[[np.ndarray], Iterator[tuple[int, jax.Array]]]  # key data -> arrays


@typing.runtime_checkable
class Strategy(Protocol):
    """How one mesh group's parameters are compiled and called.

    Strategies differ in compile and dispatch costs only; values and shardings are the
    same. Neither ``builds`` nor ``work`` compiles anything.
    """

    def builds(self, group: MeshGroup, impl: KeyImpl) -> list[tuple[Hashable, Build]]:
        """A ``(cache key, build)`` per executable ``prepare`` will call: materialize
        compiles the uncached ones of every group in parallel (``precompile``) first."""
        ...

    def work(self, group: MeshGroup, impl: KeyImpl) -> Needs:
        """A ``(cache key, calls)`` per executable: decides the progress bar and the
        log line."""
        ...

    def prepare(self, group: MeshGroup, impl: KeyImpl) -> KeyRunner:
        """Compiles (or fetches) what the group needs; the runner maps host inputs (the
        key data) to ``(position in group.entries, array)`` pairs."""
        ...


class Specs:
    """The spec path's group maker (:class:`meshinit._run.maker.GroupMaker`):
    ``strategy``'s programs, called with one call's key data.

    Each group's programs wrap the key data with :meth:`key_impl`.
    """

    def __init__(self, strategy: Strategy, key_data: np.ndarray, impl: str):
        self.strategy, self.key_data, self.impl = strategy, key_data, impl

    def key_impl(self, group: MeshGroup) -> KeyImpl:
        """:func:`program_key_impl` of the call's key implementation."""
        return program_key_impl(group, self.impl)

    def builds(self, group: MeshGroup) -> list[tuple[Hashable, Build]]:
        return self.strategy.builds(group, self.key_impl(group))

    def work(self, group: MeshGroup) -> Needs:
        return self.strategy.work(group, self.key_impl(group))

    def prepare(self, group: MeshGroup) -> Runner:
        run = self.strategy.prepare(group, self.key_impl(group))
        return lambda: run(self.key_data)


def call(exe: Any, args: Sequence[Any], group: MeshGroup, positions: Sequence[int]) -> Any:
    """``exe(*args)``; an error (an out-of-memory, say) gets a note naming what the call
    makes: the entries of ``group`` at ``positions``."""
    try:
        return exe(*args)
    except Exception as e:
        e.add_note(f"meshinit: in the call that makes {_paths_of(group, positions)}")
        raise


def _paths_of(group: MeshGroup, positions: Sequence[int], n: int = 8) -> str:
    return some([group.entries[p].path for p in positions], n)


def _executables_of(group: MeshGroup, builds: Sequence[tuple[Hashable, Build]]) -> list[Any]:
    return [compiled(key, group, build) for key, build in builds]


class _Cached:
    """Executables from ``self.builds(group, impl)``, each compiled once and cached."""

    def executables(self: Strategy, group: MeshGroup, impl: KeyImpl) -> list[Any]:
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
        signature = group.entries[batch[0]].signature
        return ("per_signature", group.mesh, signature, impl, _explicit.context_is_explicit())

    def _build(self, group: MeshGroup, batch: tuple[int, ...], impl: KeyImpl) -> Build:
        entry = group.entries[batch[0]]
        explicit = _explicit.context_is_explicit()  # the caller's, not the compile's

        def build():
            spec = entry.spec

            def program(key_data):
                return _make(spec, key_data, impl, entry.sharding, explicit)

            return program, entry.sharding, (_KEY,)

        return build

    def prepare(self, group: MeshGroup, impl: KeyImpl) -> KeyRunner:
        exes = self.executables(group, impl)

        def run(key_data: np.ndarray) -> Iterator[tuple[int, jax.Array]]:
            keys = iter(_threefry.fold_digests(key_data, group.digests))
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
        explicit = _explicit.context_is_explicit()  # the caller's, not the compile's

        def build():
            def program(keys):
                return [
                    _make(e.spec, keys[k], impl, e.sharding, explicit)
                    for k, e in enumerate(entries)
                ]

            keys = jax.ShapeDtypeStruct((len(entries), 2), np.uint32)
            return program, [e.sharding for e in entries], (keys,)

        return build

    def _key(self, group: MeshGroup, bucket: tuple[int, ...], impl: KeyImpl) -> Hashable:
        signatures = tuple(group.entries[group.batches[i][0]].signature for i in bucket)
        return ("rounds", group.mesh, signatures, impl, _explicit.context_is_explicit())

    def builds(self, group: MeshGroup, impl: KeyImpl) -> list[tuple[Hashable, Build]]:
        return self._builds(group, self._buckets(group), impl)

    def _builds(
        self, group: MeshGroup, buckets: list[tuple[int, ...]], impl: KeyImpl
    ) -> list[tuple[Hashable, Build]]:
        return [(self._key(group, b, impl), self._build(group, b, impl)) for b in buckets]

    def work(self, group: MeshGroup, impl: KeyImpl) -> Needs:
        # a bucket's executable is called once per parameter of each of its signatures
        return [(self._key(group, b, impl), len(group.batches[b[0]])) for b in self._buckets(group)]

    def prepare(self, group: MeshGroup, impl: KeyImpl) -> KeyRunner:
        buckets = self._buckets(group)
        exes = _executables_of(group, self._builds(group, buckets, impl))
        starts = np.cumsum([0, *(len(b) for b in group.batches)])
        # rows[r, k]: the row in group.digests of the r-th parameter of the k-th signature
        rows = [
            np.stack([np.arange(starts[i], starts[i + 1]) for i in bucket], axis=1)
            for bucket in buckets
        ]

        def run(key_data: np.ndarray) -> Iterator[tuple[int, jax.Array]]:
            keys = _threefry.fold_digests(key_data, group.digests)
            for bucket, exe, index in zip(buckets, exes, rows, strict=True):
                for r in range(index.shape[0]):
                    made = [group.batches[i][r] for i in bucket]
                    yield from zip(made, call(exe, (keys[index[r]],), group, made), strict=True)

        return run


def bucket_batches(group: MeshGroup, max_bytes_per_call: int | None) -> list[tuple[int, ...]]:
    """Indices into ``group.batches``, bucketed by batch size.

    Buckets whose calls make the most bytes run first: any temporaries they need
    then come while little else is allocated, which keeps the peak near the
    device's share of the parameters (temporaries as docs/concepts.md, "Memory",
    describes them). With a
    ``max_bytes_per_call``, a bucket whose call would make more bytes per device
    is split (largest signatures first) into buckets that stay under it. A signature
    made in tiles (:func:`tiled_alone`) is a bucket of its own.
    """
    by_count: dict[int, list[int]] = {}
    alone: list[list[int]] = []
    for i, batch in enumerate(group.batches):
        if tiled_alone(group.entries[batch[0]]):
            alone.append([i])
        else:
            by_count.setdefault(len(batch), []).append(i)

    def nbytes(i: int) -> int:
        return group.entries[group.batches[i][0]].device_bytes

    buckets = [*by_count.values(), *alone]
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


STRATEGIES: Mapping[str, Strategy] = types.MappingProxyType(
    {"rounds": Rounds(), "per_signature": PerSignature()}
)
assert tuple(STRATEGIES) == _options.STRATEGY_NAMES


def chosen() -> Strategy:
    """The strategy of this call (:func:`meshinit.options`): rounds unless it says."""
    strategy = _options.current().strategy
    return STRATEGIES[strategy] if isinstance(strategy, str) else strategy
