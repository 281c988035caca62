"""Cheap, sound fingerprints of initializers, and the memoized abstract init check.

Initializers are usually fresh closures (``lecun_normal()`` returns a new function on
every call), so identity alone cannot tell that two specs share an initializer. Two
initializers get equal fingerprints only when they compute the same thing: the same
code, closure values and defaults and, for a user's function (not jax's, flax's or
another library's), the same values of the module globals it reads; dicts, lists and
small arrays count by their contents, recursively. What has no value fingerprint (a
large array, an object hashed by identity) gets identity, shared within one plan and
never across plans, which is always sound.

Planning uses the fingerprint to run ``jax.eval_shape`` once per distinct (init,
shape, dtype), and materialization uses it to deduplicate compiled work.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable, Hashable
from typing import Any, cast

import jax
import numpy as np

from .. import _caches

_MAX_DEPTH = 6
# Arrays an initializer reads are fingerprinted by their bytes up to this size; a larger
# one makes the initializer's work unshareable beyond the one plan (see ``fingerprint``).
_MAX_ARRAY_BYTES = 1 << 20
# Functions of these packages are fingerprinted by code, closure and defaults only: their
# module globals are library code, which does not change while a process runs. A user's
# function is fingerprinted with the module globals it reads, by value.
_LIBRARIES = frozenset(
    {"jax", "jaxlib", "flax", "numpy", "optax", "equinox", "chex", "meshinit", "ml_dtypes"}
)


class _Unhashable(Exception):
    pass


_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None), np.dtype})


class _Walk:
    """One fingerprint's traversal: whether it read anything that may change later."""

    __slots__ = ("mutable",)

    def __init__(self) -> None:
        self.mutable = False  # a container, an array or a user's function was read


def _value(v: Any, depth: int, walk: _Walk) -> Hashable:
    if type(v) in _SCALARS:
        return (type(v), v)
    if isinstance(v, types.FunctionType | functools.partial | types.MethodType):
        return _callable(v, depth + 1, walk)
    if isinstance(v, types.ModuleType | type):
        return (type(v), v)
    if isinstance(v, tuple | frozenset):
        items = sorted(v, key=repr) if isinstance(v, frozenset) else v
        return (type(v), tuple(_value(x, depth + 1, walk) for x in items))
    if isinstance(v, list | set):
        walk.mutable = True
        items = sorted(v, key=repr) if isinstance(v, set) else v
        return (type(v), tuple(_value(x, depth + 1, walk) for x in items))
    if isinstance(v, dict):
        walk.mutable = True
        return (dict, tuple(sorted((k, _value(x, depth + 1, walk)) for k, x in v.items())))
    if isinstance(v, np.ndarray | jax.Array):
        walk.mutable = walk.mutable or isinstance(v, np.ndarray)  # jax's are immutable
        return _array(v)
    try:
        hash(v)
    except TypeError:
        raise _Unhashable from None
    if type(v).__hash__ is object.__hash__ and not _is_library(type(v)):
        # hashed by identity: a user's object whose attributes may change between calls
        raise _Unhashable
    # The type keeps 1, 1.0 and True apart; they hash alike but compute differently.
    return (type(v), v)


def _array(v: Any) -> Hashable:
    """An array by its contents: the bytes of a small one that is all on this host."""
    try:
        if v.nbytes > _MAX_ARRAY_BYTES or (isinstance(v, jax.Array) and not v.is_fully_addressable):
            raise _Unhashable
        a = np.asarray(v)
    except Exception:  # a deleted array, say: no value to fingerprint
        raise _Unhashable from None
    return ("array", str(a.dtype), a.shape, hashlib.blake2b(a.tobytes(), digest_size=16).digest())


def _globals_read(f: types.FunctionType) -> tuple[str, ...]:
    """The names of ``f``'s module globals that its code (nested code too) can read."""
    return tuple(n for n in _names(f.__code__) if n in f.__globals__)


