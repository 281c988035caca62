"""numpy code run on jax values, with numpy's dtypes and bits: :class:`Held`.

A framework's saving hooks are numpy functions (MaxText's ``hook(x, target_shape)``)
that an export runs on the devices, under ``jax.jit``. :class:`Held` is the array such
a hook is given: a jax value that answers as a numpy array does (``shape``, ``dtype``,
``reshape``, ``T``, ``astype``, ``x * 2.0``, ``x[..., ::2]``), and the hook runs as a
copy whose ``np``, ``jnp`` and ``jax`` are :data:`SPACES` (:func:`.hooks.rebound`), so
that ``np.concatenate`` of held values is jax's. Its results have numpy's bits:

- arithmetic (``+``, ``-``, ``*``, ``/``, unary ``-``) computes in the dtype numpy's
  promotion gives (NEP 50: a Python scalar takes the array's dtype, a numpy scalar
  keeps its own); a constant is converted on the host by numpy, as numpy's ufunc
  converts it (a Python float reaches bfloat16 through float32), not by XLA;
- a divisor goes into the program whole, behind an ``optimization_barrier`` it
  shares with the dividend: XLA makes a division by a broadcast value (a scalar,
  constant or not) a product by its inverse, other bits in float32;
- each result of arithmetic is pinned (an ``optimization_barrier``): XLA's excess
  precision would otherwise keep a bfloat16 intermediate in float32 where the next
  step reads it, and nothing is reassociated across steps;
- subnormal values are the exception: XLA's arithmetic flushes them to zero (on CPU
  and TPU, eager or jitted), where numpy keeps them. MaxText's ``to_huggingface``
  runs its hooks on jax arrays, and flushes them alike; layout steps move them as
  they are;
- an operation whose dtype numpy and jax promote differently (a bfloat16 array times
  a ``np.float64`` scalar: numpy float64, jax float32), one jax cannot compute
  (float64 without x64), or one that reads values (a comparison, ``bool()``, the
  values as a host array) raises :class:`Unfollowable` naming it: never a guess.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Unfollowable(Exception):
    """A step of a hook that :class:`Held` cannot run with numpy's bits; its message
    names the step."""


_Arith = Callable[[Any, Any], Any]
_ARITH: dict[str, tuple[str, _Arith]] = {  # dunder -> numpy's ufunc, the operation
    "add": ("add", operator.add),
    "sub": ("subtract", operator.sub),
    "mul": ("multiply", operator.mul),
    "truediv": ("true_divide", operator.truediv),
}


class Held:
    """A jax value as numpy code sees an array (see the module's docstring)."""

    __array_priority__ = 1000  # numpy hands `array op held` to Held's reflected method
    __slots__ = ("value", "rounded")

    def __init__(self, value: Any, rounded: bool = False):
        self.value = value
        self.rounded = rounded  # arithmetic or a narrowing cast made it

    # ------------------------------------------------------------- what it says
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.value.dtype)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Held({self.shape}, {self.dtype})"

    # ------------------------------------------------------------- what it refuses
    def __bool__(self) -> bool:
        raise Unfollowable("a branch on the tensor's values")

    def __array__(self, *_: Any, **__: Any) -> Any:
        raise Unfollowable("the tensor's values as a host array (numpy code on values)")

    def __iter__(self) -> Any:
        raise Unfollowable("iterating over the tensor")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise Unfollowable("writing into the tensor in place")

    def _compared(self, *_: Any) -> Any:
        raise Unfollowable("a comparison of the tensor's values")

    __lt__ = __le__ = __gt__ = __ge__ = _compared
    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(np.ndarray, name):
            raise AttributeError(name)  # as a numpy array has none (jax probes `aval`)
        raise Unfollowable(f"the array method {name!r}")

    # ------------------------------------------------------------- layout
    def _with(self, value: Any) -> Held:
        return Held(value, self.rounded)

    def reshape(self, *shape: Any, order: str = "C") -> Held:
        if order != "C":
            raise Unfollowable(f"a reshape in order {order!r}")
        if len(shape) == 1 and not isinstance(shape[0], int | np.integer):
            shape = tuple(shape[0])
        return self._with(self.value.reshape(tuple(operator.index(d) for d in shape)))

    def transpose(self, *axes: Any) -> Held:
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], Sequence | np.ndarray)):
            axes = () if axes[0] is None else tuple(axes[0])
        order = tuple(operator.index(a) for a in axes) or None
        return self._with(jnp.transpose(self.value, order))

    @property
    def T(self) -> Held:  # noqa: N802 - numpy's name
        return self.transpose()

    def swapaxes(self, a: int, b: int) -> Held:
        return self._with(jnp.swapaxes(self.value, a, b))

    def squeeze(self, axis: Any = None) -> Held:
        return self._with(jnp.squeeze(self.value, axis))

    def flatten(self, order: str = "C") -> Held:
        return self.reshape(-1, order=order)

    ravel = flatten

    def copy(self) -> Held:
        return self

    def __getitem__(self, key: Any) -> Held:
        parts = key if isinstance(key, tuple) else (key,)
        for k in parts:
            if not (k is None or k is Ellipsis or isinstance(k, slice | int | np.integer)):
                raise Unfollowable(f"indexing the tensor with {type(k).__name__}")
        return self._with(self.value[key])

    @property
    def at(self) -> _At:
        return _At(self)

    # ------------------------------------------------------------- values
    def astype(self, dtype: Any, **_: Any) -> Held:
        return cast(self, np.dtype(dtype))

    def __neg__(self) -> Held:
        return Held(-self.value, self.rounded)

    def __pos__(self) -> Held:
        return self


