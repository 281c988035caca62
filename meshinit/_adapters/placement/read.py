"""``placements=`` read in any form: one reader for the three adapters (nnx, linen,
eqx). :func:`parse` tells a table of patterns (:mod:`.table`), a tree of shardings
(:mod:`.tree`) and a rule (:mod:`.rule`) apart, and reads it into the
:class:`~.forms.Placements` that gives each path its :class:`~.parsed.Parsed`
placement, with every malformed entry."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax

from ... import _patterns
from ..._errors import Problem
from .forms import Placements
from .parsed import described
from .rule import Rule
from .table import FORMS, Table, read_table
from .tree import Tree, spec_leaf


def parse(placements: Any) -> tuple[Placements, list[Problem]]:
    """The placements of ``placements`` (None: an empty table), in any form, and every
    malformed entry. A sequence is a table where an entry is led by a regex, else a
    tree of shardings (the spec tree of a model that is a list of layers).

    Raises:
      TypeError: ``placements`` is none of the forms.
    """
    if placements is None:
        return Table(()), []
    if isinstance(placements, _patterns.Searched):
        return read_table(placements.rules, placements)
    if isinstance(placements, str | bytes):
        raise TypeError(
            f"placements must be an ordered sequence of {FORMS} tuples (first match wins), a "
            f"tree of shardings or a callable; got {type(placements).__name__}"
        )
    if isinstance(placements, Sequence):
        if _is_tree(placements):  # a model that is a list of layers: its tree is a list
            return Tree(placements), []
        return read_table(placements, None)
    if callable(placements) and _is_leaf(placements):
        return Rule(placements), []
    return Tree(placements), []


def _is_table_entry(entry: Any) -> bool:
    """Whether ``entry`` is meant as a table's entry: a sequence led by a regex (or a
    bare regex, an entry not wrapped in its tuple), well formed or not."""
    if isinstance(entry, str | bytes | re.Pattern):
        return True
    return (
        isinstance(entry, tuple | list)
        and bool(entry)
        and isinstance(entry[0], str | bytes | re.Pattern)
    )


def _is_tree(placements: Sequence[Any]) -> bool:
    """Whether a sequence is a tree of shardings (the spec tree of a model that is a
    list or tuple), not a table: no entry is led by a regex, and its leaves hold a
    sharding. A sequence that is neither is refused, naming both forms.

    Raises:
      TypeError: ``placements`` is neither a table nor a tree of shardings.
    """
    if not placements or any(_is_table_entry(e) for e in placements):
        return False
    flat = jax.tree_util.tree_flatten_with_path(placements, is_leaf=spec_leaf)[0]
    if any(spec_leaf(leaf) for _, leaf in flat):
        return True
    keypath, leaf = flat[0] if flat else ((), placements[0])
    raise TypeError(
        f"placements is a {type(placements).__name__} of neither table entries nor "
        f"shardings: a table is an ordered sequence of {FORMS} tuples (first match wins); "
        f"a tree of shardings has the model's structure with a NamedSharding, "
        f"PartitionSpec or None per array; this one holds {described(leaf)} at "
        f"placements{jax.tree_util.keystr(keypath) or '[0]'}"
    )


def _is_leaf(value: Any) -> bool:
    """Whether ``value`` is one leaf to jax (a function), not a tree (an eqx Module of
    shardings is callable, and a tree)."""
    if isinstance(value, jax.tree_util.Partial):
        return True
    leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda x: x is None)
    return len(leaves) == 1 and leaves[0] is value
