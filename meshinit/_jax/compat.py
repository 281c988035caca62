"""Every jax internal meshinit uses (the constructor engine most of all), in one place.

The engine reads jaxprs (:mod:`meshinit._jax.jaxpr`), evaluates some equations with numpy
(:mod:`meshinit._engine.host_eval`) and rebinds the rest (:mod:`meshinit._engine.run`). That
touches jax's interpreter surface, which ``jax.extend`` exposes without promising
compatibility across releases. No other module of meshinit names a jax internal:

- **Primitives by object.** Equations are recognized by their primitive object, as
  jax2tf does, never by a name string: a rename (``checkpoint``, printed ``remat2``)
  then cannot make a rule silently miss. Objects come from
  ``jax.extend.core.primitives`` where jax exports them; the few it does not
  (``random_wrap``, ``split``, ``pvary``, ...) are found once by tracing a probe of
  jax's public API and reading the primitive off the jaxpr. :func:`missing` lists any
  the installed jax lacks, and a test fails on it.
- **Jaxpr types.** jax 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (``.jaxpr`` of it
  returns the object itself): :func:`open_and_consts` is the one place that tells
  them apart.
- **Binding.** :func:`bind` rebinds an equation as jax's own interpreter does.
- **Key implementations.** :data:`PRNGImpl`, the type of jax's key implementations.
- **The configuration that changes values** (:func:`value_config`).
- **The persistent cache's thresholds** (:func:`persist_every_compile`), lowered for
  meshinit's own compiles only, through jax's thread-local config states.
- **The tracer-origin hook** (:func:`quiet_origin_messages`), the one patch of a
  private jax attribute, with its reason.
- **The coordination service's client** (:func:`distributed_client`): its key-value
  store carries the processes' agreements (:mod:`meshinit._run.agree`), out of band of
  the collectives that move data.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax._src import config as _config
from jax._src import distributed as _distributed
from jax.extend import core
from jax.extend.core import primitives as _exported
from jax.extend.random import threefry2x32_p, threefry_prng_impl

from .. import _caches

Primitive = core.Primitive
Literal = core.Literal
DropVar = core.DropVar
PRNGImpl = type(threefry_prng_impl)  # jax's key implementations; not exported by name
THREEFRY_IMPL = threefry_prng_impl
THREEFRY2X32 = threefry2x32_p


def impl_of(x: Any) -> Any:
    """The :data:`PRNGImpl` of a key dtype (a key aval's ``dtype``) or of a PRNGSpec
    (what ``jax.extend.random.define_prng_impl`` returns); None for anything else."""
    return getattr(x, "_impl", None)


def impl_name(impl: Any) -> str:
    """The name of a key implementation: a :data:`PRNGImpl` (a jaxpr's ``impl=``
    parameter) or what ``jax.random.key_impl`` returns (a name, or a PRNGSpec)."""
    if isinstance(impl, PRNGImpl):
        return impl.name
    return str(getattr(impl, "name", impl))


# ------------------------------------------------------------------ jaxpr types

_MERGED = core.ClosedJaxpr is core.Jaxpr  # jax >= 0.11


def is_jaxpr(x: Any) -> bool:
    """Whether ``x`` is a jaxpr, open or closed, on any supported jax."""
    return isinstance(x, core.ClosedJaxpr | core.Jaxpr)


def open_and_consts(x: Any) -> tuple[Any, Sequence[Any]]:
    """A jaxpr as (the object holding constvars, invars, eqns, outvars; its consts).

    Before jax 0.11 a ``ClosedJaxpr`` wraps an open ``Jaxpr`` (``.jaxpr``) and its
    ``.consts``. From 0.11 there is one type: its ``.jaxpr`` is itself and its
    ``.consts`` may be empty, in which case any constvars are inputs of the caller's
    own (as for an open jaxpr), so they get no values here.
    """
    if not _MERGED:
        if isinstance(x, core.ClosedJaxpr):
            return x.jaxpr, x.consts
        return x, ()
    consts = tuple(getattr(x, "consts", ()) or ())
    if consts and len(consts) != len(x.constvars):
        raise TypeError(f"a jaxpr with {len(x.constvars)} constvars and {len(consts)} consts")
    return x, consts


def retrace(x: Any, fn: Callable[..., Sequence[Any]]) -> Any:
    """A closed jaxpr with ``x``'s inputs, traced anew from ``fn`` under the current
    abstract mesh: the same computation when ``fn`` evaluates ``x``, with avals of
    this mesh (a jaxpr records the mesh it was traced under in every aval)."""
    body, _ = open_and_consts(x)
    structs = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in body.invars
    ]
    return jax.make_jaxpr(lambda *a: list(fn(*a)))(*structs)


def unmeshed_literal(x: Any) -> Any:
    """A literal of a traced jaxpr without the mesh it was traced under.

    jax 0.10 to 0.12 keep a literal as a ``TypedNdArray``: a numpy array with the aval
    it had in the trace, weak type and sharding (so its mesh) included. The same
    class, with the same dtype and weak type under the current mesh; anything else
    as it is.
    """
    aval = getattr(x, "aval", None)
    if type(x) is np.ndarray or not isinstance(x, np.ndarray) or aval is None:
        return x
    fresh = jax.core.ShapedArray(x.shape, x.dtype, weak_type=aval.weak_type)
    return type(x)(np.asarray(x), fresh)


def is_closed(x: Any) -> bool:
    """Whether ``x`` is a closed jaxpr (a loop's or a branch's body), not an open one
    whose constvars belong to its caller (``shard_map``'s before jax 0.11)."""
    return isinstance(x, core.ClosedJaxpr) and (not _MERGED or not x.constvars or bool(x.consts))


# ------------------------------------------------------------------- primitives


def _exported_or_none(name: str) -> Primitive | None:
    return getattr(_exported, name, None)


def _walk(jaxpr: Any, found: dict[str, Primitive]) -> None:
    body, _ = open_and_consts(jaxpr)
    for e in body.eqns:
        found.setdefault(e.primitive.name, e.primitive)
        for p in e.params.values():
            for q in p if isinstance(p, tuple | list) else (p,):
                if is_jaxpr(q):
                    _walk(q, found)


def _trace_probe(fn: Callable[..., Any], *structs: Any) -> dict[str, Primitive]:
    found: dict[str, Primitive] = {}
    _walk(jax.make_jaxpr(fn)(*structs), found)
    return found


def _u32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.uint32)


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.float32)