def _binary(name: str, reflected: bool) -> Callable[[Held, Any], Held]:
    ufunc, op = _ARITH[name]

    def method(self: Held, other: Any) -> Held:
        a, b = (other, self) if reflected else (self, other)
        return arithmetic(ufunc, op, a, b)

    method.__name__ = f"__{'r' if reflected else ''}{name}__"
    return method


for _name in _ARITH:
    setattr(Held, f"__{_name}__", _binary(_name, reflected=False))
    setattr(Held, f"__r{_name}__", _binary(_name, reflected=True))


class _At:
    """``held.at[key].set(value)``: jax's own update (the hooks that use it call jax)."""

    def __init__(self, held: Held, key: Any = None):
        self.held, self.key = held, key

    def __getitem__(self, key: Any) -> _At:
        return _At(self.held, key)

    def set(self, value: Any, **_: Any) -> Held:
        if not isinstance(value, Held):
            value = Held(jnp.asarray(np.asarray(_constant(value, "an update"))))
        if value.dtype != self.held.dtype:  # jax would cast it, numpy's kin otherwise
            raise Unfollowable(f"writing a {value.dtype} value into a {self.held.dtype}")
        v = value.value
        rounded = self.held.rounded or value.rounded
        return Held(self.held.value.at[self.key].set(v), rounded)


