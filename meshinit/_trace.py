"""Tracing an unchanged constructor once, and evaluating its small part on the host.

The first half of the constructor engine (:mod:`meshinit._constructor` is the other):
:func:`trace` turns a framework's constructor, as a function of host values, into a
flat program (:func:`meshinit._jaxpr.flatten`) and evaluates its keys, counters and
small integer values with numpy (:mod:`meshinit._host`). Nothing is compiled or
allocated; the plan previews stop here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from . import _compile, _host, _jaxpr
from ._jaxpr import Lit, Program

SMALL_BYTES = 1 << 14
"""Values of at most this many bytes are evaluated on the host when they can be.

What the host part is for: keys (8 bytes), counters and scalars, which then enter each
variable's program as arguments. A variable the host made itself is recomputed in its
program anyway (``_cut``), so the bound only decides which intermediate values travel
into the launches. Measured (benchmarks/README.md): 512 B against 64 KiB made no
difference on the reference stack beyond the machine's noise.
"""


def _nbytes(aval: Any) -> int:
    dtype = aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return math.prod(aval.shape) * 8  # threefry key data: two uint32
    return math.prod(aval.shape) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Traced:
    """A constructor traced once: its flat program and its host-evaluated part.

    Attributes:
      program: the flat program (:class:`meshinit._jaxpr.Program`).
      host: value number -> its host value (numpy array or ``_host.HostKey``).
      args: the host arguments the constructor was traced with.
      dynamic: the values that depend on those arguments (key data, example inputs).
    """

    program: Program
    host: dict[int, Any]
    args: tuple[Any, ...]
    dynamic: frozenset[int] = frozenset()

    @property
    def out_avals(self) -> list[Any]:
        """The abstract value of each output, in order."""
        prog = self.program
        return [o.aval if isinstance(o, Lit) else prog.avals[o] for o in prog.outputs]


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector is paused while a constructor is traced and placed.

    A trace makes hundreds of thousands of short-lived objects, and each collection
    walks the whole heap, a cost that grows with depth (benchmarks/README.md,
    "Measurements behind the code's choices"). Nothing is freed later than it would be
    after the call; the collector resumes, as it was, when the last concurrent call
    ends (a count, so threads can nest).
    """
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("meshinit_tracing", default=False)
_quiet_installed = False


def _install_quiet_origin_messages() -> None:
    """While meshinit traces a constructor, jax's tracers skip their origin message.

    ``nnx.Rngs`` compares ``getattr(count, "sharding", None)`` on every draw; on a
    tracer that raises an AttributeError whose message jax builds by walking every
    equation traced so far, so tracing a constructor is quadratic in its size (1.1-1.4
    s of a 32-layer trace, guide). One wrapper, installed once, returns an empty
    origin message while :data:`_TRACING` is set in this context and defers to jax's
    own method everywhere else, so no other code or thread sees a difference. Where
    jax has no such method (another version), nothing is installed.
    """
    global _quiet_installed
    if _quiet_installed:
        return
    _quiet_installed = True
    # The tracer class, found through the public API (no private import).
    seen: list[type] = []
    jax.make_jaxpr(lambda x: seen.append(type(x)) or x)(np.float32(0))
    tracer_class = seen[0]
    original = tracer_class.__dict__.get("_origin_msg")
    if original is None:  # another jax: nothing to quieten, nothing installed
        return

    def _origin_msg(self: Any) -> str:
        if _TRACING.get():
            return ""
        return original(self)

    tracer_class._origin_msg = _origin_msg  # type: ignore[attr-defined]


def trace(fn: Callable[..., Sequence[Any]], *args: Any, evaluate: bool = True) -> Traced:
    """Traces ``fn(*args)`` once and evaluates its small part on the host.

    The trace runs under the all-Auto twin of the context mesh, if one is set (so no
    value records an explicit sharding of a mesh the variables may not live on), and
    allocates nothing.

    Args:
      fn: returns a flat sequence of arrays, one per variable.
      *args: host values (numpy arrays), passed abstractly.
      evaluate: evaluate the small part (False for plan previews, which need only
        the shapes).

    Returns:
      The :class:`Traced` constructor.
    """
    structs = [jax.ShapeDtypeStruct(np.shape(a), np.result_type(a)) for a in args]
    context = jax.sharding.get_mesh()
    twin = None if context is None or context.empty else _compile.auto_twin(context)
    _install_quiet_origin_messages()
    token = _TRACING.set(True)
    try:
        with jax.set_mesh(twin):
            closed = jax.make_jaxpr(fn)(*structs)
    finally:
        _TRACING.reset(token)
    prog = _jaxpr.flatten(closed)
    if any(isinstance(c, jax.core.Tracer) for c in prog.consts.values()):
        raise jax.errors.UnexpectedTracerError(
            "the constructor returned values of an earlier trace (it keeps what it built "
            "in outside state); it must build everything anew each call"
        )
    host: dict[int, Any] = {}
    if not evaluate:
        return Traced(prog, host, tuple(args))
    for n, a in zip(prog.inputs, args, strict=True):
        host[n] = np.asarray(a)
    for n, c in prog.consts.items():
        if _nbytes(prog.avals[n]) <= SMALL_BYTES:
            try:
                host[n] = _host.as_host(c, prog.avals[n])
            except _host.NotHost:
                pass
    sizes: dict[int, int] = {}  # per aval object: inlined initializers repeat theirs

    def small(n: int) -> bool:
        aval = prog.avals[n]
        size = sizes.get(id(aval))
        if size is None:
            size = sizes[id(aval)] = _nbytes(aval)
        return size <= SMALL_BYTES

    dynamic = set(prog.inputs)
    with _host.quiet():
        for i, node in enumerate(prog.nodes):
            ins = [x for x in node.ins if type(x) is not Lit]
            if dynamic and not dynamic.isdisjoint(ins):
                dynamic.update([n for n in node.outs if n >= 0])
            if not _host.is_host(node):
                continue
            if not all([n < 0 or small(n) for n in node.outs]):
                continue
            if all([x in host for x in ins]):
                _host.evaluate_one(prog, i, host)
    return Traced(prog, host, tuple(args), frozenset(dynamic))