def _pvary_probe(x: Any) -> Any:
    mesh = jax.sharding.AbstractMesh((1,), ("probe",))
    shard_map: Any = getattr(jax, "shard_map", None)
    if shard_map is None:  # pragma: no cover - older jax
        from jax.experimental.shard_map import shard_map
    spec = jax.sharding.PartitionSpec
    with jax.sharding.use_abstract_mesh(mesh):
        return shard_map(
            lambda y: jax.lax.pcast(y, "probe", to="varying"),
            mesh=mesh,
            in_specs=spec(),
            out_specs=spec("probe"),
        )(x)


def _reshard_probe(x: Any) -> Any:
    explicit = (jax.sharding.AxisType.Explicit,)
    mesh = jax.sharding.AbstractMesh((1,), ("probe",), axis_types=explicit)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.reshard(x, jax.sharding.PartitionSpec("probe"))


# Primitives jax does not export, each found by tracing public API that binds it.
_PROBES: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "random_wrap": (jax.random.wrap_key_data, (_u32(2),)),
    "random_unwrap": (lambda d: jax.random.key_data(jax.random.wrap_key_data(d)), (_u32(2),)),
    "iota_2x32_shape": (lambda d: threefry_prng_impl.random_bits(d, 32, (4,)), (_u32(2),)),
    "split": (lambda x: jax.lax.split(x, (1, 1)), (_f32(2),)),
    "stack": (lambda x: jax.numpy.stack([x, x]), (_f32(2),)),
    "copy": (lambda x: jax.numpy.copy(x), (_f32(2),)),
    # jnp.unstack binds it on every jax; iterating an array does from jax 0.11
    "unstack": (lambda x: jax.numpy.unstack(x), (_f32(2),)),
    "pvary": (_pvary_probe, (_f32(1),)),
    "reshard": (_reshard_probe, (_f32(1),)),
}

# What the engine knows, by name only in this table: an exported primitive, else a probe.
KNOWN = (
    # calls whose body is their forward meaning (inlined)
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "remat",
    # control flow (one unit)
    "scan",
    "while",
    "cond",
    # placement only (the identity inside a group's program)
    "sharding_constraint",
    "device_put",
    "reshard",
    "pvary",
    # host rules
    "add",
    "sub",
    "mul",
    "div",
    "rem",
    "neg",
    "max",
    "min",
    "abs",
    "sign",
    "and",
    "or",
    "xor",
    "not",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "convert_element_type",
    "bitcast_convert_type",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "transpose",
    "slice",
    "concatenate",
    "stack",
    "split",
    "unstack",
    "iota",
    "select_n",
    "copy",
    "iota_2x32_shape",
    "threefry2x32",
    "random_seed",
    "random_wrap",
    "random_unwrap",
    "random_fold_in",
    "random_split",
    "random_bits",
)

