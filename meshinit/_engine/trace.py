"""Tracing an unchanged constructor once, and evaluating its small part on the host.

The first half of the constructor engine (:mod:`meshinit._engine.run` is the other):
:func:`trace` turns a framework's constructor, as a function of host values, into a
flat program (:func:`meshinit._jax.jaxpr.flatten`) and evaluates its keys, counters and
small integer values with numpy (:mod:`meshinit._engine.host_eval`); :func:`cut` then takes the
slice of one output: the equations between its host inputs and it. Nothing is
compiled or allocated; the plan previews stop before the cut.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .._jax import compat as _compat
from .._jax import explicit as _explicit
from .._jax import jaxpr as _jaxpr
from .._jax.jaxpr import Lit, Program
from .._run import compile as _compile
from .._run import options as _options
from . import host_eval as _host

SMALL_BYTES = 1 << 14
"""Values of at most this many bytes are evaluated on the host when they can be, unless
``meshinit.options(host_eval_bytes=...)`` says otherwise (:func:`host_bound`).

What the host part is for: keys (8 bytes), counters and scalars, which then enter each
variable's program as arguments. A variable the host made itself is recomputed in its
program anyway (``_cut``), so the bound only decides which intermediate values travel
into the launches. Measured (benchmarks/README.md): 512 B against 64 KiB made no
difference on the reference stack beyond the machine's noise.
"""


def host_bound() -> int:
    """The host part's size bound in force: ``meshinit.options(host_eval_bytes=...)``,
    else :data:`SMALL_BYTES`."""
    given = _options.current().host_eval_bytes
    return SMALL_BYTES if given is None else given


def _nbytes(aval: Any) -> int:
    dtype = aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return math.prod(aval.shape) * 8  # threefry key data: two uint32
    return math.prod(aval.shape) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Traced:
    """A constructor traced once: its flat program and its host-evaluated part.

    Attributes:
      program: the flat program (:class:`meshinit._jax.jaxpr.Program`).
      host: value number -> its host value (numpy array or ``_host.HostKey``).
      args: the host arguments the constructor was traced with.
      dynamic: the values that depend on those arguments (key data, example inputs).
      mesh: the mesh it was traced under (the all-Auto twin of the context mesh), or
        None; every aval inside its loops' and branches' bodies records it.
      explicit: whether the context mesh was Explicit: a jit of the constructor there
        lowers sharding constraints that change XLA's float code, and the programs
        lower them too (:mod:`meshinit._jax.explicit`).
    """

    program: Program
    host: dict[int, Any]
    args: tuple[Any, ...]
    dynamic: frozenset[int] = frozenset()
    mesh: Mesh | None = None
    explicit: bool = False

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


_NEEDS_CONCRETE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


class NeedsConcreteValue(TypeError):
    """The constructor needs a concrete value of something it computes (a TypeError,
    as jax's ConcretizationTypeError is)."""


def trace(fn: Callable[..., Sequence[Any]], *args: Any) -> Traced:
    """Traces ``fn(*args)`` once; its small part is evaluated later, by
    :func:`evaluate`, for just the outputs that are made (plan previews need only the
    shapes, ``existing=`` outputs nothing).

    The trace runs under the all-Auto twin of the context mesh, if one is set (so no
    value records an explicit sharding of a mesh the variables may not live on), and
    allocates nothing.

    Args:
      fn: returns a flat sequence of arrays, one per variable.
      *args: host values (numpy arrays), passed abstractly.

    Returns:
      The :class:`Traced` constructor, with nothing evaluated yet.
    """
    # as jax.jit takes numpy arguments: float64 is float32 unless x64 is on
    args = tuple(np.asarray(a, jax.dtypes.canonicalize_dtype(np.result_type(a))) for a in args)
    structs = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args]
    context = jax.sharding.get_mesh()
    twin = None if context is None or context.empty else _compile.auto_twin(context)
    try:
        with _compat.quiet_origin_messages(), jax.set_mesh(twin):
            closed = jax.make_jaxpr(fn)(*structs)
    except _NEEDS_CONCRETE as e:
        first = str(e).strip().splitlines()
        raise NeedsConcreteValue(
            "meshinit traces the constructor once, abstractly, so the values it computes "
            "are not known while it runs; it asked for one "
            f"({type(e).__name__}: {first[0] if first else ''}). Python control flow or "
            "conversions on computed arrays (float(w.std()), int(x), if x > 0:, "
            "np.asarray(x)) cannot be traced: compute them from shapes and Python "
            "numbers, or with jax operations (w / w.std(), jnp.where, jax.lax.cond)"
        ) from e
    prog = _jaxpr.flatten(closed)
    if any(isinstance(c, jax.core.Tracer) for c in prog.consts.values()):
        raise jax.errors.UnexpectedTracerError(
            "the constructor returned values of an earlier trace (it keeps what it built "
            "in outside state); it must build everything anew each call"
        )
    return Traced(prog, {}, tuple(args), mesh=twin, explicit=_explicit.is_explicit(context))