def floating(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating one (bfloat16 and float8 too, which numpy's
    ``issubdtype`` does not count)."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _narrow(dtype: np.dtype) -> bool:
    """Whether XLA may keep values of ``dtype`` wider than it (excess precision)."""
    return bool(floating(dtype)) and dtype.itemsize < 4


def pinned(value: Any) -> Any:
    """``value`` kept as it is: XLA neither widens it nor folds it into what reads it."""
    return jax.lax.optimization_barrier(value)


def cast(x: Held, dtype: np.dtype) -> Held:
    """``x.astype(dtype)``: between floating dtypes (round to nearest even in numpy and
    jax alike), or to its own dtype."""
    if dtype == x.dtype:
        return x
    if not (floating(x.dtype) and floating(dtype)):
        raise Unfollowable(f"a cast from {x.dtype} to {dtype}")
    _computable(dtype, f"a cast to {dtype}")
    value = x.value.astype(dtype)
    narrowed = dtype.itemsize < x.dtype.itemsize
    if narrowed and _narrow(dtype):
        value = pinned(value)
    return Held(value, x.rounded or narrowed)


def _computable(dtype: np.dtype, what: str) -> None:
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise Unfollowable(f"{what} in {dtype}, which jax computes in another dtype")


def _constant(x: Any, what: str) -> Any:
    """A hook's constant as numpy's promotion sees it (a Python scalar as it is)."""
    if isinstance(x, bool | int | float | np.generic):
        return x
    if isinstance(x, np.ndarray):
        return x
    raise Unfollowable(f"{what} with a {type(x).__name__}")


def arithmetic(ufunc: str, op: _Arith, a: Any, b: Any) -> Held:
    """``op(a, b)`` (one of them held) in numpy's result dtype, with numpy's bits."""
    what = f"np.{ufunc}"
    protos = [np.ones((), x.dtype) if isinstance(x, Held) else _constant(x, what) for x in (a, b)]
    try:
        with np.errstate(all="ignore"):  # only its dtype is wanted
            want = np.dtype(getattr(np, ufunc)(*protos).dtype)
    except Exception as e:  # noqa: BLE001 - numpy's own refusal (an int too large, ...)
        raise Unfollowable(f"{what} that numpy refuses ({type(e).__name__}: {e})") from None
    structs = [
        jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, Held) else None for x in (a, b)
    ]

    def jaxs(*held: Any) -> Any:
        it = iter(held)
        return op(*[next(it) if s is not None else p for s, p in zip(structs, (a, b), strict=True)])

    try:
        theirs = np.dtype(jax.eval_shape(jaxs, *[s for s in structs if s is not None]).dtype)
    except Exception as e:  # noqa: BLE001 - jax's refusal, named
        raise Unfollowable(f"{what} that jax refuses ({type(e).__name__}: {e})") from None
    if theirs != want:
        raise Unfollowable(f"{what} that numpy computes in {want} and jax in {theirs}")
    if not (floating(want) or jnp.issubdtype(want, jnp.integer)):
        raise Unfollowable(f"{what} in {want}")
    _computable(want, what)
    one = np.ones((), want)
    values = []
    for x in (a, b):
        if isinstance(x, Held):
            values.append(x.value.astype(want) if x.dtype != want else x.value)
            continue
        with np.errstate(all="ignore"):  # converted as numpy's ufunc converts it
            converted = np.asarray(np.multiply(one, x) if np.ndim(x) == 0 else np.asarray(x, want))
        if converted.dtype != want or converted.shape != np.shape(x):
            raise Unfollowable(f"{what} with a constant numpy converts otherwise")
        values.append(jnp.asarray(converted))
    if ufunc == "true_divide":
        # XLA makes a division by a broadcast value (a scalar, a constant or not) a
        # product by its inverse, which rounds otherwise: the divisor goes in whole,
        # behind a barrier it shares with the dividend (a barrier of a constant alone
        # is folded by older XLA)
        shape = np.broadcast_shapes(*(np.shape(v) for v in values))
        values = list(pinned((values[0], jnp.broadcast_to(values[1], shape))))
    value = op(*values)
    if value.dtype != want:  # both operands are `want`: jax keeps it
        raise Unfollowable(f"{what} that jax computes in {value.dtype}")
    # pinned: neither widened (excess precision) nor reassociated with the next step
    return Held(pinned(value), rounded=True)


# ----------------------------------------------------------------- np and jnp as hooks see them


def held(x: Any) -> Held:
    """``x`` as a held value: a jax value (a hook's own ``jnp.zeros``), or a host constant."""
    if isinstance(x, Held):
        return x
    if isinstance(x, jax.Array):
        return Held(x, rounded=True)  # made by jax code: not followed step by step
    return Held(jnp.asarray(np.asarray(x)))


def _joined(fn: Callable[..., Any], what: str) -> Callable[..., Held]:
    """``np.concatenate`` and ``np.stack``: of the parts in numpy's common dtype, which
    jax's must be (a part widened to it is exact)."""

    def join(xs: Sequence[Any], axis: int = 0, **kwargs: Any) -> Held:
        if kwargs.get("dtype") is not None or kwargs.get("out") is not None:
            raise Unfollowable(f"{what} with dtype= or out=")
        parts = [x if isinstance(x, Held) else _constant(x, what) for x in xs]
        dtypes = [np.asarray(x).dtype if not isinstance(x, Held) else x.dtype for x in parts]
        want = np.result_type(*dtypes)
        if np.dtype(jnp.result_type(*dtypes)) != want:
            raise Unfollowable(f"{what} of {', '.join(map(str, dtypes))} (jax joins otherwise)")
        made = [cast(held(x), want) if floating(want) else held(x) for x in parts]
        value = fn([x.value for x in made], axis)
        return Held(value, any(x.rounded for x in made))

    return join


def _split(x: Held, sections: Any, axis: int = 0) -> list[Held]:
    parts = jnp.split(x.value, sections, axis)
    return [x._with(p) for p in parts]


def _like(fill: float) -> Callable[..., Held]:
    def make(x: Any, dtype: Any = None, **_: Any) -> Held:
        shape = x.shape if isinstance(x, Held) else np.shape(x)
        dt = np.dtype(dtype) if dtype is not None else np.dtype(held(x).dtype)
        return Held(jnp.full(shape, fill, dt))

    return make