@_caches.memo(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
    return tuple(sorted(names))


def _is_library(f: Any) -> bool:
    return (getattr(f, "__module__", None) or "").partition(".")[0] in _LIBRARIES


def _callable(f: Any, depth: int, walk: _Walk) -> Hashable:
    if depth > _MAX_DEPTH:
        raise _Unhashable
    if isinstance(f, types.FunctionType):
        cells = [_value(_cell(cell), depth, walk) for cell in f.__closure__ or ()]
        kwdefaults = tuple(sorted((f.__kwdefaults__ or {}).items()))
        read: tuple[Any, ...] = ()
        if not _is_library(f):
            # What it reads from its module, by value: the same code in two modules,
            # or a global rebound between calls, computes something else.
            walk.mutable = True
            read = tuple((n, _value(f.__globals__[n], depth, walk)) for n in _globals_read(f))
        return (
            f.__code__,
            tuple(cells),
            _value(f.__defaults__ or (), depth, walk),
            _value(kwdefaults, depth, walk),
            read,
        )
    if isinstance(f, functools.partial):
        kw = tuple(sorted(f.keywords.items()))
        return (
            functools.partial,
            _callable(f.func, depth + 1, walk),
            _value(f.args, depth, walk),
            _value(kw, depth, walk),
        )
    if isinstance(f, types.MethodType):
        return (
            types.MethodType,
            _callable(f.__func__, depth + 1, walk),
            _value(f.__self__, depth, walk),
        )
    return _value(f, depth, walk)


_EMPTY = object()


def initializer_fingerprint(
    init: Callable[..., Any], local: dict[int, Hashable] | None = None
) -> Hashable:
    """A hashable value equal only for initializers that compute the same thing.

    By value: the code, the closure, the defaults and, for a user's function, the module
    globals it reads (dicts, lists and small arrays by their contents), recursively.
    What has no value fingerprint (a large array, an object without a hash) gets
    identity: ``local`` (one plan's) shares it between the specs of that plan, and it is
    never equal to another plan's, so compiled work is never reused across calls for it.
    """
    if isinstance(init, types.FunctionType):
        # Fresh closures from one factory (``lecun_normal()``) usually hold the very
        # same objects; key a memo on their identities, keeping the objects alive in
        # the entry so the ids cannot be reused. Only for initializers that read
        # nothing that can change in place (a dict, an array, a user's module globals).
        contents = (
            *(_cell(c) for c in init.__closure__ or ()),
            *(init.__defaults__ or ()),
            *(init.__kwdefaults__ or {}).values(),
        )
        quick = (init.__code__, tuple(map(id, contents)))
        hit = _QUICK.get(quick)
        if hit is not None:
            return hit[1]
        fp, frozen = _fingerprint(init, local)
        if frozen:
            _QUICK.put(quick, (contents, fp))
        return fp
    return _fingerprint(init, local)[0]


def value_fingerprint(fn: Callable[..., Any]) -> Hashable | None:
    """:func:`fingerprint` of ``fn`` when it is by value, else None.

    None means only ``fn``'s identity could tell what it computes, and identity is
    not sound across calls (what it reads may have changed in place since), so a
    cache keyed on it would serve stale results.
    """
    fp = cast("tuple[Any, ...]", initializer_fingerprint(fn))  # always a tagged tuple
    return fp if fp[0] == "fp" else None


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


def _fingerprint(init: Callable[..., Any], local: dict[int, Hashable] | None) -> tuple:
    """(fingerprint, whether it can be memoized on the identities of what it read)."""
    walk = _Walk()
    try:
        return ("fp", _callable(init, 0, walk)), not walk.mutable
    except (_Unhashable, TypeError, RecursionError):  # TypeError: unorderable dict keys
        if local is None:
            return ("call", init, object()), False
        if id(init) not in local:
            local[id(init)] = ("call", init, object())
        return local[id(init)], False


_CHECKS = _caches.lru("abstract init checks", 4096)
_QUICK = _caches.lru("initializer fingerprints", 4096)


def check_init(
    init: Callable[..., Any], fp: Hashable, shape: tuple[int, ...], dtype: np.dtype
) -> str | None:
    """Abstractly evaluates ``init(key, shape, dtype)``; returns a problem message or None.

    Memoized on ``(fingerprint, shape, dtype)``: ``eval_shape`` costs milliseconds,
    which 10,000 specs cannot each afford.
    """
    memo_key = (fp, shape, dtype)
    if memo_key in _CHECKS:
        return _CHECKS[memo_key]
    problem: str | None
    try:
        out = jax.eval_shape(lambda: init(jax.random.key(0), shape, dtype))
    except Exception as e:  # the user's init failed; report it with the path
        problem = (
            f"init raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
            f"it must be callable as init(key, shape, dtype) -> Array"
        )
    else:
        ok = isinstance(out, jax.ShapeDtypeStruct) and out.shape == shape and out.dtype == dtype
        if ok:
            problem = None
        else:
            got = (
                f"{out.dtype}{list(out.shape)}"
                if isinstance(out, jax.ShapeDtypeStruct)
                else f"a {type(out).__name__}"
            )
            problem = (
                f"init returned {got}, expected {dtype}{list(shape)}; the initializer must "
                f"return one array of the shape and dtype it is given"
            )
    _CHECKS.put(memo_key, problem)
    return problem