def evaluate_host_part(traced: Traced, outputs: Sequence[int | Lit]) -> Traced:
    """``traced`` with the small part that ``outputs`` depend on evaluated on the host.

    Only the equations some output reads, directly or through others, are looked at:
    with ``existing=`` of all but a head, the host evaluates the head's keys and the
    RNG counters before it, not every layer's. Each host value depends on its inputs
    alone, so what is evaluated is what a whole-program evaluation gives.

    Args:
      traced: from :func:`trace`.
      outputs: the operands of ``traced.program.outputs`` that will be made.

    Returns:
      A :class:`Traced` with ``host`` and ``dynamic`` filled.
    """
    prog, args = traced.program, traced.args
    host: dict[int, Any] = {}
    for n, a in zip(prog.inputs, args, strict=True):
        host[n] = np.asarray(a)
    needed = nodes_read(prog, outputs)
    bound = host_bound()
    for n, c in prog.consts.items():
        if _nbytes(prog.avals[n]) <= bound:
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
        return size <= bound

    dynamic = set(prog.inputs)
    nodes = prog.nodes
    with _host.quiet():
        for i in needed:
            node = nodes[i]
            ins = [x for x in node.ins if type(x) is not Lit]
            if dynamic and not dynamic.isdisjoint(ins):
                dynamic.update([n for n in node.outs if n >= 0])
            if not _host.is_host(node):
                continue
            if not all([n < 0 or small(n) for n in node.outs]):
                continue
            if all([x in host for x in ins]):
                _host.evaluate_one(prog, i, host)
    return dataclasses.replace(traced, host=host, dynamic=frozenset(dynamic))


def nodes_read(prog: Program, outputs: Sequence[int | Lit]) -> list[int]:
    """The indices of the nodes ``outputs`` read, directly or not, in program order."""
    needed: set[int] = set()
    stack = [o for o in outputs if type(o) is not Lit]
    seen: set[int] = set()
    producer, nodes = prog.producer, prog.nodes
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        i = producer.get(n)
        if i is None or i in needed:
            continue
        needed.add(i)
        stack.extend([x for x in nodes[i].ins if type(x) is not Lit])
    return sorted(needed)


# ------------------------------------------------------------------------- the cut


@dataclasses.dataclass(frozen=True)
class Slice:
    """What makes one output from host values: ``nodes`` evaluated on ``inputs``."""

    nodes: tuple[int, ...]
    inputs: tuple[int, ...]
    out: int | Lit
    digest: str
    has_control_flow: bool  # whose bodies must keep jax's key implementation
    consts: tuple[int, ...] = ()  # small captured constants, in the program as jit has them
    # host values that are constants of the program, as jit has them (folded_scalar)
    folded: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Fallback:
    """An output the engine cannot cut, why, and what the user can change so it can:
    the whole-constructor program makes it."""

    reason: str
    fix: str


_CALLBACK_FIX = (
    "make this value with jax operations instead of a Python callback, or set it after "
    "init; if jax or flax itself adds the callable, report it to meshinit"
)
_VALUE_FIX = (
    "pass that value as an array or a plain Python value (a number, a string, a tuple); "
    "if jax or flax itself adds it, report it to meshinit"
)


EMBEDDED_ELEMENTS = 16
"""Captured constants of at most this many elements are constants of the programs."""


def embedded_const(prog: Program, n: int) -> bool:
    """Whether the captured constant ``n`` is a constant of the programs rather than an
    argument: a small numeric one, as ``jax.jit`` embeds its captured constants. XLA's
    CPU code for a loop that broadcasts a constant can round otherwise than one that
    broadcasts an argument: with jax 0.12.0.1 on an AMD EPYC, ``lecun_normal`` of a
    (4096, 4) matrix whose truncated normal's bounds came in as arguments had 621 of
    its 16,384 elements up to 3 ulp off ``jax.jit``'s and eager's bits."""
    aval = prog.avals[n]
    numeric = not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
    return numeric and math.prod(aval.shape) <= EMBEDDED_ELEMENTS


def folds(prog: Program, n: int) -> bool:
    """Whether a host value that depends on no argument is computed in the program
    rather than passed in: a floating-point one (a truncated normal's bounds, an
    initializer's stddev), which ``jax.jit`` folds into its program as a constant.
    Integers (key data, RNG counters) stay arguments: one program serves every layer."""
    return bool(jax.dtypes.issubdtype(prog.avals[n].dtype, np.floating))


def enters(prog: Program, n: int) -> bool:
    """Whether the host value ``n`` may enter a program as an argument: an argument of
    the constructor, a PRNG key or a scalar (an RNG counter). Any other array the host
    computed (random bits, an iota and what integer arithmetic made of them) is
    computed in the program from those, as ``jax.jit`` computes it: fed in as an
    argument, it changed how XLA's CPU code split and vectorized the initializer's
    float loop (jaxlib 0.12.0.1 on this Xeon: ``lecun_normal`` of a (1024, 4) matrix
    whose random bits the host computed, 6 of 4,096 elements up to 2 ulp off
    ``nnx.jit``'s and eager's bits)."""
    aval = prog.avals[n]
    key = jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
    return n not in prog.producer or key or math.prod(aval.shape) <= 1


