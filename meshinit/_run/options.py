"""How meshinit compiles and calls: the strategy, the compiler options and the constructor
engine's host bound, as data.

:func:`options` sets them for a block, in a context variable (as :func:`meshinit.defaults`
does for specs), so nothing is configured by assigning to a module's globals, and
concurrent calls on other threads keep their own. They are read when ``materialize``
(or an adapter's ``init``) is called, in the calling thread; its parallel compiles run
with the same options.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
import types
from collections.abc import Iterator, Mapping
from typing import Any

from .. import _caches

__all__ = ["options"]

STRATEGY_NAMES = ("rounds", "per_signature")  # meshinit._run.strategies.STRATEGIES, in order

# meshinit's own XLA options on CPU, used unless compiler_options= says otherwise:
# XLA's classic elemental emitters instead of its MLIR fusion emitters, where a jaxlib
# still has them (less compile time at the same run time; the same values, checked
# against eager and jax.jit on both stacks). Backend optimization level 1 was one too,
# until it changed float values: with jaxlib 0.12.0.1 on an AMD EPYC, lecun_normal's
# erf_inv rounded otherwise at level 1 (621 of 16,384 elements of a (4096, 4) matrix up
# to 3 ulp off jax.jit's and eager's bits), so every program compiles at XLA's level.
# The measurements are in benchmarks/README.md ("Measurements behind the code's
# choices"). Other platforms keep XLA's defaults.
CPU_COMPILER_OPTIONS: Mapping[str, Any] = types.MappingProxyType(
    {"xla_cpu_use_fusion_emitters": False}
)

# XLA retires its debug options, and a jaxlib that lacks one rejects every compile that
# names it. For each of meshinit's options that a supported jaxlib lacks: the first
# jaxlib release without it. Checked by compiling with each option on jaxlib 0.10.2,
# 0.11.0, 0.11.1, 0.11.2 and 0.12.0.1 (the MLIR fusion emitters are XLA's only CPU
# emitters from 0.11.1 on); tests/_run/test_compile.py checks the installed jaxlib
# both ways, so a jaxlib that retires another one fails the tests, not users' compiles.
CPU_OPTIONS_RETIRED_IN: Mapping[str, tuple[int, ...]] = types.MappingProxyType(
    {"xla_cpu_use_fusion_emitters": (0, 11, 1)}
)


def release(version: str) -> tuple[int, ...]:
    """The release numbers at the start of a version string: ``"0.12.0.1"`` gives
    ``(0, 12, 0, 1)``, ``"0.11.1.dev20260101"`` gives ``(0, 11, 1)``."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    if found is None:
        raise ValueError(f"not a release version: {version!r}")
    return tuple(int(part) for part in found.group(0).split("."))


@_caches.memo(8)
def cpu_options_for(
    jaxlib_version: str, candidates: tuple[tuple[str, Any], ...]
) -> tuple[tuple[str, Any], ...]:
    """Of ``candidates`` (meshinit's CPU options as pairs), the ones jaxlib
    ``jaxlib_version`` knows (:data:`CPU_OPTIONS_RETIRED_IN`), decided once per version.

    Examples:
      >>> dict(cpu_options_for("0.10.2", tuple(CPU_COMPILER_OPTIONS.items())))
      {'xla_cpu_use_fusion_emitters': False}
      >>> dict(cpu_options_for("0.12.0.1", tuple(CPU_COMPILER_OPTIONS.items())))
      {}
    """
    have = release(jaxlib_version)
    return tuple(
        (name, value)
        for name, value in candidates
        if name not in CPU_OPTIONS_RETIRED_IN or have < CPU_OPTIONS_RETIRED_IN[name]
    )


@dataclasses.dataclass(frozen=True)
class Options:
    """What :func:`options` set: a strategy name (or object), the compiler options
    (None: meshinit's choice per platform; a tuple of pairs: exactly these), and the
    constructor engine's host bound in bytes (None: its default,
    ``meshinit._engine.trace.SMALL_BYTES``), and the size of the tiles a large array is
    made in (None: the platform's, ``meshinit._jax.tiles.TILE_BYTES``; 0: none)."""

    strategy: Any = STRATEGY_NAMES[0]
    compiler_options: tuple[tuple[str, Any], ...] | None = None
    host_eval_bytes: int | None = None
    tile_bytes: int | None = None


_OPTIONS: contextvars.ContextVar[Options] = contextvars.ContextVar(
    "meshinit_options",
    default=Options(),  # noqa: B039 (frozen, never mutated)
)


def current() -> Options:
    return _OPTIONS.get()


_STRATEGY_METHODS = ("builds", "work", "prepare")


def _check_strategy(strategy: Any) -> Any:
    if isinstance(strategy, str):
        if strategy not in STRATEGY_NAMES:
            raise ValueError(
                f"strategy must be one of {', '.join(map(repr, STRATEGY_NAMES))}, got {strategy!r}"
            )
        return strategy
    missing = [m for m in _STRATEGY_METHODS if not callable(getattr(strategy, m, None))]
    if missing:
        raise TypeError(
            f"strategy must be a name ({', '.join(map(repr, STRATEGY_NAMES))}) or an object "
            f"with builds, work and prepare (meshinit._run.strategies.Strategy); "
            f"{type(strategy).__name__} has no {', '.join(missing)}"
        )
    return strategy


