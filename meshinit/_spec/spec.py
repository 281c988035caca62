"""Lazy parameter specs: ``param()``, ``ParamSpec`` and context ``defaults()``.

A spec is a declaration. Building one allocates nothing; ``plan`` resolves it and
``materialize`` turns it into an array.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import operator
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax import numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from .rules import AxisEntry, Rules, normalize_rules


class MeshAxes:
    """Sentinel: "the axis names are mesh axis names", even inside a rules context."""

    _instance: MeshAxes | None = None

    def __new__(cls) -> MeshAxes:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "meshinit.MESH_AXES"

    def __reduce__(self) -> str:
        return "MESH_AXES"


def _normalize_dtype(dtype: Any) -> np.dtype:
    """A numeric dtype; key dtypes (``jax.dtypes.prng_key``) and non-dtypes: TypeError."""
    try:
        extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    except TypeError:
        extended = False
    if extended:
        raise TypeError(
            f"dtype must be a numeric dtype (jnp.float32, jnp.bfloat16, ...), got {dtype!r}: "
            f"meshinit makes arrays of numbers; keep a key as its data "
            f"(jax.random.key_data, uint32) and wrap it after placing"
        )
    try:
        return np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise TypeError(f"dtype must be a numeric dtype (jnp.float32, ...), got {dtype!r}") from e


MESH_AXES = MeshAxes()
"""Pass as ``rules=MESH_AXES`` to ``param`` or ``defaults`` to say that a spec's axes
name mesh axes directly, overriding any rules set by an enclosing ``defaults``."""


def _normalize_shape(shape: Any) -> tuple[int, ...]:
    if type(shape) is tuple and all(type(d) is int and d >= 0 for d in shape):
        return shape
    if not isinstance(shape, tuple | list):
        raise TypeError(
            f"shape must be a tuple of non-negative ints, got {type(shape).__name__} {shape!r}"
        )
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int | np.integer):
            raise TypeError(f"shape must be a tuple of non-negative ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
        out.append(operator.index(d))
    return tuple(out)


def _normalize_axes(axes: Any) -> tuple[AxisEntry, ...] | None:
    if axes is None:
        return None
    if type(axes) is tuple and all(a is None or type(a) is str for a in axes):
        return axes  # the common case, without the slow Sequence check
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise TypeError(
            f"axes must be a tuple with one entry per dimension (a name or None), got "
            f"{axes!r}; for one dimension write ({axes!r},)"
        )
    out: list[AxisEntry] = []
    for a in axes:
        if a is None or isinstance(a, str):
            out.append(a)
        elif isinstance(a, tuple | list) and all(isinstance(x, str) for x in a):
            out.append(tuple(a))
        else:
            raise TypeError(f"each axes entry must be a name, a tuple of names or None, got {a!r}")
    return tuple(out)


def axis_names(axes: Any, what: str) -> tuple[str, ...]:
    """A mesh axis name or a sequence of them as a tuple, repeats dropped; ``what``
    names the argument in the TypeError for anything else."""
    if isinstance(axes, str):
        return (axes,)
    if isinstance(axes, tuple | list) and all(isinstance(a, str) for a in axes):
        return tuple(dict.fromkeys(axes))
    raise TypeError(
        f"{what} must be a mesh axis name or a tuple of them, for example 'data' or "
        f"('data', 'fsdp'); got {axes!r}"
    )


def _normalize_replicated(axes: Any) -> tuple[str, ...]:
    return axis_names(axes, "replicated")


def _normalize_memory_kind(kind: Any) -> str | None:
    if kind is None or isinstance(kind, str):
        return kind
    raise TypeError(
        f"memory_kind must be a memory kind's name, such as 'device' or 'pinned_host', or "
        f"None for the devices' default memory; got {kind!r}"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class ParamSpec:
    """A parameter not yet allocated: its shape, initializer and placement.

    Build specs with :func:`param`. Specs compare by identity: the same spec object
    at two paths of a tree declares two independent parameters, each keyed by its own
    path (tying weights is the model's business).

    Attributes:
      shape: the array shape, a tuple of non-negative ints.
      init: a JAX initializer, ``init(key, shape, dtype) -> Array``.
      axes: one entry per dimension (a logical name or None), or None for replicated.
      mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh``, or None if none was given.
      rules: the logical-to-mesh rule table, or None when ``axes`` name mesh axes.
      dtype: the array dtype.
      metadata: free-form extra keyword arguments given to :func:`param`.
      replicated: mesh axes this parameter is meant to be replicated over (HSDP's data
        axis): the plan reports no shardable hint (``!``) for them. A mark only.
      memory_kind: the memory its shards live in (``"pinned_host"`` for host offload),
        or None for the devices' default memory.

    Examples:
      >>> spec = meshinit.param((1024, 4096), lecun_normal(), axes=("embed", "mlp"))
      >>> spec.shape, spec.dtype, spec.nbytes
      ((1024, 4096), dtype('float32'), 16777216)
    """

    shape: tuple[int, ...]
    init: Callable[..., Any]
    axes: tuple[AxisEntry, ...] | None
    mesh: Mesh | AbstractMesh | None
    rules: Rules | None
    dtype: np.dtype
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    replicated: tuple[str, ...] = ()
    memory_kind: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "shape", _normalize_shape(self.shape))
        set_(self, "axes", _normalize_axes(self.axes))
        set_(self, "rules", None if self.rules is None else normalize_rules(self.rules))
        set_(self, "dtype", _normalize_dtype(self.dtype))
        set_(self, "metadata", types.MappingProxyType(dict(self.metadata)))
        if self.replicated:
            set_(self, "replicated", _normalize_replicated(self.replicated))
        if self.memory_kind is not None:
            set_(self, "memory_kind", _normalize_memory_kind(self.memory_kind))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) parameter."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def logical_names(self) -> tuple[Any, ...] | None:
        """The logical names of its dimensions: its axes where it has rules, else the
        names a framework's metadata gave before its rules made them mesh axes
        (``metadata["logical"]``, flax nnx's), else None."""
        return self.axes if self.rules is not None else self.metadata.get("logical")

    def __repr__(self) -> str:
        dims = ",".join(map(str, self.shape))
        init = getattr(self.init, "__qualname__", type(self.init).__name__)
        return (
            f"ParamSpec({self.dtype.name}[{dims}], axes={self.axes}, init={init}, "
            f"mesh={self.mesh!r})"
        )


def key_spec(spec: ParamSpec, key: Any) -> ParamSpec:
    """``spec``, which plans a typed PRNG key array as its key data (uint32), shown as
    the key array ``key`` (a struct) itself: its shape and key dtype (``key<fry>``).

    For the plans of the constructor adapters, which give such keys back as the
    constructor made them; :func:`param` refuses key dtypes (meshinit makes numbers),
    so no initializer ever sees one.
    """
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise TypeError(f"key_spec takes a typed PRNG key array, got {key.dtype}")
    shown = dataclasses.replace(spec, shape=tuple(key.shape))
    object.__setattr__(shown, "dtype", key.dtype)  # past _normalize_dtype, on purpose
    return shown


@dataclasses.dataclass(frozen=True)
class _Defaults:
    mesh: Mesh | AbstractMesh | None = None
    rules: Rules | None = None  # None: axes are mesh axis names
    dtype: np.dtype | None = None
    replicated: tuple[str, ...] = ()
    memory_kind: str | None = None


_DEFAULTS: contextvars.ContextVar[_Defaults] = contextvars.ContextVar(
    "meshinit_defaults",
    default=_Defaults(),  # noqa: B039 (frozen, never mutated)
)


@contextlib.contextmanager
def defaults(
    *,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Rules | MeshAxes | None = None,
    dtype: Any = None,
    replicated: str | Sequence[str] | None = None,
    memory_kind: str | None = None,
) -> Iterator[None]:
    """Supplies the ``mesh``, ``rules``, ``dtype``, ``replicated`` and ``memory_kind``
    that :func:`param` was not given.

    Nestable; an inner context overrides only what it sets. ``rules=MESH_AXES``
    switches rules off again inside an outer rules context. Values are read when
    ``param`` is called, not when the plan is made.

    Args:
      mesh: the mesh of the specs made inside; None keeps the enclosing one.
      rules: the rule table of the specs made inside; None keeps the enclosing one,
        and ``MESH_AXES`` means none (axes name mesh axes).
      dtype: the dtype of the specs made inside; None keeps the enclosing one
        (float32 outside any context).
      replicated: mesh axes the specs made inside are meant to be replicated over (see
        :func:`param`); None keeps the enclosing ones, ``()`` means none. The adapters'
        ``init`` and ``plan`` read it too.
      memory_kind: the memory kind of the specs made inside (see :func:`param`); None
        keeps the enclosing one. The adapters' ``init`` and ``plan`` read it too.

    Examples:
      >>> with meshinit.defaults(mesh=mesh, rules=(("embed", "fsdp"), ("mlp", "tensor"))):
      ...     w = meshinit.param((256, 1024), lecun_normal(), axes=("embed", "mlp"))
    """
    outer = _DEFAULTS.get()
    new_rules = outer.rules
    if rules is MESH_AXES:
        new_rules = None
    elif rules is not None:
        new_rules = normalize_rules(rules)
    token = _DEFAULTS.set(
        _Defaults(
            mesh=outer.mesh if mesh is None else mesh,
            rules=new_rules,
            dtype=outer.dtype if dtype is None else _normalize_dtype(dtype),
            replicated=(
                outer.replicated if replicated is None else _normalize_replicated(replicated)
            ),
            memory_kind=(
                outer.memory_kind if memory_kind is None else _normalize_memory_kind(memory_kind)
            ),
        )
    )
    try:
        yield
    finally:
        _DEFAULTS.reset(token)


def param(
    shape: Sequence[int],
    init: Callable[..., Any],
    *,
    axes: Sequence[AxisEntry] | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Rules | MeshAxes | None = None,
    dtype: Any = None,
    replicated: str | Sequence[str] | None = None,
    memory_kind: str | None = None,
    **metadata: Any,
) -> ParamSpec:
    """Declares a parameter lazily; allocates nothing.

    Args:
      shape: a tuple of non-negative ints.
      init: any JAX initializer ``init(key, shape, dtype) -> Array``.
      axes: one entry per dimension: a logical axis name, or None for a replicated
        dimension. ``None`` means fully replicated. Where the axes name mesh axes
        (no rules), an entry may also be a tuple of mesh axis names.
      mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh``; defaults to ``defaults()``.
      rules: ``(logical_name, mesh_axes)`` pairs. None uses the ``defaults()`` rules
        if any, else the axis names are mesh axis names; ``MESH_AXES`` always means
        the latter.
      dtype: defaults to the ``defaults()`` dtype, else float32.
      replicated: mesh axes this parameter is meant to be replicated over, such as
        HSDP's data axis: the plan's shardable hints (``!`` and the "could shard"
        lines) stay quiet for them. A mark only: placement is unchanged, and it
        applies where the parameter is replicated over the axis (a parameter its axes
        shard over it is not). An axis that no mesh of the plan has is a
        :class:`PlanError`. Defaults to the ``defaults()`` ones, else none.
      memory_kind: the memory the parameter's shards live in: ``"pinned_host"`` (or
        ``"unpinned_host"``) offloads it to host memory, ``"device"`` is device memory.
        The planned ``NamedSharding`` carries it, and materialize generates into it.
        A kind the mesh's devices do not offer is a :class:`PlanError`. Defaults to
        the ``defaults()`` one, else None: the devices' default memory.
      **metadata: kept on the spec for adapters and reports.

    Returns:
      A :class:`ParamSpec`.

    Raises:
      TypeError, ValueError: at once, for a malformed shape, axes, rules or dtype;
        everything that depends on the mesh is checked later, by
        :func:`meshinit.plan`.

    Examples:
      >>> mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
      >>> w = meshinit.param((256, 1024), jax.nn.initializers.lecun_normal(),
      ...                    axes=("fsdp", "tensor"), mesh=mesh)
    """
    ctx = _DEFAULTS.get()
    if dtype is None:
        dtype = np.float32 if ctx.dtype is None else ctx.dtype
    if rules is None:
        rules = ctx.rules
    elif rules is MESH_AXES:
        rules = None
    return ParamSpec(
        shape=shape,  # type: ignore[arg-type]
        init=init,
        axes=axes,  # type: ignore[arg-type]
        mesh=ctx.mesh if mesh is None else mesh,
        rules=rules,  # type: ignore[arg-type]
        dtype=dtype,
        metadata=metadata,
        # a str or any sequence of names: __post_init__ normalizes it to a tuple
        replicated=cast("tuple[str, ...]", ctx.replicated if replicated is None else replicated),
        memory_kind=ctx.memory_kind if memory_kind is None else memory_kind,
    )


def replicated_default() -> tuple[str, ...]:
    """The ``replicated`` axes of the innermost :func:`defaults` (the adapters' specs)."""
    return _DEFAULTS.get().replicated


def mesh_default() -> Mesh | AbstractMesh | None:
    """The ``mesh`` of the innermost :func:`defaults` (the adapters' specs)."""
    return _DEFAULTS.get().mesh


def memory_kind_default() -> str | None:
    """The ``memory_kind`` of the innermost :func:`defaults` (the adapters' specs)."""
    return _DEFAULTS.get().memory_kind


def _stacked_init(base: Callable[..., Any], n: int) -> Callable[..., Any]:
    # A plain closure, not an object: fingerprints see through it to ``base``, so fresh
    # ``lecun_normal()`` closures still deduplicate.
    def init(key: Any, shape: Sequence[int], dtype: Any) -> Any:
        import jax

        if tuple(shape[:1]) != (n,):
            raise ValueError(f"a stacked init of {n} layers got shape {tuple(shape)}")
        return jax.vmap(lambda i: base(jax.random.fold_in(key, i), tuple(shape[1:]), dtype))(
            jnp.arange(n, dtype=jnp.uint32)
        )

    init.__qualname__ = f"stacked({getattr(base, '__qualname__', type(base).__name__)})"
    return init


def stacked(n: int, spec: ParamSpec, axis: str | None = "layers") -> ParamSpec:
    """``n`` copies of ``spec`` stacked on a new leading axis, each with its own fan-in.

    Variance-scaling initializers read fan-in from the shape, so ``lecun_normal`` on
    ``(L, d, d)`` counts ``L`` into the fan and silently shrinks the std by
    ``sqrt(L)``. Here slice ``i`` is
    ``spec.init(jax.random.fold_in(param_key(key, path), i), spec.shape, spec.dtype)``:
    exactly what layer ``i`` would get on its own, with its per-layer fan-in.

    Args:
      n: the number of layers.
      spec: the per-layer spec.
      axis: the logical (or mesh) axis name of the new leading dimension; None keeps
        it replicated. With rules, the table needs a rule for it, e.g.
        ``("layers", None)`` or ``("layers", "stage")``.

    Returns:
      A spec of shape ``(n, *spec.shape)`` with ``axis`` prepended to its axes.

    Examples:
      >>> layer = meshinit.param((d, d), lecun_normal(), axes=("embed", "mlp"))
      >>> w = meshinit.stacked(32, layer)   # shape (32, d, d), axes ("layers", "embed", "mlp")
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise TypeError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(spec, ParamSpec):
        raise TypeError(f"stacked takes a ParamSpec from meshinit.param, got {type(spec).__name__}")
    axes = (
        None
        if spec.axes is None and axis is None
        else ((axis, *(spec.axes if spec.axes is not None else (None,) * len(spec.shape))))
    )
    return dataclasses.replace(
        spec, shape=(int(n), *spec.shape), init=_stacked_init(spec.init, int(n)), axes=axes
    )
