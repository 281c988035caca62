"""``placements=`` given as a tree of shardings, read into the same per-path placements a
table gives (:class:`~.parsed.Parsed`), and checked alike.

A tree (:class:`Tree`) is a pytree of ``NamedSharding`` / ``PartitionSpec`` / None
  (replicated) leaves shaped like the model's variables: what
  ``nnx.get_partition_spec(nnx.state(abstract))``, ``nn.get_partition_spec`` of linen's
  variables, an equinox Module of specs or ``jax.eval_shape`` plus a strategy gives
  (kauldron, flax's own recipes). Its leaves are found by the same dot-joined paths
  as the model's variables; a variable without a leaf, or a leaf without a variable,
  is an error, never a silent default.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ... import _paths
from ..._errors import Problem
from ..._format import some
from .forms import Placements
from .parsed import Parsed, given, not_an_array

TREE = "the placements tree"


def spec_leaf(x: Any) -> bool:
    """Whether ``x`` is a leaf of a tree of shardings."""
    return x is None or isinstance(x, PartitionSpec | NamedSharding)


def _shards(value: Any) -> bool:
    spec = value.spec if isinstance(value, NamedSharding) else value
    return isinstance(spec, PartitionSpec) and any(e is not None for e in spec)


class Tree(Placements):
    """A tree of shardings: each variable's leaf at its own path."""

    def __init__(self, tree: Any) -> None:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=spec_leaf)
        self.leaves: dict[str, Any] = {}
        for keypath, leaf in flat:
            self.leaves.setdefault(_paths.path_str(keypath), leaf)
        self._seen: set[str] = set()
        self._problems: list[Problem] = []

    def match(self, path: str, struct: Any = None) -> Parsed | None:
        """The placement the tree's leaf at ``path`` gives, or None where it has none."""
        self._seen.add(path)
        if path not in self.leaves:
            return None  # said once, for every path the tree lacks, by finish
        placed = given(TREE, self.leaves[path], "give it a NamedSharding in the tree")
        if isinstance(placed, str):
            self._problems.append(Problem(path, f"{TREE}: {placed}"))
            return Parsed(TREE, None, False, None, None, broken=True)
        return placed

    def lacks(self, path: str) -> bool:
        return path not in self.leaves

    def refuse(self, others: Iterable[tuple[str, Any]], paths: Sequence[str] = ()) -> list[Problem]:
        """A variable holding no array whose leaf shards it cannot be placed; a
        replicated leaf (None, ``P()``) leaves it as it is."""
        problems = []
        for path, value in others:
            self._seen.add(path)
            if _shards(self.leaves.get(path)):
                problems.append(not_an_array(path, TREE, value, "give it None in the tree"))
        return problems

    def finish(
        self, what: str, paths: Sequence[str], keeps: str, others: Iterable[tuple[str, Any]] = ()
    ) -> list[Problem]:
        problems = self.refuse(others) + self._problems
        missing = [p for p in paths if p not in self.leaves]
        # None is also an empty subtree (a field set to None): as a leaf where the
        # model has nothing, it places nothing
        unknown = [p for p in self.leaves if p not in self._seen]
        extra = [p for p in unknown if self.leaves[p] is not None]
        hint = _regex_hint(unknown)
        if missing:
            problems.append(
                Problem(
                    "",
                    f"{TREE} has no leaf for {len(missing)} variable(s): {some(missing, 8)}; "
                    f"give it the model's structure, with None for a replicated variable"
                    f"{_prefix_hint(missing, extra)}{hint}",
                )
            )
        if extra:
            problems.append(
                Problem(
                    "",
                    f"{TREE} has {len(extra)} leaf(s) at paths that are no variable's: "
                    f"{some(extra, 8)}; the variables' paths are like {', '.join(paths[:3])}"
                    f"{'' if missing else hint}",
                )
            )
        return problems


def _prefix_hint(missing: Sequence[str], extra: Sequence[str]) -> str:
    """Where the tree's paths are the variables' paths with a prefix more or less (a
    linen tree of ``variables["params"]``), which prefix."""
    if not missing or not extra:
        return ""
    for short, long, says in ((extra, missing, "lack"), (missing, extra, "add")):
        ends = [p for p in long if p.endswith("." + short[0])]
        if ends:
            prefix = ends[0][: -len(short[0])]
            if all(prefix + p in set(long) for p in short):
                return f" (its paths {says} the prefix {prefix!r})"
    return ""


def _regex_hint(extra: Sequence[str]) -> str:
    """Where the tree's keys look like regexes: a table given as a dict."""
    if not any(c in p for p in extra for c in "*+?[]()|^$\\"):
        return ""
    return (
        "; a table of regexes is a list of (regex, axes) tuples, in order (the first match "
        "wins), not a dict"
    )