# jax.extend's attribute for a name, where it differs from ``name + "_p"``
_EXPORTED_AS = {"core_call": "call_p"}


def _build_table() -> dict[str, Primitive | None]:
    table: dict[str, Primitive | None] = {}
    probed: dict[str, Primitive] = {}
    for fn, structs in _PROBES.values():
        try:
            probed.update(_trace_probe(fn, *structs))
        except Exception:  # noqa: BLE001 - the probe's API is absent: missing() says so
            pass
    for name in KNOWN:
        if name == "threefry2x32":
            table[name] = threefry2x32_p
            continue
        prim = _exported_or_none(_EXPORTED_AS.get(name, name + "_p"))
        if name in _PROBES and name in probed:
            prim = probed[name]  # the object the public API binds, even if also exported
        table[name] = prim
    return table


# Built once, at import, where no mesh or trace is active: a probe traced inside a
# user's trace or mesh context could fail and leave a primitive unknown. Tracing
# abstract values starts no backend.
_TABLE = _build_table()


def _table() -> dict[str, Primitive | None]:
    return _TABLE


def prim(name: str) -> Primitive | None:
    """The installed jax's primitive object for ``name`` (one of :data:`KNOWN`), or
    None if this jax has none (the engine then never matches it)."""
    return _table()[name]


def prims(*names: str) -> frozenset[Primitive]:
    """The primitive objects of ``names`` that the installed jax has."""
    return frozenset(p for p in map(prim, names) if p is not None)


def missing() -> list[str]:
    """The names of :data:`KNOWN` that the installed jax has no primitive for."""
    optional = {"core_call"}  # jax's plain call: jax 0.12 merged it into closed_call
    return [n for n, p in _table().items() if p is None and n not in optional]


@_caches.memo(maxsize=1)
def _placement() -> frozenset[Primitive]:
    return prims("sharding_constraint", "device_put", "reshard", "pvary")


# Elementwise primitives, by the names jax.lax exports them under (``<name>_p``): each
# result element depends only on its operands' elements at the same index (operands
# broadcast from size-1 axes). What meshinit._jax.tiles makes a tile at a time.
_ELEMENTWISE = """abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type cbrt
ceil clamp convert_element_type cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
floor ge gt integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
nextafter not or population_count pow reduce_precision rem round rsqrt select_n
shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
stop_gradient sub tan tanh xor""".split()


@_caches.memo(maxsize=1)
def _elementwise() -> frozenset[Primitive]:
    found = {getattr(jax.lax, f"{name}_p", None) for name in _ELEMENTWISE}
    return frozenset(p for p in found if p is not None) | prims("copy")


def elementwise(primitive: Primitive) -> bool:
    """Whether ``primitive`` is elementwise (:data:`_ELEMENTWISE`, and ``copy``)."""
    return primitive in _elementwise()


@_caches.memo(maxsize=1)
def _exact() -> frozenset[Primitive]:
    return prims(
        *"abs add and eq ge gt le lt max min mul ne neg not or select_n sign sub xor".split()
    )


def exact(primitive: Primitive) -> bool:
    """Whether ``primitive`` is elementwise and rounds as IEEE's basic operations do
    (or is exact): a constant operand read as a value gives the same bits, on every
    backend (:func:`meshinit._jax.explicit.bind_in_manual`)."""
    return primitive in _exact()


def placement_only(primitive: Primitive) -> bool:
    """Whether ``primitive`` only constrains or moves its operands (a sharding
    constraint, ``device_put``, ``reshard``, ``pvary``, ``mesh_cast``)."""
    if primitive in _placement():
        return True
    # jax exports no mesh_cast and no public API binds one outside a concrete explicit
    # mesh, so no probe can find its object: it alone is known by its name
    return primitive.name == "mesh_cast"


