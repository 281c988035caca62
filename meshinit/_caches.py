"""Every cache meshinit keeps, in one registry that :func:`clear_all` empties.

meshinit memoizes compiled executables, initializer fingerprints, abstract init
checks, rule resolutions, partitions and host programs, each bounded. Each cache is
made through this module (:class:`LRUCache`, :func:`memo`, :func:`weak`), so that
:func:`clear_cache` (``meshinit.clear_cache()``) empties all of them and a test can
list them. Nothing here changes values: an empty cache only means the next call
computes again.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_registry: list[tuple[str, Any]] = []  # (name, the cache object)
_guards: dict[int, Any] = {}  # id(cache) -> the lock its users hold to change it
_registry_lock = threading.Lock()


class LRUCache(collections.OrderedDict):
    """A dict that keeps the ``maxsize`` most recently put entries."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize

    def put(self, key: Hashable, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


def _register(name: str, cache: Any) -> None:
    with _registry_lock:
        _registry.append((name, cache))


def lru(name: str, maxsize: int, lock: Any = None) -> LRUCache:
    """A registered :class:`LRUCache`; :func:`clear_cache` empties it holding ``lock``,
    the lock its users hold (compiles put executables from threads)."""
    cache = LRUCache(maxsize)
    _register(name, cache)
    if lock is not None:
        with _registry_lock:
            _guards[id(cache)] = lock
    return cache


def memo(maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered."""

    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _register(f"{fn.__module__}.{fn.__qualname__}", cached)
        return cached  # type: ignore[return-value]

    return wrap


def weak(name: str) -> weakref.WeakKeyDictionary:
    """A registered ``weakref.WeakKeyDictionary`` (entries also go with their keys)."""
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _register(name, cache)
    return cache


def size(cache: Any) -> int:
    """How many entries ``cache`` holds."""
    if hasattr(cache, "cache_info"):
        return cache.cache_info().currsize
    return len(cache)


def registered() -> list[tuple[str, Any]]:
    """Every cache, by name."""
    with _registry_lock:
        return list(_registry)


def clear_cache() -> None:
    """Empties every cache meshinit keeps (each is otherwise kept, bounded).

    Compiled executables (the spec path's, the constructor engine's, the optimizer
    state's), initializer fingerprints and abstract init checks, rule resolutions and
    partitions, and host programs. The next call computes again; values do not change.

    Examples:
      >>> meshinit.clear_cache()  # e.g. to measure a cold materialize again
    """
    for _, cache in registered():
        with _guards.get(id(cache)) or contextlib.nullcontext():
            if hasattr(cache, "cache_clear"):
                cache.cache_clear()
            else:
                cache.clear()
