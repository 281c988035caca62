"""Progress bar and log lines for materialization.

Whether a call shows a bar is decided once, before it compiles anything, from what the
plan says it will do (:class:`Work`); no timer or thread ever changes what a call does.
The bar (tqdm, imported only when a bar is shown) writes to ``sys.stderr`` and never
touches a device. Log records go to the ``"meshinit"`` logger, which has only a
``NullHandler``: configuring logging is the application's business.

Auto rule (``progress=None``): a bar is shown when ``sys.stderr`` is a terminal and the
call will compile at least :data:`MIN_COMPILES` executables, or make at least
:data:`MIN_CALLS` compiled calls, or generate at least :data:`MIN_BYTES` of parameters.
Measured on CPU, each of these takes about two seconds or more; below all three a call
usually ends before a bar would tell anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from .. import _patterns
from .._errors import FallbackWarning
from .._format import human_bytes, some

logger = logging.getLogger("meshinit")
logger.addHandler(logging.NullHandler())

MIN_COMPILES = 2  # an XLA compile takes ~0.3-1 s
MIN_CALLS = 1000  # a warm call takes ~1-2 ms
MIN_BYTES = 1 << 30  # generating 1 GiB takes seconds on CPU


@dataclasses.dataclass(frozen=True)
class Work:
    """What one materialization will do, known before it compiles anything.

    Attributes:
      params: planned parameters, generated or placed.
      placed: parameters placed from ``existing`` instead of generated.
      groups: mesh groups with something to generate.
      executables: executables the groups need, cached or not.
      to_compile: those not in the cache: each costs an XLA compile.
      calls: calls of compiled executables.
      nbytes: bytes of the parameters to generate (unsharded).
    """

    params: int
    placed: int
    groups: int
    executables: int
    to_compile: int
    calls: int
    nbytes: int


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def show_bar(progress: bool | None, work: Work) -> bool:
    """The decision: ``progress`` if given, else the auto rule in the module docstring."""
    if progress is not None:
        return progress
    if not _stderr_is_terminal():
        return False
    return work.to_compile >= MIN_COMPILES or work.calls >= MIN_CALLS or work.nbytes >= MIN_BYTES


def check_progress(progress: Any) -> None:
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None (auto), got {progress!r}")


def group_label(index: int, name: str) -> str:
    return f"mesh group {index}, {name}"


_current: contextvars.ContextVar[Tracker | None] = contextvars.ContextVar(
    "meshinit_tracker", default=None
)


class Tracker:
    """Counts, times and (if asked) draws one materialization.

    Entered around compiling and generating; compilations anywhere below report to
    it through :func:`compiling` and :func:`cache_hit`, so strategies need no extra
    argument. Leaving it, even on failure, closes any bar.
    """

    def __init__(self, what: str, work: Work, bar: bool, start: float, log: bool = True):
        self.what = what
        self.log = log  # False: no log line at all (a caller that reports nothing)
        self.work = work
        self.start = start
        self.compiled = 0
        self.cached = 0
        self._keys: set[Hashable] = set()  # each executable counts once per call
        self.label = ""
        self._bar_wanted = bar
        self._bar: Any = None
        self._token: contextvars.Token | None = None

    def __enter__(self) -> Tracker:
        self._token = _current.set(self)
        return self

    def __exit__(self, error: Any, *exc: Any) -> None:
        if error is not None:
            self._draw(lambda bar: bar.set_postfix_str(f"failed: {self.label}", refresh=False))
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        self._close()

    # ------------------------------------------------------------------ steps

    def group(self, index: int, name: str) -> None:
        """Compiling or generating mesh group ``index`` from now on."""
        self.label = group_label(index, name)
        self._draw(lambda bar: bar.set_postfix_str(self.label))

    def compile_started(self) -> None:
        if self._bar_wanted and self._bar is None:
            self._open("compiling", max(self.work.to_compile, 1), "exe")

    def compile_done(self, seconds: float, key: Hashable | None, label: str | None = None) -> None:
        if key is not None:
            self._keys.add(key)
        self.compiled += 1
        if self.log:
            logger.debug("compiled an executable for %s in %.2f s", label or self.label, seconds)
        self._draw(self._advance)

    def cache_hit(self, key: Hashable) -> None:
        if key in self._keys:  # compiled (or reused) earlier in this call
            return
        self._keys.add(key)
        self.cached += 1
        if self.log:
            logger.debug("reused a cached executable for %s", self.label)

    def generating(self) -> None:
        self._close()
        self.label = ""
        if self._bar_wanted:
            self._open("generating", self.work.params - self.work.placed, "param")

    def made(self) -> None:
        self._draw(self._advance)

    def waiting(self) -> None:
        self._draw(lambda bar: bar.set_postfix_str("waiting for the arrays", refresh=True))

    def finished(self) -> None:
        """Ends the bar and logs one INFO line for the whole call."""
        self._draw(lambda bar: bar.set_postfix_str("ready", refresh=False))
        self._close()
        if self.log and logger.isEnabledFor(logging.INFO):
            w = self.work
            seconds = time.perf_counter() - self.start
            placed = f" ({w.placed} from existing)" if w.placed else ""
            logger.info(
                "%s: %d params%s, %d mesh groups, %d executables (%d compiled, %d cached), "
                "%d calls, %s, %.2f s",
                self.what,
                w.params,
                placed,
                w.groups,
                self.compiled + self.cached,
                self.compiled,
                self.cached,
                w.calls,
                human_bytes(w.nbytes),
                seconds,
                extra={
                    "meshinit": {
                        **dataclasses.asdict(w),
                        "compiled": self.compiled,
                        "cached": self.cached,
                        "seconds": seconds,
                    }
                },
            )

    # ------------------------------------------------------------------ the bar

    def _open(self, step: str, total: int, unit: str) -> None:
        def make(_: Any) -> Any:
            from tqdm import tqdm  # only here: no import when no bar is shown

            return tqdm(
                total=total, desc=f"meshinit: {step}", unit=unit, file=sys.stderr, leave=True
            )

        self._bar = self._guard(make, None)
        self._draw(lambda bar: bar.set_postfix_str(self.label))

    @staticmethod
    def _advance(bar: Any) -> None:
        if bar.total is not None and bar.n >= bar.total:  # more than planned: keep it honest
            bar.total = bar.n + 1
        bar.update()

    def _draw(self, step: Any) -> None:
        if self._bar is not None:
            self._guard(step, self._bar)

    def _close(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            self._guard(lambda b: b.close(), bar)

    def _guard(self, step: Any, bar: Any) -> Any:
        # A bar is decoration: if drawing fails (a closed or broken stderr), drop the
        # bar and carry on. Only Exception: an interrupt still propagates.
        try:
            return step(bar)
        except Exception as e:
            logger.debug("progress bar disabled: %s: %s", type(e).__name__, e)
            self._bar_wanted = False
            self._bar = None
            return None


@contextlib.contextmanager
def compiling(key: Hashable | None = None) -> Iterator[None]:
    """Around one XLA compile: counted, timed and drawn by the current tracker, if any.

    ``key``: the executable's cache key (None: never cached).
    """
    tracker = _current.get()
    if tracker is None:
        yield
        return
    tracker.compile_started()
    start = time.perf_counter()
    yield
    tracker.compile_done(time.perf_counter() - start, key)


def compile_started() -> None:
    """Compiles are about to start elsewhere (threads); told to the current tracker."""
    tracker = _current.get()
    if tracker is not None:
        tracker.compile_started()


def compile_done(seconds: float, key: Hashable | None, label: str) -> None:
    """A compile that ran elsewhere (a thread) finished; ``label`` names its mesh group."""
    tracker = _current.get()
    if tracker is not None:
        tracker.compile_done(seconds, key, label)


def cache_hit(key: Hashable) -> None:
    """An executable came from the cache; told to the current tracker, if any."""
    tracker = _current.get()
    if tracker is not None:
        tracker.cache_hit(key)


def fell_back(what: str, fallen: Sequence[tuple[str, Any]]) -> None:
    """Warns, once per cause, about the variables the constructor engine makes with
    the whole-constructor program (``(path, _trace.Fallback)`` each); every path goes
    to the DEBUG log.

    Each warning says how many variables, the first paths, why the engine could not
    cut them, what it costs and what would avoid it (:class:`meshinit.FallbackWarning`).
    """
    causes: dict[tuple[str, str], list[str]] = {}
    for path, why in fallen:
        causes.setdefault((why.reason, why.fix), []).append(path)
    for (reason, fix), paths in causes.items():
        n = len(paths)
        warnings.warn(
            f"{what}: {n} variable{'s' if n != 1 else ''} ({some(paths)}) cannot be cut "
            f"out of the constructor: {reason}. They are compiled as one program per mesh "
            f"holding the whole constructor, so compile time grows with the model's depth. "
            f"To avoid it: {fix}.",
            FallbackWarning,
            stacklevel=_patterns.outside_stacklevel(),  # the caller of the adapter's init
        )
        logger.debug(
            "meshinit: %s makes with the whole-constructor program, because %s: %s",
            what,
            reason,
            ", ".join(paths),
        )


SLOW_SECONDS = 1.0
"""A load of fewer than :data:`MIN_BYTES` shows its bar (auto rule) once it has run this
long: a slow disk or a network filesystem makes a small load long too."""


@contextlib.contextmanager
def byte_bar(
    what: str, total: int | Callable[[], int], progress: bool | None
) -> Iterator[Callable[[int], None]]:
    """A bar of bytes and bytes per second (a load reading or fetching ``total`` bytes,
    or a function giving them, asked only where a bar may show): shown as ``progress``
    says, or by the auto rule: where stderr is a terminal, at once for at least
    :data:`MIN_BYTES`, else once the load has run :data:`SLOW_SECONDS` (tqdm's
    ``delay``: a load that ends sooner draws nothing). Yields ``update(nbytes)``, which
    any thread may call."""
    check_progress(progress)
    if progress is False or (progress is None and not _stderr_is_terminal()):
        yield lambda n: None
        return
    size = total() if callable(total) else total
    from tqdm import tqdm

    bar = tqdm(
        total=size,
        desc=f"meshinit: {what}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        leave=True,
        delay=SLOW_SECONDS if progress is None and size < MIN_BYTES else 0,
    )
    lock = threading.Lock()

    def update(nbytes: int) -> None:
        with lock:
            if bar.total is not None and bar.n + nbytes > bar.total:  # an estimate: stay honest
                bar.total = bar.n + nbytes
            bar.update(nbytes)

    try:
        yield update
    finally:
        bar.close()