def _filled(fill: float | None) -> Callable[..., Held]:
    def make(shape: Any, *args: Any, dtype: Any = None, **_: Any) -> Held:
        value = fill
        if fill is None:  # full(shape, value, dtype)
            value, args = args[0], args[1:]
        dt = np.dtype(args[0] if args else dtype if dtype is not None else np.float64)
        _computable(dt, "an array")
        shape = (shape,) if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)
        return Held(jnp.full(shape, np.asarray(value, dt), dt))

    return make


def _as_is(x: Any, dtype: Any = None, **kwargs: Any) -> Any:
    """``np.asarray`` and its kin: a held value as it is (cast where a dtype is given)."""
    if isinstance(x, Held):
        return x if dtype is None else x.astype(dtype)
    return None  # not held: numpy's own


def _method(name: str) -> Callable[..., Any]:
    """``np.transpose(x, ...)`` and its kin: numpy calls the array's method."""

    def call(x: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(x, name)(*args, **kwargs)

    return call


_LAYOUT: dict[str, Callable[..., Any]] = {
    "transpose": _method("transpose"),
    "reshape": _method("reshape"),
    "squeeze": _method("squeeze"),
    "swapaxes": _method("swapaxes"),
    "ravel": _method("ravel"),
    "moveaxis": lambda x, a, b: x._with(jnp.moveaxis(x.value, a, b)),
    "expand_dims": lambda x, axis: x._with(jnp.expand_dims(x.value, axis)),
    "flip": lambda x, axis=None: x._with(jnp.flip(x.value, axis)),
    "split": _split,
    "concatenate": _joined(jnp.concatenate, "concatenate"),
    "concat": _joined(jnp.concatenate, "concatenate"),
    "stack": _joined(jnp.stack, "stack"),
}
_MADE: dict[str, Callable[..., Any]] = {  # arrays a hook makes: held, for jax's code
    "zeros": _filled(0),
    "ones": _filled(1),
    "empty": _filled(0),
    "full": _filled(None),
    "zeros_like": _like(0),
    "ones_like": _like(1),
    "empty_like": _like(0),
}


def _any_held(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    def has(x: Any) -> bool:
        if isinstance(x, Held):
            return True
        return isinstance(x, list | tuple) and any(has(y) for y in x)

    return any(has(a) for a in (*args, *kwargs.values()))


class _Space(types.SimpleNamespace):
    """numpy (or jax.numpy) as a hook sees it: held values go through the functions of
    this module; everything else is the library's own. ``jnp`` makes held arrays."""

    def __init__(self, real: Any, made: bool):
        super().__init__()
        self._real, self._name, self._made = real, real.__name__.split(".")[-1], made

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._real, name)
        if not callable(found) or isinstance(found, type):
            return found
        layout, made = _LAYOUT.get(name), _MADE.get(name) if self._made else None
        shown = f"{'jnp' if self._made else 'np'}.{name}"

        def call(*args: Any, **kwargs: Any) -> Any:
            if made is not None:
                return made(*args, **kwargs)
            if name in ("asarray", "array", "ascontiguousarray", "copy"):
                kept = _as_is(*args, **kwargs)
                if kept is not None:
                    return kept
            if not _any_held(args, kwargs):
                return found(*args, **kwargs)
            if layout is None:
                raise Unfollowable(f"{shown} of the tensor")
            return layout(*args, **kwargs)

        return call


class _Jax(types.SimpleNamespace):
    """jax as a hook sees it: ``jax.numpy`` is :data:`JNP`; ``jax.Array`` and the rest
    are jax's own (a held value is no ``jax.Array``: a hook that branches on it takes
    its numpy branch, as it does on MaxText's host arrays)."""

    def __init__(self, jnp_space: _Space):
        super().__init__(numpy=jnp_space)

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)


NP = _Space(np, made=False)
JNP = _Space(jnp, made=True)
SPACES = {"np": NP, "numpy": NP, "jnp": JNP, "jax": _Jax(JNP)}
"""The names a hook's copy sees (:func:`.hooks.rebound`)."""


def value(x: Any) -> Held:
    """A hook's result as a held value (a host constant it returned, too)."""
    try:
        return held(x)
    except Unfollowable:
        raise
    except Exception as e:  # noqa: BLE001 - what it returned instead, named
        raise Unfollowable(f"a result of type {type(x).__name__}") from e
