"""Cheap, sound fingerprints of initializers, and the memoized abstract init check.

Initializers are usually fresh closures (``lecun_normal()`` returns a new function on
every call), so identity alone cannot tell that two specs share an initializer. Two
functions with the same code object, closure values and defaults compute the same
thing; their fingerprints are equal. Anything whose closure holds an unhashable
value (an array, say) falls back to identity, which is always sound.

Planning uses the fingerprint to run ``jax.eval_shape`` once per distinct (init,
shape, dtype), and materialization uses it to deduplicate compiled work.
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

_MAX_DEPTH = 6


class _Unhashable(Exception):
    pass


_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None), np.dtype})


def _value(v: Any, depth: int) -> Hashable:
    if type(v) in _SCALARS:
        return (type(v), v)
    if isinstance(v, types.FunctionType | functools.partial | types.MethodType):
        return _callable(v, depth + 1)
    if isinstance(v, tuple | list):
        return (type(v), tuple(_value(x, depth + 1) for x in v))
    if isinstance(v, dict):
        return (dict, tuple(sorted((k, _value(x, depth + 1)) for k, x in v.items())))
    try:
        hash(v)
    except TypeError:
        raise _Unhashable from None
    # The type keeps 1, 1.0 and True apart; they hash alike but compute differently.
    return (type(v), v)


def _callable(f: Any, depth: int) -> Hashable:
    if depth > _MAX_DEPTH:
        raise _Unhashable
    if isinstance(f, types.FunctionType):
        cells = [_value(_cell(cell), depth) for cell in f.__closure__ or ()]
        kwdefaults = tuple(sorted((f.__kwdefaults__ or {}).items()))
        return (
            f.__code__,
            tuple(cells),
            _value(f.__defaults__ or (), depth),
            _value(kwdefaults, depth),
        )
    if isinstance(f, functools.partial):
        kw = tuple(sorted(f.keywords.items()))
        return (
            functools.partial,
            _callable(f.func, depth + 1),
            _value(f.args, depth),
            _value(kw, depth),
        )
    if isinstance(f, types.MethodType):
        return (types.MethodType, _callable(f.__func__, depth + 1), _value(f.__self__, depth))
    return _value(f, depth)


_EMPTY = object()


def fingerprint(init: Callable[..., Any]) -> Hashable:
    """A hashable value equal for initializers that compute the same thing."""
    if isinstance(init, types.FunctionType):
        # Fresh closures from one factory (``lecun_normal()``) usually hold the very
        # same objects; key a memo on their identities, keeping the objects alive in
        # the entry so the ids cannot be reused.
        contents = (
            *(_cell(c) for c in init.__closure__ or ()),
            *(init.__defaults__ or ()),
            *(init.__kwdefaults__ or {}).values(),
        )
        quick = (init.__code__, tuple(map(id, contents)))
        hit = _QUICK.get(quick)
        if hit is not None:
            return hit[1]
        fp = _fingerprint(init)
        _QUICK.put(quick, (contents, fp))
        return fp
    return _fingerprint(init)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


def _fingerprint(init: Callable[..., Any]) -> Hashable:
    try:
        return ("fp", _callable(init, 0))
    except (_Unhashable, TypeError):  # TypeError: e.g. unorderable dict keys
        return ("id", init)


class LRUCache(collections.OrderedDict):
    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize

    def put(self, key: Hashable, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


_CHECKS = LRUCache(4096)
_QUICK = LRUCache(4096)


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