def cut(traced: Traced, out: int | Lit, memo: dict[Any, Any]) -> Slice | Fallback | None:
    """The slice of ``out``; None if it is a literal or a captured constant.

    The slice stops at host values, which enter as arguments. A value the host made
    itself (a norm's ones) is the exception: its slice recomputes it in the program
    from its own equations, down to the values that depend on the constructor's
    arguments. Those equations are all exact (host rules only exist for exact ones),
    so XLA computes, or folds, the same bits; and computing a 1 KiB ones in the program
    was faster than shipping it into every launch (benchmarks/README.md). Floats that
    depend on no argument (:func:`folds`) and small captured constants
    (:func:`embedded_const`) are in the program too, as ``jax.jit`` has them: XLA can
    round a loop otherwise when they come in as arguments.
    """
    prog, host = traced.program, traced.host
    if isinstance(out, Lit) or out in prog.consts:
        return None
    recompute = out in host
    if recompute and out in traced.dynamic and out not in prog.producer:
        # an argument itself: its program only places it
        return Slice((), (out,), out, _jaxpr.slice_fingerprint(prog, (), (out,), out, memo), False)
    nodes: set[int] = set()
    inputs: set[int] = set()
    embedded: set[int] = set()
    stack = [out]
    seen: set[int] = set()
    consts, dynamic, producer, all_nodes = prog.consts, traced.dynamic, prog.producer, prog.nodes
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in consts and n not in host and embedded_const(prog, n):
            embedded.add(n)
            continue
        if n in consts or (
            n in host and enters(prog, n) and (n in dynamic or not (recompute or folds(prog, n)))
        ):
            if n not in host and jax.dtypes.issubdtype(prog.avals[n].dtype, jax.dtypes.extended):
                return Fallback(  # only threefry keys have host data to pass in
                    f"it reads a {prog.avals[n].dtype} key made outside the factory",
                    "make the key inside the factory (nnx.Rngs(0) in the lambda), or pass "
                    "it as the key argument of linen.init or eqx.init",
                )
            inputs.add(n)
            continue
        i = producer[n]
        if i in nodes:
            continue
        nodes.add(i)
        node = all_nodes[i]
        if node.effects:
            return Fallback(
                f"{node.primitive.name} has side effects ({', '.join(map(str, node.effects))})",
                "make this value without a callback, print or other side effect in the "
                "constructor (with jax operations), or make it after init",
            )
        stack.extend([x for x in node.ins if type(x) is not Lit])
    order = tuple(sorted(nodes))
    ins = tuple(sorted(inputs))
    fixed = tuple(sorted(embedded))
    folded: tuple[int, ...] = ()
    if folded_scalar(traced, out, ins):
        folded, ins = ins, ()
    try:
        digest = _jaxpr.slice_fingerprint(prog, order, ins or folded, out, memo, fixed)
        if folded:  # its constants by value: a program of its own
            held = [host_constant(host[n]) for n in folded]
            values = repr([(str(v.dtype), v.shape, v.tobytes()) for v in held])
            digest = hashlib.blake2b((digest + values).encode(), digest_size=16).hexdigest()
    except _jaxpr.Unfingerprintable as e:
        fix = _CALLBACK_FIX if e.callable else _VALUE_FIX
        return Fallback(f"{e}, which meshinit cannot compare between variables", fix)
    has_control_flow = any(prog.nodes[i].control for i in order)
    return Slice(order, ins, out, digest, has_control_flow, fixed, folded)


def folded_scalar(traced: Traced, out: int, inputs: Sequence[int]) -> bool:
    """Whether ``out`` is a float of one element that depends on no argument of the
    constructor (its key comes from a literal seed, as ``nnx.Rngs(0)``'s): ``jax.jit``
    of the constructor then sees only constants in its computation, and XLA may
    compute it at compile time, on the compiling host (a TPU's programs fold a 0-d
    normal whole: jax 0.10.2 with libtpu 0.0.42.1, ``constant(0.0200802851)`` in
    ``nnx.jit``'s optimized program), where the device's own code rounds otherwise (8
    ulp on a TPU v5e). So its program holds those host values as constants, and its
    random bits are jax's own, as jit's program has them: XLA then folds it, or not,
    alike (:func:`meshinit._engine.run`'s ``_evaluator``). An array of more elements
    is not folded by jit (XLA leaves an ``iota`` of counters to run time: a TPU's jit
    folds a (1,)-shaped normal, not a (4,)-shaped one). Each such value is a program
    of its own (its constants are its own)."""
    aval = traced.program.avals[out]
    if (
        not inputs
        or math.prod(aval.shape) != 1
        or not jax.dtypes.issubdtype(aval.dtype, np.inexact)
    ):
        return False  # integers and keys are exact wherever they are computed
    return all(n in traced.host and n not in traced.dynamic for n in inputs)


def host_constant(value: Any) -> Any:
    """A host value as the program's constant: a key as its data."""
    return value.data if isinstance(value, _host.HostKey) else np.asarray(value)
