"""Compiling meshinit's programs: the Auto twin, compiler options, the executable cache.

Every program is traced under an all-Auto twin of its group's mesh
(:func:`auto_twin`; where the caller's context mesh is Explicit, with the sharding
constraints jit lowers there: :mod:`meshinit._jax.explicit`), lowered with exact
out_shardings and compiled with the mesh's compiler options of the call
(:func:`meshinit.options`; by default, on CPU, those of meshinit's
:data:`CPU_COMPILER_OPTIONS` that the installed jaxlib knows). Executables
(the spec path's, the constructor engine's, optax's state steps) are cached in one
process-wide cache (:data:`executables`, in the registry of :mod:`meshinit._caches`,
guarded by :data:`lock`), keyed with the settings that change a program
(:func:`full_key`) and, for a traced function, what it computes (:func:`computation`);
the ones not cached yet compile in parallel threads before anything is allocated
(:func:`precompile`).
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import jax
import jaxlib
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from .. import _caches
from .._caches import LRUCache
from .._format import describe_mesh, some
from .._jax import compat as _compat
from .._jax import jaxpr as _jaxpr
from .._plan.plan import MeshGroup
from . import options as _options
from . import progress as _progress
from .options import CPU_COMPILER_OPTIONS


def auto_twin(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis Auto.

    Traced under an Explicit mesh, initializers return explicitly replicated values,
    and every device would compute the full parameter before slicing. Under Auto the
    out_shardings propagate back into the random generation.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


lock = threading.Lock()  # guards the executable cache: compiles run in threads
executables = _caches.lru("compiled executables", 512, lock)


def on_cpu(mesh: Mesh) -> bool:
    return mesh.devices.flat[0].platform == "cpu"


def compiler_options(mesh: Mesh) -> dict[str, Any] | None:
    """The XLA options this call compiles ``mesh``'s programs with
    (:func:`meshinit._run.options.options`; by default :func:`default_cpu_options` on CPU,
    and XLA's defaults elsewhere)."""
    chosen = _options.current().compiler_options
    if chosen is not None:
        return dict(chosen) or None
    if not on_cpu(mesh):
        return None
    return default_cpu_options() or None


def default_cpu_options() -> dict[str, Any]:
    """meshinit's own CPU options that the installed jaxlib knows: decided per jaxlib
    version (:func:`meshinit._run.options.cpu_options_for`), so a compile never names an
    option this jaxlib has retired, less any that a compile here rejected anyway."""
    known = _options.cpu_options_for(jaxlib.__version__, tuple(CPU_COMPILER_OPTIONS.items()))
    return {k: v for k, v in known if k not in unknown_options}


# jax's persistent compilation cache. Every compile of meshinit's (the spec path, the
# constructor engine and its fallback, optax's steps, and the checkpoint's: a load's
# dequantization and fan-out reshards, an export's) runs in compile_lowered, which
# lowers jax's thresholds for that compile only (compat.persist_every_compile, in the
# compiling thread: the user's own jits keep jax's 1 s). So where the user configured
# the cache (jax_compilation_cache_dir), a restart reads every program back instead of
# compiling it; where not, or with jax_enable_compilation_cache=False, nothing is
# written. jax's key is enough for meshinit's values (read in jax 0.10.2's and
# 0.12.0.1's _src/cache_key.py): it hashes the StableHLO without debug info, which
# holds everything that value_config() names (partitionable threefry and the key
# implementation are the random ops themselves, x64 the dtypes, the matmul precision
# each dot's precision), the constants left in the program, and the out_shardings;
# the serialized compile options, whose env_option_overrides are the options of
# compiler_options() (a change of meshinit.options(compiler_options=) is a miss: a
# test compiles again); jaxlib's version, the platform and its version; the device
# topology's fingerprint, which on CPU covers the host's target triple, CPU name and
# features (checked on 0.12.0.1; XLA also refuses to load a CPU executable that uses a
# feature this host lacks); and XLA_FLAGS, LIBTPU_INIT_ARGS and --xla argv flags, less
# dump and device-count flags, which change no value. What a program reads at run time
# (keys, host values, constants jax passes as arguments) is not part of the program, and
# a program read back reads it afresh.

# Of CPU_COMPILER_OPTIONS, those a compile rejected although meshinit's table of retired
# options (meshinit._run.options.CPU_OPTIONS_RETIRED_IN) did not expect it: a jaxlib newer
# than the tested ones.
unknown_options: set[str] = set()
_NO_SUCH_OPTION = re.compile(r"No such compile option: '([^']+)'")


def compile_lowered(lowered: Any, mesh: Mesh) -> Any:
    """``lowered.compile`` with the mesh's compiler options (:func:`compiler_options`),
    written to jax's persistent compilation cache whatever its compile time (below).

    meshinit passes only the options the installed jaxlib knows
    (:func:`default_cpu_options`), and compiles a program that holds an operation
    XLA's classic CPU emitters round otherwise (:func:`_emitters_round`) with XLA's
    default emitters. Should a jaxlib newer than the tested ones reject
    one of them anyway (XLA renames and retires its debug options), it is dropped for
    the rest of the process, with an INFO record, instead of failing every compile:
    meshinit's options change compile and run time, never values (a test compares them
    with XLA's defaults). An option the caller asked for is never dropped.
    """
    tried: set[str] = set()
    own = _options.current().compiler_options is None
    while True:
        try:
            chosen = compiler_options(mesh)
            if own and chosen and _EMITTERS in chosen and _emitters_round(lowered):
                chosen = {k: v for k, v in chosen.items() if k != _EMITTERS} or None
            with _compat.persist_every_compile():  # in this (compiling) thread only
                return lowered.compile(chosen)
        except Exception as e:
            found = _NO_SUCH_OPTION.search(str(e))
            name = found and found.group(1)
            if not own or name not in CPU_COMPILER_OPTIONS or name in tried:
                raise
            assert name is not None  # None is not in CPU_COMPILER_OPTIONS
            tried.add(name)
            with lock:  # compiles run in threads: say it once
                new = name not in unknown_options
                unknown_options.add(name)
            if new:
                _progress.logger.info(
                    "meshinit: jaxlib %s has no XLA option %r; not using it "
                    "(meshinit._run.options.CPU_OPTIONS_RETIRED_IN does not know this jaxlib)",
                    jaxlib.__version__,
                    name,
                )


_EMITTERS = "xla_cpu_use_fusion_emitters"
# Operations whose code XLA's classic CPU emitters round otherwise than its fusion
# emitters: jaxlib 0.10.2, each elementwise operation compiled both ways on 65,536
# values: tan differed in 21,172 and cbrt in 11,163 (jax.random.cauchy is a tan: 39,661
# of 122,880 elements, 2 ulp), every other one alike (exp, log, log1p, expm1, tanh,
# sin, cos, atan, atan2, erf, erf_inv, lgamma, digamma, pow, sqrt, rsqrt, logistic,
# sinh, cosh, asin, acos, asinh, acosh, atanh, rem, div, round; bf16 tan, exp, log).
_EMITTER_ROUNDED = re.compile(r"\b(?:stablehlo|chlo|mhlo)\.(?:tan|cbrt)\b")


def _emitters_round(lowered: Any) -> bool:
    """Whether ``lowered`` holds an operation whose bits depend on which CPU emitters
    compile it (:data:`_EMITTER_ROUNDED`): it then compiles with XLA's default
    emitters, as ``jax.jit`` does."""
    return _EMITTER_ROUNDED.search(lowered.as_text()) is not None


def lower(mesh: Mesh, program: Callable[..., Any], out_shardings: Any, args: Sequence[Any]) -> Any:
    """Traces and lowers ``program`` for ``mesh`` with exact ``out_shardings``.

    Tracing happens under an all-Auto twin of the mesh: it overrides any context mesh
    the user set, and lets the out_shardings partition the generation.
    """
    with jax.set_mesh(auto_twin(mesh)):
        return jax.jit(program, out_shardings=out_shardings).lower(*args)


def compile_note(e: BaseException, mesh: Mesh | AbstractMesh, making: str) -> None:
    e.add_note(f"meshinit: while compiling for the mesh {mesh} ({making})")


def compile_now(
    mesh: Mesh,
    program: Callable[..., Any],
    out_shardings: Any,
    args: Sequence[Any],
    *,
    making: str,
    key: Hashable | None = None,
) -> Any:
    """Lowers (:func:`lower`) and compiles ``program`` for ``mesh``, here and now; an
    error gets a note naming the mesh and ``making`` (what the program makes)."""
    try:
        with _progress.compiling(key):
            lowered = lower(mesh, program, out_shardings, args)
            return compile_lowered(lowered, mesh)
    except Exception as e:
        compile_note(e, mesh, making)
        raise


def full_key(cache_key: Hashable) -> Hashable:
    """``cache_key`` with the global settings that change the compiled program."""
    return (
        cache_key,
        _compat.value_config(),  # the flags that change the bits a program makes
        _options.current().compiler_options,  # None: meshinit's own, fixed per process
        _options.current().tile_bytes,  # None: the platform's, fixed per process
    )


def is_cached(cache_key: Hashable) -> bool:
    with lock:
        return full_key(cache_key) in executables


def cached(cache_key: Hashable | None) -> Any:
    """What the executable cache holds under ``cache_key`` (:func:`full_key`), or None;
    always None for a key of None (a computation that cannot be told apart)."""
    if cache_key is None:
        return None
    with lock:
        return executables.get(full_key(cache_key))


def store(cache_key: Hashable | None, value: Any) -> None:
    """Keeps ``value`` (executables, and what calls them) in the executable cache under
    ``cache_key`` (:func:`full_key`); a key of None keeps nothing."""
    if cache_key is not None:
        with lock:
            executables.put(full_key(cache_key), value)


def computation(closed: Any, state: Any) -> Hashable | None:
    """What a traced function (optax's ``tx.init``) computes, structurally, as part of
    an executable cache key; None if it cannot be told.

    Per output leaf: the digest of the equations it is made by
    (:func:`meshinit._jax.jaxpr.slice_fingerprint`: primitives, parameters, shapes, dtypes,
    literals, never Python identity), and which inputs and constants (by their bytes)
    they read; with the output's tree structure. Equal descriptions compute the same
    outputs from the same inputs.
    """
    prog = _jaxpr.flatten(closed)
    position = {n: i for i, n in enumerate(prog.inputs)}
    memo: dict[Any, Any] = {}
    leaves: list[tuple[str, tuple[Any, ...]]] = []
    try:
        for out in prog.outputs:
            if isinstance(out, _jaxpr.Lit):
                leaves.append((_jaxpr.slice_fingerprint(prog, [], [], out, memo), ()))
                continue
            nodes, reads = _slice(prog, out)
            digest = _jaxpr.slice_fingerprint(prog, nodes, reads, out, memo)
            operands = tuple(
                ("param", position[n]) if n in position else ("const", _const(prog.consts[n]))
                for n in reads
            )
            leaves.append((digest, operands))
    except (_jaxpr.Unfingerprintable, TypeError, ValueError):
        return None
    return jax.tree_util.tree_structure(state), tuple(leaves)


def _slice(prog: _jaxpr.Program, out: int) -> tuple[list[int], list[int]]:
    """The equations ``out`` is made by, in order, and the values without a producer
    (parameters, constants) that they read."""
    nodes: set[int] = set()
    reads: set[int] = set()
    stack = [out]
    while stack:
        n = stack.pop()
        i = prog.producer.get(n)
        if i is None:
            reads.add(n)
        elif i not in nodes:
            nodes.add(i)
            stack.extend(x for x in prog.nodes[i].ins if not isinstance(x, _jaxpr.Lit))
    return sorted(nodes), sorted(reads)


def _const(value: Any) -> Hashable:
    """A captured constant by its dtype, shape and bytes."""
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.extended):
        raise TypeError("an extended-dtype constant (a key) has no bytes to compare")
    a = np.asarray(value)
    return str(a.dtype), a.shape, hashlib.blake2b(a.tobytes(), digest_size=16).digest()