def _check_compiler_options(given: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(given, Mapping):
        raise TypeError(
            f"compiler_options must be a mapping of XLA option names to values "
            f"(for example {{'xla_backend_optimization_level': 1}}; {{}} for XLA's "
            f"defaults), got {type(given).__name__}"
        )
    bad = [
        f"{k!r}: {v!r}"
        for k, v in given.items()
        if not isinstance(k, str) or not isinstance(v, bool | int | float | str)
    ]
    if bad:
        raise TypeError(
            "compiler_options maps XLA option names (str) to bool, int, float or str "
            f"values; these are not: {', '.join(bad)}"
        )
    return tuple(sorted(given.items()))


def _check_bytes(name: str, given: Any, default: str, zero: str) -> int:
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(
            f"{name} must be a number of bytes (an int, 0 or more; {default} by "
            f"default), got {type(given).__name__} {given!r}"
        )
    if given < 0:
        raise ValueError(f"{name} must be 0 or more (0: {zero}), got {given}")
    return int(given)


@contextlib.contextmanager
def options(
    *,
    strategy: Any = None,
    compiler_options: Mapping[str, Any] | None = None,
    host_eval_bytes: int | None = None,
    tile_bytes: int | None = None,
) -> Iterator[None]:
    """Sets how ``materialize``, the adapters' ``init`` and the checkpoint's programs
    (``meshinit.safetensors.load``'s dequantization and fan-out reshards,
    ``meshinit.safetensors.save``'s) compile, for a block.

    Nestable; an inner block overrides only what it sets. Values, shardings and
    placement never depend on these: only compile time, run time and the number of
    executables do. Executables are cached per options (a host bound gives other
    programs, fingerprinted apart), so blocks may alternate.

    Args:
      strategy: for :func:`meshinit.materialize` and :func:`meshinit.init` (the
        adapters' constructor engine always buckets its programs as rounds do):
        ``"rounds"`` (the default: one executable per bucket of signatures
        with equally many parameters, so compile time does not grow with depth) or
        ``"per_signature"`` (one small executable per signature, called once per
        parameter). An object with ``builds``, ``work`` and ``prepare``
        (``meshinit._run.strategies.Strategy``) is also accepted; that protocol is
        internal and may change. A ``max_bytes_per_call`` always uses rounds.
      compiler_options: XLA options for every compile, on every platform, instead of
        meshinit's choice (on CPU ``xla_cpu_use_fusion_emitters=False``, XLA's
        defaults elsewhere);
        ``{}`` means XLA's defaults everywhere. An option this jaxlib does not know
        is an error when meshinit next compiles inside the block (XLA rejects it
        then; the error names the option), not here; of meshinit's own, only those
        the installed jaxlib knows are passed (``xla_cpu_use_fusion_emitters`` is
        gone from jaxlib 0.11.1 on).
      host_eval_bytes: for the adapters' constructor engine (``meshinit.nnx.init``,
        ``linen.init``, ``eqx.init``): the largest value, in bytes, that it evaluates
        on the host with numpy, where numpy gives jax's bits (keys, RNG counters,
        integer scalars and small arrays; 16 KiB by default). What it evaluates enters
        the compiled programs as arguments; everything else is computed in them. ``0``
        leaves everything to them but the constructor's arguments. Only the programs
        change, and so their compile time: a bound below the size of the key arrays a
        constructor splits puts its key derivations into the programs, which compiled
        much slower (over 15 minutes for ``split(split(k)[1])`` on jaxlib 0.12.0.1).
        The differential fuzzer (``tests/fuzz/test_fuzz_constructor.py``) lowers it to 64
        so that most of its variables go through the compiled programs.
      tile_bytes: the most bytes of one tile when a large parameter is made by a
        loop over tiles (docs/concepts.md, "The value contract"): its values are the
        whole array's, bit for bit, and its program compiles in the same time whatever
        the parameter's size. By default the platform's measured sizes (on TPU 4 MiB,
        or 256 KiB where a tile makes 32-bit values; CPU and GPU make every parameter
        whole: benchmarks/README.md, "Tiles"); ``0`` makes every parameter whole. A
        tile is never less than one element (a size below an element's size: tiles of
        one element each, slow to run but exact).

    Raises:
      TypeError: a strategy, compiler options or bound of the wrong kind.
      ValueError: an unknown strategy name, or a negative bound.

    Examples:
      >>> with meshinit.options(strategy="per_signature", compiler_options={}):
      ...     params = meshinit.materialize(plan, 0)
    """
    outer = _OPTIONS.get()
    token = _OPTIONS.set(
        Options(
            strategy=outer.strategy if strategy is None else _check_strategy(strategy),
            compiler_options=(
                outer.compiler_options
                if compiler_options is None
                else _check_compiler_options(compiler_options)
            ),
            host_eval_bytes=(
                outer.host_eval_bytes
                if host_eval_bytes is None
                else _check_bytes(
                    "host_eval_bytes",
                    host_eval_bytes,
                    "16384",
                    "nothing but the constructor's arguments is evaluated on the host",
                )
            ),
            tile_bytes=(
                outer.tile_bytes
                if tile_bytes is None
                else _check_bytes("tile_bytes", tile_bytes, "per platform", "no tiles")
            ),
        )
    )
    try:
        yield
    finally:
        _OPTIONS.reset(token)
