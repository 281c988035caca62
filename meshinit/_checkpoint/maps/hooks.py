"""MaxText's conversion hooks followed on :class:`~.trace.Sym` stand-ins: the numpy
front-end of :mod:`.trace` (:mod:`.traced` is the jax one).

MaxText's hooks are small numpy programs ``hook(x, target_shape)``: a transpose and a
reshape, a slice, a scale, a pad. Each runs as written, as a copy of the function
whose ``np``, ``jnp`` and ``jax`` names are this module's namespaces (:func:`rebound`),
so that stand-ins go through :mod:`.trace` and everything else through numpy: nothing
of numpy or jax is patched. What no target expresses raises
:class:`~.trace.Inexpressible` naming it, and the map is refused.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..layout import parts as _names
from .framework import MissingKey
from .trace import Inexpressible, Sym, concatenate, filled, picked, stack, target


def _same(x: Any, dtype: Any = None, **kwargs: Any) -> Any:
    """``np.asarray`` and its kin: a stand-in as it is (cast, where a dtype is given),
    anything else numpy's own."""
    if isinstance(x, Sym):
        return x if dtype is None else x.astype(dtype)
    return np.array(x, dtype=dtype, **kwargs)


def _split(x: Any, sections: Any, axis: int = 0) -> Any:
    """``np.split``: a stand-in's slices along ``axis`` (anything else numpy's own)."""
    if not isinstance(x, Sym):
        return np.split(x, sections, axis)
    axis = axis % x.ndim
    n = x.shape[axis]
    if isinstance(sections, int | np.integer):
        if sections <= 0 or n % sections:
            raise ValueError(f"array split does not divide {n} into {sections} equal parts")
        bounds = [n // sections * i for i in range(1, sections)]
    else:
        bounds = [int(b) for b in sections]
    edges = [0, *bounds, n]
    before = (slice(None),) * axis
    pairs = zip(edges[:-1], edges[1:], strict=True)  # numpy's own slices, as numpy cuts
    return [x[(*before, slice(a, b))] for a, b in pairs]


class _Numpy(types.SimpleNamespace):
    """numpy (and jax.numpy) as a hook sees it: stand-ins go through the functions
    here; everything else is numpy's own."""

    def __init__(self, real: Any):
        super().__init__(
            stack=stack,
            concatenate=concatenate,
            concat=concatenate,
            split=_split,
            zeros=lambda shape, dtype=None, **_: filled(shape, 0, dtype),
            ones=lambda shape, dtype=None, **_: filled(shape, 1, dtype),
            full=lambda shape, value, dtype=None, **_: filled(shape, value, dtype),
            asarray=_same,
            array=_same,
            ascontiguousarray=_same,
            zeros_like=lambda x, dtype=None, **_: filled(x.shape, 0, dtype or x.dtype),
            ones_like=lambda x, dtype=None, **_: filled(x.shape, 1, dtype or x.dtype),
        )
        self._real = real

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._real, name)
        if not callable(found) or isinstance(found, type):
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else None
            if isinstance(first, Sym):
                method = getattr(first, name, None)
                if method is None:
                    raise Inexpressible(f"np.{name}")
                return method(*args[1:], **kwargs)
            if any(isinstance(a, Sym) for a in (*args, *kwargs.values())):
                raise Inexpressible(f"np.{name} with the tensor")
            return found(*args, **kwargs)

        return call


NUMPY = _Numpy(np)


class _Jax(types.SimpleNamespace):
    def __init__(self) -> None:
        import jax

        super().__init__(numpy=NUMPY)
        self._real = jax

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def rebound(
    fn: Callable[..., Any], spaces: Mapping[str, Any] | None = None, _depth: int = 0
) -> Callable[..., Any]:
    """A copy of the hook ``fn`` whose ``np``, ``jnp`` and ``jax`` are this module's
    (or ``spaces``: name -> what the copy sees under it), and so are those of the
    functions its closure holds: numpy and jax untouched."""
    if not isinstance(fn, types.FunctionType):
        raise Inexpressible(f"a hook that is not a Python function ({type(fn).__name__})")
    names = spaces or {"np": NUMPY, "jnp": NUMPY, "numpy": NUMPY, "jax": _Jax()}
    scope = {**fn.__globals__, **{k: v for k, v in names.items() if k in fn.__globals__}}
    cells = None
    if fn.__closure__ and _depth < 4:
        cells = tuple(_cell(c, names, _depth + 1) for c in fn.__closure__)
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _cell(cell: Any, spaces: Mapping[str, Any], depth: int) -> Any:
    """A closure cell, with the functions it holds (alone, or in a list or tuple, as
    a chain of hooks) rebound."""
    try:
        held = cell.cell_contents
    except ValueError:  # an empty cell
        return cell
    if isinstance(held, types.FunctionType):
        return types.CellType(rebound(held, spaces, depth))
    if isinstance(held, list | tuple) and any(isinstance(h, types.FunctionType) for h in held):
        fns = [rebound(h, spaces, depth) if isinstance(h, types.FunctionType) else h for h in held]
        return types.CellType(type(held)(fns))
    return cell


def followed(hooks: Any, x: Any, target_shape: Any, part: int | None = None) -> _names.Target:
    """The target that ``hooks`` (a hook, a list applied in order, or None) make of
    ``x`` (a stand-in, or a tuple of them), as MaxText's ``apply_hook_fns`` runs them;
    where ``part`` is given, of its result's ``[..., part]`` (a composite key's member)."""
    if hooks is None:
        return target(x) if part is None else picked(x, part)
    for hook in hooks if isinstance(hooks, list) else [hooks]:
        try:
            x = rebound(hook)(x, target_shape)
        except (Inexpressible, MissingKey):  # a config key the file lacks: named as such
            raise
        except Exception as e:  # noqa: BLE001 - what the hook did instead, named
            raise Inexpressible(f"{type(e).__name__}: {str(e)[:200]}") from e
    return target(x) if part is None else picked(x, part)
