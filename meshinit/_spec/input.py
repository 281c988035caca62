"""What planning refuses before resolving anything, each as a problem naming its path:
trees jax cannot flatten (nested past the recursion limit, dicts with keys of mixed
types), paths that cannot be hashed (a lone surrogate), and shapes past int64, which
XLA would abort the process on."""

from __future__ import annotations

import math
from typing import Any

import jax

from .._errors import PlanError, Problem
from .spec import ParamSpec

_INT64_MAX = 2**63 - 1


def encodable(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``tree_flatten_with_path``, with what makes jax fail there as a PlanError.

    jax raises a nanobind ``SystemError`` (caused by a ``RecursionError``) when a tree
    is nested past what CPython lets C code recurse, and "Comparator raised exception"
    for a dict whose keys cannot be sorted; both are found again here, by a walk that
    needs no recursion, and named by path.
    """
    try:
        return jax.tree_util.tree_flatten_with_path(tree)
    except (RecursionError, SystemError, ValueError, TypeError) as e:
        problem = _tree_problem(tree, recursed=_recursed(e))
        if problem is None:
            raise
        raise PlanError([problem], header="cannot plan this tree:") from e


# A RecursionError from a tree shallower than this was not jax walking the levels (a
# pytree node's own flatten recursing, say): CPython stops C recursion at no fewer than
# about 1000 levels by default, so flattening fails only past several hundred.
_DEEP = 100


def _recursed(error: BaseException) -> bool:
    """Whether ``error`` is, or was caused by, a RecursionError: the nanobind
    ``SystemError`` that jax's flatten raises has the RecursionError as its cause."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, RecursionError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _keys(link: tuple[Any, str] | None) -> list[str]:
    """The keys of a path kept as ``(parent link, key)`` links, root first."""
    keys = []
    while link is not None:
        link, key = link
        keys.append(key)
    return keys[::-1]


def _tree_problem(tree: Any, *, recursed: bool) -> Problem | None:
    """The first dict with unsortable keys, else, if jax's flatten ran out of recursion,
    the deepest path.

    How deep jax can flatten depends on the Python: up to ``sys.getrecursionlimit()``
    levels on 3.11, and on 3.12 a fixed limit of C recursion (about 1500 levels) that
    the recursion limit does not change. So the depth is not compared with a limit:
    the RecursionError says jax could not reach the bottom. Paths are kept as links to
    their parent, so a tree thousands of levels deep is walked in linear time.
    """
    deepest: tuple[int, tuple[Any, str] | None] = (0, None)
    stack: list[tuple[int, tuple[Any, str] | None, Any]] = [(0, None, tree)]
    while stack:
        depth, link, node = stack.pop()
        if depth > deepest[0]:
            deepest = (depth, link)
        if isinstance(node, dict):
            try:
                items = sorted(node.items())
            except TypeError:
                kinds = sorted({type(k).__name__ for k in node})
                where = "" if link is not None else "the top-level dict: "
                return Problem(
                    ".".join(_keys(link)),
                    f"{where}a dict whose keys mix types ({', '.join(kinds)}), which jax "
                    f"cannot order; use keys of one type (all str, say)",
                )
            stack.extend((depth + 1, (link, str(k)), v) for k, v in reversed(items))
        elif isinstance(node, list | tuple):
            children = reversed(list(enumerate(node)))
            stack.extend((depth + 1, (link, str(i)), v) for i, v in children)
    depth, link = deepest
    if not recursed or depth < _DEEP:
        return None
    return Problem(
        ".".join(_keys(link)[:8]) + ".<...>",
        f"the tree is nested {depth} levels deep here, too deep for jax to flatten (it "
        f"recurses once per level and ran out of Python's recursion limit); flatten the "
        f"structure (a list of layers, not a chain of nested dicts)",
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
