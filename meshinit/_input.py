"""What planning refuses before resolving anything, each as a problem naming its path:
trees jax cannot flatten (nested past the recursion limit, dicts with keys of mixed
types), paths that cannot be hashed (a lone surrogate), and shapes past int64, which
XLA would abort the process on."""

from __future__ import annotations

import math
import sys
from typing import Any

import jax

from ._errors import PlanError, Problem
from ._spec import ParamSpec

_INT64_MAX = 2**63 - 1


def encodable(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``tree_flatten_with_path``, with what makes jax fail there as a PlanError.

    jax raises a nanobind ``SystemError`` past the recursion limit and "Comparator
    raised exception" for a dict whose keys cannot be sorted; both are found again
    here, by a walk that needs no recursion, and named by path.
    """
    try:
        return jax.tree_util.tree_flatten_with_path(tree)
    except (RecursionError, SystemError, ValueError, TypeError) as e:
        problem = _tree_problem(tree)
        if problem is None:
            raise
        raise PlanError([problem], header="cannot plan this tree:") from e


def _tree_problem(tree: Any) -> Problem | None:
    """The first dict with unsortable keys, else the deepest path if jax cannot reach it."""
    limit = sys.getrecursionlimit()
    deepest: tuple[str, ...] = ()
    stack: list[tuple[tuple[str, ...], Any]] = [((), tree)]
    while stack:
        keys, node = stack.pop()
        if len(keys) > len(deepest):
            deepest = keys
        if isinstance(node, dict):
            try:
                items = sorted(node.items())
            except TypeError:
                kinds = sorted({type(k).__name__ for k in node})
                where = "" if keys else "the top-level dict: "
                return Problem(
                    ".".join(keys),
                    f"{where}a dict whose keys mix types ({', '.join(kinds)}), which jax "
                    f"cannot order; use keys of one type (all str, say)",
                )
            stack.extend(((*keys, str(k)), v) for k, v in reversed(items))
        elif isinstance(node, list | tuple):
            stack.extend(((*keys, str(i)), v) for i, v in reversed(list(enumerate(node))))
    if len(deepest) < limit // 2:
        return None
    return Problem(
        ".".join(deepest[:8]) + ".<...>",
        f"the tree is nested {len(deepest)} levels deep here, too deep for jax to flatten "
        f"under Python's recursion limit ({limit}); flatten the structure (a list of "
        f"layers, not a chain of nested dicts)",
    )


def overflow(spec: ParamSpec) -> str | None:
    """Why ``spec`` cannot exist: its element or byte count overflows int64, which
    XLA's extents must fit (it aborts the process, not raises, past that)."""
    elements = math.prod(spec.shape)
    if elements > _INT64_MAX or elements * spec.dtype.itemsize > _INT64_MAX:
        return (
            f"shape {spec.shape} has {elements:.3e} elements ({spec.dtype.name}): more "
            f"than an array can hold (the element and byte counts must fit in int64); "
            f"check the shape"
        )
    return None
