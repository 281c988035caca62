"""Logical axis names to mesh axes: flax linen's rule algorithm, made strict.

A rule table is an ordered sequence of ``(logical_name, mesh_axes)`` pairs, where
``mesh_axes`` is a mesh axis name, a tuple of them, or None (replicated). This is the
format of flax linen and MaxText, and :func:`logical_to_mesh_axes` resolves it
exactly as ``flax.linen.logical_to_mesh_axes`` does, with one departure: a rule whose
mesh axes are not all in the mesh is skipped, so one table can serve several meshes
(pipeline stages of different shapes). A rule that names an axis of no mesh of the
plan is an error, as it is in flax (:func:`missing_axis_problems`). :func:`partition`
adds the checks linen does not make.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Self

from .. import _caches
from .._typos import closest

AxisEntry = str | tuple[str, ...] | None
Rule = tuple[str, str | tuple[str, ...] | None]
Rules = tuple[Rule, ...]

_UNASSIGNED = object()


class NotedRules(tuple):
    """A rule table that says why some logical names' rules are what they are:
    ``notes`` maps a name to the reason (``meshinit.maxtext.rules`` completes MaxText's
    table with ``(name, None)`` and notes "replicated: MaxText's rules have no
    entry"). It resolves as the plain table does; the plan's reports list the notes of
    the names its parameters use.

    ``as_linen``: flax nnx Variables' names resolve as flax linen's
    ``logical_to_mesh_axes`` resolves them (:func:`logical_to_mesh_axes`: the first
    rule that fits wins, and a rule whose mesh axes an earlier one took is skipped), as
    MaxText's own NNX init does (its ``sharding.get_nnx_var_named_sharding_with_scan_axis``).
    Without it nnx's names resolve as flax nnx's ``get_var_pspec`` does (the last rule of
    a name wins, nothing skipped). Specs and linen resolve as linen either way."""

    notes: Mapping[str, str]
    as_linen: bool

    def __new__(
        cls, table: Any, notes: Mapping[str, str] | None = None, as_linen: bool = False
    ) -> Self:
        made = super().__new__(cls, table)
        made.notes = dict(notes or {})
        made.as_linen = as_linen
        return made


def resolves_as_linen(rules: Any) -> bool:
    """Whether ``rules`` is a :class:`NotedRules` table whose nnx names resolve as
    flax linen resolves them."""
    return bool(getattr(rules, "as_linen", False))


def rule_notes(axes: Any, rules: Any) -> dict[str, str]:
    """The notes of a :class:`NotedRules` table for the logical
    names in ``axes`` (a name, or a tuple of names, per dimension)."""
    notes = getattr(rules, "notes", None)
    if not notes or axes is None:
        return {}
    names = [n for a in axes if a is not None for n in ((a,) if isinstance(a, str) else a)]
    return {n: notes[n] for n in names if n in notes}


def normalize_rules(rules: Any) -> Rules:
    """Checks a rule table and returns it as a tuple of pairs (lists become tuples).

    Raises:
      TypeError: the table is not a sequence of ``(name, mesh_axes)`` pairs.
    """
    if isinstance(rules, NotedRules):  # the notes travel with the checked table
        return NotedRules(_normalize(rules), rules.notes, rules.as_linen)
    if type(rules) is tuple:  # every spec under one defaults() passes the same table
        try:
            return _normalize_hashable(rules)
        except TypeError as e:
            if "unhashable" not in str(e):
                raise
    return _normalize(rules)


@_caches.memo(maxsize=256)
def _normalize_hashable(rules: tuple[Any, ...]) -> Rules:
    return _normalize(rules)


def _normalize(rules: Any) -> Rules:
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise TypeError(
            f"rules must be a sequence of (logical_name, mesh_axes) pairs, got {rules!r}"
        )
    out: list[Rule] = []
    for rule in rules:
        ok = isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)
        target = rule[1] if ok else None
        if ok and isinstance(target, tuple | list):
            ok = all(isinstance(a, str) for a in target) and len(set(target)) == len(target)
            target = tuple(target)
        elif ok:
            ok = target is None or isinstance(target, str)
        if not ok:
            raise TypeError(
                f"bad rule {rule!r}: a rule is (logical_name, mesh_axes) where mesh_axes is "
                f"a mesh axis name, a tuple of distinct names, or None"
            )
        out.append((rule[0], target))
    return tuple(out)


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def logical_to_mesh_axes(
    axes: Sequence[str | None],
    rules: Any,
    mesh_axis_names: Sequence[str] | None = None,
) -> tuple[AxisEntry, ...]:
    """Resolves logical axis names to PartitionSpec entries, as flax linen does.

    Going down ``rules``, a rule ``(name, mesh_axes)`` assigns ``mesh_axes`` to the
    dimension called ``name`` if that dimension is still unassigned and none of those
    mesh axes is already used by this parameter. Unassigned dimensions are replicated.
    As in linen, a ``(name, None)`` rule always claims a still unassigned dimension.

    Args:
      axes: one logical name (or None) per dimension, without duplicates.
      rules: a rule table: a sequence of ``(logical_name, mesh_axes)`` pairs, tuples or
        lists (as MaxText's YAML gives them).
      mesh_axis_names: when given, rules naming an axis outside it are skipped.

    Returns:
      One PartitionSpec entry per dimension: a mesh axis name, a tuple of them, or
      None (replicated).

    Examples:
      >>> meshinit.logical_to_mesh_axes(("embed", "mlp"),
      ...     (("mlp", "tensor"), ("embed", "tensor"), ("embed", "fsdp")))
      ('fsdp', 'tensor')
    """
    names = None if mesh_axis_names is None else tuple(mesh_axis_names)
    return _resolve(tuple(axes), normalize_rules(rules), names)


@_caches.memo(maxsize=4096)
def _resolve(
    axes: tuple[AxisEntry, ...], rules: Rules, mesh_axis_names: tuple[str, ...] | None
) -> tuple[AxisEntry, ...]:
    result: list[Any] = [_UNASSIGNED if isinstance(a, str) else a for a in axes]
    for name, target in rules:
        if name not in axes:
            continue
        if mesh_axis_names is not None and target is not None:
            if any(a not in mesh_axis_names for a in _as_tuple(target)):
                continue
        pos = axes.index(name)
        if result[pos] is not _UNASSIGNED:
            continue
        used = {u for r in result for u in _as_tuple(r) if isinstance(u, str)}
        if target is None or used.isdisjoint(_as_tuple(target)):
            result[pos] = target
    return tuple(None if r is _UNASSIGNED else r for r in result)


def partition(
    shape: tuple[int, ...],
    axes: tuple[AxisEntry, ...] | None,
    rules: Rules | None,
    mesh_shape: Mapping[str, int],
    logical: tuple[Any, ...] | None = None,
) -> tuple[tuple[AxisEntry, ...], list[str]]:
    """Resolves a spec's axes to full-length PartitionSpec entries and checks them.

    Args:
      shape: the parameter shape.
      axes: the spec's axes; None means fully replicated.
      rules: a rule table, or None when ``axes`` name mesh axes directly.
      mesh_shape: mesh axis name to size.
      logical: the dimensions' logical names (``ParamSpec.logical_names``); with
        rules, ``axes`` are those names. A message names a dimension's as the spec
        path does, whichever path resolved it.

    Returns:
      ``(entries, problems)``: one entry per dimension, and a message for each problem
      found (empty when the spec is valid).
    """
    if axes is None:
        return (None,) * len(shape), []
    if len(axes) != len(shape):
        return (), [
            f"axes {axes} have {len(axes)} entries but shape {shape} has {len(shape)} "
            f"dimensions; give one entry (a name or None) per dimension"
        ]
    problems: list[str] = []
    names = [a for a in axes if isinstance(a, str)]
    dups = sorted(n for n, c in Counter(names).items() if c > 1)
    if dups:
        problems.append(
            f"axis name(s) {', '.join(map(repr, dups))} appear more than once in axes {axes}; "
            f"a mesh axis can shard only one dimension"
        )
    if rules is None:
        entries = axes
        flat = [a for e in axes if e is not None for a in _as_tuple(e)]
        missing = [a for a in dict.fromkeys(flat) if a not in mesh_shape]
        if missing:
            guess = _guesses(missing, list(mesh_shape))
            problems.append(
                f"mesh axis name(s) {', '.join(map(repr, missing))} not in the mesh "
                f"(axes: {', '.join(mesh_shape)}); {guess + ' otherwise use' if guess else 'use'} "
                f"a mesh axis, or pass rules to map logical names"
            )
        twice = sorted(a for a, c in Counter(flat).items() if c > 1 and a not in dups)
        if twice:
            problems.append(
                f"mesh axis {', '.join(map(repr, twice))} used by more than one dimension "
                f"in {axes}; each mesh axis can shard only one dimension"
            )
    else:
        tuples = [e for e in axes if isinstance(e, tuple)]
        if tuples:
            problems.append(
                f"axes entry {tuples[0]} is a tuple, but with rules each entry is one logical "
                f"name or None; map the name to several mesh axes in the rules instead"
            )
        known = {name for name, _ in rules}
        unknown = [n for n in dict.fromkeys(names) if n not in known]
        problems += [no_rule_message(n, known) for n in unknown]
        if problems:
            return (), problems
        entries = _resolve(tuple(axes), rules, tuple(mesh_shape))
    if problems:
        return (), problems
    for dim, (size, entry) in enumerate(zip(shape, entries, strict=True)):
        if entry is None:
            continue
        ways = math.prod(mesh_shape[a] for a in _as_tuple(entry))
        if size % ways:
            name = _logical(axes if rules is not None else logical, dim)
            problems.append(
                f"dimension {dim}{name} of size {size} is not divisible by mesh axes "
                f"{entry!r} of size {ways}; pad the dimension or map it to other mesh axes"
            )
    return entries, problems


def _logical(names: tuple[Any, ...] | None, dim: int) -> str:
    """`` (logical 'mlp')``, how a message names a dimension's logical name, if any."""
    if names is None or dim >= len(names) or names[dim] is None:
        return ""
    return f" (logical {names[dim]!r})"


def missing_axis_problems(
    uses: Sequence[tuple[str, tuple[AxisEntry, ...], Rules]], mesh_axes: Sequence[str]
) -> list[tuple[str, str]]:
    """Rules that a spec uses whose mesh axes are in none of the plan's meshes.

    "Uses" as flax resolves the spec without a mesh: the rule flax's algorithm picks
    for a logical name. flax then builds a ``PartitionSpec`` naming the missing axis,
    which jax refuses, so flax's own path fails on it; meshinit would skip the rule and
    quietly replicate, or take a later one. A rule whose axis is on another mesh of
    the plan is still skipped on a mesh that lacks it: that is how one table serves
    pipeline stages of different shapes.

    Args:
      uses: ``(path, axes, rules)`` of each spec planned with rules.
      mesh_axes: every axis name of every mesh of the plan.

    Returns:
      ``(path, message)`` per rule, once, at the first spec that uses it.
    """
    known = list(dict.fromkeys(mesh_axes))
    found: dict[Rule, tuple[str, str]] = {}
    for path, axes, rules in uses:
        chosen = _resolve(tuple(axes), rules, None)  # flax's pick, with no mesh to skip by
        for name, target in zip(axes, chosen, strict=True):
            if not isinstance(name, str) or target is None or (name, target) in found:
                continue
            missing = [a for a in _as_tuple(target) if a not in known]
            if not missing:
                continue
            found[(name, target)] = (path, rule_axis_message((name, target), missing[0], known))
    return list(found.values())


def rule_axis_message(rule: Rule, axis: str, known: Sequence[str], mesh: Sequence[str] = ()) -> str:
    """The one wording of a rule that names a mesh axis its parameter cannot use: the
    spec path's, linen's, equinox's and nnx's (:func:`missing_axis_problems`).

    Args:
      rule: the rule, as the table has it.
      axis: the first of its mesh axes that is missing.
      known: the axes of every mesh of the plan.
      mesh: where another mesh of the plan has ``axis`` but the parameter's own does
        not (nnx applies a rule on every mesh), that mesh's axes; else empty.
    """
    where = (
        f"which its mesh lacks (axes: {', '.join(mesh)}; another mesh of the plan has it)"
        if mesh
        else f"which is in none of the plan's meshes (axes: {', '.join(known)})"
    )
    # the likely name first: dropping the rule would replicate what it shards
    guess = _guesses([axis], mesh or known)
    fixes = (
        f"{guess} otherwise add the axis to the mesh"
        if guess
        else "fix the axis name, add the axis to the mesh"
    )
    return (
        f"rule {rule!r} names mesh axis {axis!r}, {where}; flax would build a "
        f"PartitionSpec jax refuses, and meshinit does not guess a placement instead: "
        f"{fixes}, or drop the rule"
    )


def no_rule_message(
    name: str,
    known: Any,
    where: str = "",
    mesh_axes: Sequence[str] | None = None,
    searched: str = "",
) -> str:
    """The one wording of a logical name that no rule maps, with the likely typo first.

    Args:
      name: the logical name.
      known: the names the rules map.
      where: what holds the name, as `` in its sharding (...)``; empty for a spec.
      mesh_axes: where a name without a rule would be read as a mesh axis (flax nnx's
        metadata), the mesh's axes, which the name is not one of.
      searched: which rules were searched, as `` in flax's logical axis rules``.
    """
    head = f"logical axis {name!r}{where} has no rule{searched}"
    if mesh_axes is not None:
        head += f" and is not a mesh axis (axes: {', '.join(mesh_axes)})"
    names = ", ".join(sorted(known)) or "(none)"
    close = closest(name, [*sorted(known), *(mesh_axes or ())])
    if close:
        return (
            f"{head}; did you mean {close!r}? (known: {names}); fix the name, or add "
            f"({name!r}, None) to the rules to replicate it"
        )
    return f"{head}; known: {names}; add ({name!r}, None) to the rules to replicate it"


def _guesses(names: Sequence[str], candidates: Sequence[str]) -> str:
    """``"did you mean 'tensor'?"`` for the names that look like typos of a candidate
    (``"did you mean 'tensor' for 'tensr'?"`` when several names are missing)."""
    pairs = [(n, c) for n in names if (c := closest(n, candidates)) is not None]
    if not pairs:
        return ""
    if len(names) == 1:
        return f"did you mean {pairs[0][1]!r}?"
    return "did you mean " + ", ".join(f"{c!r} for {n!r}" for n, c in pairs) + "?"


def shard_options(shape, spec, mesh) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``(replicated axis, dimensions it could shard)`` pairs, in mesh order.

    See ``PlanEntry.shard_dims`` for the rule. Memoized: a deep model repeats a handful
    of (shape, spec, mesh) many times.
    """
    entries = (*spec, *(None,) * (len(shape) - len(spec)))
    used: set[str] = set()
    ways = []
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    for e in entries:
        names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        used.update(names)
        ways.append(math.prod(sizes[a] for a in names))
    empty = math.prod(shape) == 0
    return tuple(
        (axis, () if empty else tuple(d for d, n in enumerate(shape) if n % (ways[d] * size) == 0))
        for axis, size in sizes.items()
        if size > 1 and axis not in used
    )