def bind(primitive: Primitive, ins: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """``primitive.bind(*ins, **params)`` as jax's interpreter does; always a list."""
    out = primitive.bind(*ins, **primitive.get_bind_params(params))
    return list(out) if primitive.multiple_results else [out]


# ------------------------------------------------------------------ configuration


def value_config() -> tuple[Any, ...]:
    """The configuration that changes the bits a traced computation gives.

    ``jax_threefry_partitionable`` changes how threefry counters are laid out (and so
    every random value), the default PRNG implementation changes what
    ``jax.random.key(seed)`` makes, x64 changes the dtypes of Python scalars, and the
    default matmul precision changes what a ``dot`` computes on GPU and TPU. Every
    cache of host programs and executables is keyed on this tuple.
    """
    return (
        bool(cast(Any, jax.config).jax_threefry_partitionable),
        str(cast(Any, jax.config).jax_default_prng_impl),
        bool(cast(Any, jax.config).jax_enable_x64),
        str(cast(Any, jax.config).jax_default_matmul_precision),
    )


# ------------------------------------------------- the persistent compilation cache

# jax's thresholds for writing a compiled program to its persistent compilation cache
# (``jax_compilation_cache_dir``): a program that compiled in less time, or whose entry
# is smaller, is not written. Both are thread-local config states on jax 0.10 to 0.12
# (``jax._src.config.float_state`` / ``int_state``): entered as a context manager, the
# value holds in this thread only, and every other thread (the user's own jits) keeps
# the global one. None where the installed jax has no such state.
_MIN_COMPILE_TIME = getattr(_config, "persistent_cache_min_compile_time_secs", None)
_MIN_ENTRY_SIZE = getattr(_config, "persistent_cache_min_entry_size_bytes", None)


def _thread_local(state: Any) -> bool:
    return state is not None and callable(state) and hasattr(state, "swap_local")


PERSIST_EVERY_COMPILE = _thread_local(_MIN_COMPILE_TIME) and _thread_local(_MIN_ENTRY_SIZE)
"""Whether :func:`persist_every_compile` can lower jax's thresholds for one thread."""


@contextlib.contextmanager
def persist_every_compile() -> Iterator[None]:
    """In this thread, jax's persistent compilation cache keeps every program compiled
    inside, whatever its compile time and size; where no cache is configured, nothing
    changes.

    jax reads both thresholds in the thread that compiles, when it writes the entry:
    the compile time 0 s (none is shorter), the entry size -1 (jax's "no size limit,
    and no override": with 0, jax's first cache initialization would replace the
    global value). Where the installed jax lacks either thread-local state
    (:data:`PERSIST_EVERY_COMPILE` false), this does nothing, and jax's own thresholds
    apply: meshinit never sets a global jax option.
    """
    if not PERSIST_EVERY_COMPILE:
        yield
        return
    with cast(Any, _MIN_COMPILE_TIME)(0.0), cast(Any, _MIN_ENTRY_SIZE)(-1):
        yield


# ------------------------------------------------------------- tracer messages

_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("meshinit_tracing", default=False)
_quiet_installed = False


def _install_quiet_origin_messages() -> None:
    """While meshinit traces a constructor, jax's tracers skip their origin message.

    Why a patch: ``nnx.Rngs`` compares ``getattr(count, "sharding", None)`` on every
    draw. On a tracer that raises an AttributeError whose message jax builds by walking
    every equation traced so far (``DynamicJaxprTracer._origin_msg``), so tracing a
    constructor is quadratic in its size: 1.1-1.4 s of a 32-layer trace (the guide).
    No public API turns that message off, and it cannot be avoided from outside: the
    getattr is flax's. So one wrapper, installed once, returns an empty origin message
    while :data:`_TRACING` is set in this context and defers to jax's own method
    everywhere else; no other code or thread sees a difference. Where jax has no such
    method (another version), nothing is installed; ``tests/_jax/test_compat.py`` checks
    both the effect and that the message outside meshinit is jax's own.
    """
    global _quiet_installed
    if _quiet_installed:
        return
    _quiet_installed = True
    seen: list[type] = []  # the tracer class, found through the public API

    def _probe(x: Any) -> Any:
        seen.append(type(x))
        return x

    jax.make_jaxpr(_probe)(np.float32(0))
    tracer_class = seen[0]
    original = tracer_class.__dict__.get("_origin_msg")
    if original is None:
        return

    def _origin_msg(self: Any) -> str:
        if _TRACING.get():
            return ""
        return original(self)

    tracer_class._origin_msg = _origin_msg  # type: ignore[attr-defined]


@contextlib.contextmanager
def quiet_origin_messages() -> Iterator[None]:
    """Tracers made inside skip jax's quadratic origin message (see above)."""
    _install_quiet_origin_messages()
    token = _TRACING.set(True)
    try:
        yield
    finally:
        _TRACING.reset(token)


# ------------------------------------------------------------- the coordination service


def distributed_client() -> Any:
    """The ``jax.distributed`` client of this process (``key_value_set``,
    ``key_value_dir_get``, ``key_value_delete``), or None where ``jax.distributed`` is
    not initialized. jax exports no public name for it; orbax reads it from the same
    place."""
    return getattr(getattr(_distributed, "global_state", None), "client", None)