Build = Callable[[], tuple[Callable[..., Any], Any, Sequence[Any]]]  # program, outs, args


def compiled(
    cache_key: Hashable, group: MeshGroup, build: Build, cache: LRUCache | None = None
) -> Any:
    """``compile_now(group, *build())``, cached on ``cache_key`` in ``cache`` (default: the
    process-wide cache of executables)."""
    cache = executables if cache is None else cache
    cache_key = full_key(cache_key)
    with lock:
        hit = cache.get(cache_key)
    if hit is not None:
        _progress.cache_hit(cache_key)
        return hit
    mesh = cast(Mesh, group.mesh)  # materialize refuses abstract groups before compiling
    compiled = compile_now(mesh, *build(), making=some_paths(group), key=cache_key)
    with lock:
        cache.put(cache_key, compiled)
    return compiled


def compile_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def precompile(
    jobs: Sequence[tuple[int, MeshGroup, Hashable, Build]], cache: LRUCache | None = None
) -> None:
    """Compiles, in parallel, the executables of ``jobs`` that ``cache`` (default: the
    process-wide cache of executables) does not hold yet, into ``cache``.

    XLA compiles in threads, at most one per core: each program is traced and lowered
    here (that needs the mesh context, and holds the GIL), and its compile starts at
    once, while the next one is lowered (faster than compiling one after the other, or
    with more threads than cores: benchmarks/README.md, "Measurements behind the
    code's choices"). Each finished compile is cached and reported to the progress
    tracker from this thread.

    On any error, compiles not yet started are cancelled and running ones are waited
    for, so nothing compiles after this returns; the first error propagates, with its
    mesh group named. With fewer than two executables to compile this does nothing:
    :func:`compiled` compiles a lone one where it is needed.
    """
    cache = executables if cache is None else cache
    pending: dict[Hashable, tuple[int, MeshGroup, Build]] = {}
    for index, group, key, build in jobs:
        full = full_key(key)
        with lock:
            cached = full in cache
        if not cached and full not in pending:
            pending[full] = (index, group, build)
    if len(pending) < 2:
        return

    def compile_one(lowered: Any, mesh: Mesh) -> tuple[Any, float]:
        start = time.perf_counter()
        return compile_lowered(lowered, mesh), time.perf_counter() - start

    _progress.compile_started()
    workers = min(len(pending), compile_threads())
    with ThreadPoolExecutor(workers, thread_name_prefix="meshinit-compile") as pool:
        futures: list[tuple[Future, Hashable, int, MeshGroup]] = []
        try:
            for full, (index, group, build) in pending.items():
                mesh = cast(Mesh, group.mesh)  # materialize refuses abstract groups
                try:
                    lowered = lower(mesh, *build())
                except Exception as e:
                    compile_note(e, mesh, some_paths(group))
                    raise
                # with this call's options (a context variable) in the worker thread
                context = contextvars.copy_context()
                future = pool.submit(context.run, compile_one, lowered, mesh)
                futures.append((future, full, index, group))
            for future, full, index, group in futures:  # reported in order
                try:
                    compiled, seconds = future.result()
                except Exception as e:
                    compile_note(e, group.mesh, some_paths(group))
                    raise
                with lock:
                    cache.put(full, compiled)
                label = _progress.group_label(index, describe_mesh(group.mesh))
                _progress.compile_done(seconds, full, label)
        except BaseException:
            for future, *_ in futures:
                future.cancel()
            raise


def some_paths(group: MeshGroup, n: int = 5) -> str:
    return some([e.path for e in group.entries], n)
