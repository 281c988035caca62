"""flax nnx's logical axis rules checked as the core checks a spec's: a name no rule maps,
and a rule that names a mesh axis the mesh lacks, in the core's words
(:mod:`meshinit._spec.rules`), so that nnx, linen, equinox and the spec path say one
thing for one mistake.

nnx resolves a Variable's names itself (``nnx.spmd.get_var_pspec``: a name with a rule
becomes the rule's mesh axes, on any mesh; a name without one passes through as a mesh
axis), so what reaches the planner are mesh axes, and the rule that produced a wrong
one would be lost: it is found here, before.

nnx applies each name's rule without looking at the others, so two names of one
Variable can land on one mesh axis (MaxText's ``embed_attn`` and ``gdn_head`` both on
``fsdp_transpose``); jax refuses that sharding, and so flax nnx's own init does
(:func:`shared`). MaxText's own NNX init resolves the names as flax linen does, which
skips a rule whose axes an earlier one took: a table marked ``as_linen``
(``meshinit.maxtext.rules``) resolves that way (:func:`linen_resolved`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec

from .._errors import Problem
from .._spec import rules as _rules


def _names(sharding: Sequence[Any]) -> list[str]:
    return [
        n for e in sharding for n in (e if isinstance(e, tuple) else (e,)) if isinstance(n, str)
    ]


def unruled(meta: dict[str, Any], sharding: Sequence[Any], mesh: Any) -> list[str]:
    """With ``sharding_rules`` (or flax's context rules), one message per name in the
    ``sharding`` that no rule maps and the mesh does not have: flax would pass it
    through as a mesh axis, and the planner would then say only that the mesh lacks it."""
    local = meta.get("sharding_rules")
    context = flax_spmd.get_logical_axis_rules()
    if not local and not context:
        return []
    ruled = {r[0] for r in (*(context or ()), *(local or ()))}
    axes = tuple(mesh.axis_names)
    missing = [n for n in dict.fromkeys(_names(sharding)) if n not in ruled and n not in axes]
    given = "its sharding_rules" if local else "flax's logical axis rules"
    where = f" in its sharding {tuple(sharding)}"
    return [_rules.no_rule_message(n, ruled, where, axes, f" in {given}") for n in missing]


@dataclasses.dataclass(frozen=True)
class RuleMiss(Problem):
    """A rule that resolved one of a Variable's names to a mesh axis its mesh lacks;
    worded by :func:`settle` once every Variable's mesh is known."""

    rule: _rules.Rule = ("", None)
    axis: str = ""
    mesh_axes: tuple[str, ...] = ()


def misses(meta: dict[str, Any], sharding: Sequence[Any], path: str, mesh: Any) -> list[RuleMiss]:
    """The rules, as flax's ``get_var_pspec`` picks them (the context rules and the
    Variable's ``sharding_rules`` composed, the last rule for a name winning), that map
    a name of ``sharding`` to a mesh axis ``mesh`` lacks."""
    local = meta.get("sharding_rules")
    context = flax_spmd.get_logical_axis_rules()
    if not local and not context:
        return []
    table = dict(flax_spmd.composite_rules(context, local or ()))
    axes = tuple(mesh.axis_names)
    found = []
    for name in dict.fromkeys(n for n in sharding if isinstance(n, str)):
        if name not in table:
            continue
        target = table[name]
        target = tuple(target) if isinstance(target, list) else target
        wanted = () if target is None else (target,) if isinstance(target, str) else target
        lacking = [a for a in wanted if a not in axes]
        if lacking:
            found.append(RuleMiss(path, "", (name, target), lacking[0], axes))
    return found


def as_linen(meta: dict[str, Any]) -> bool:
    """Whether the rules in effect for a Variable (flax's context table, or its own
    ``sharding_rules``) resolve its names as flax linen does (``NotedRules.as_linen``)."""
    tables = (flax_spmd.get_logical_axis_rules(), meta.get("sharding_rules"))
    return any(_rules.resolves_as_linen(t) for t in tables)


def linen_resolved(
    meta: dict[str, Any], sharding: Sequence[Any], ndim: int, path: str, mesh: Any
) -> tuple[tuple[Any, ...], list[Problem]]:
    """A Variable's names resolved as MaxText's NNX init resolves them: flax linen's
    ``logical_to_mesh_axes`` of the names (padded with None to ``ndim``) under the
    Variable's ``sharding_rules`` followed by the context table. Returns the entries,
    or ``()`` and the problems: a name no rule maps (linen would replicate it; the
    core refuses it), a name given twice (linen raises), a rule it picks that names an
    axis the mesh lacks (a :class:`RuleMiss`)."""
    local = meta.get("sharding_rules") or ()
    context = flax_spmd.get_logical_axis_rules() or ()
    table = _rules.normalize_rules((*local, *context))
    names = (*sharding, *(None,) * (ndim - len(sharding)))
    known = {n for n, _ in table}
    given = "its sharding_rules and the rules" if local else "the rules"
    where = f" in its sharding {tuple(sharding)}"
    problems: list[Problem] = [
        Problem(path, _rules.no_rule_message(n, known, where, None, f" in {given}"))
        for n in dict.fromkeys(_names(names))
        if n not in known
    ]
    twice = sorted({n for n in _names(names) if _names(names).count(n) > 1})
    if twice:
        problems.append(
            Problem(
                path,
                f"logical axis name(s) {', '.join(map(repr, twice))} appear more than once "
                f"in its sharding {tuple(sharding)}; a mesh axis can shard only one "
                f"dimension: give each dimension its own name",
            )
        )
    if problems:
        return (), problems
    entries = _rules.logical_to_mesh_axes(names, table)  # flax's pick: nothing skipped
    axes = tuple(mesh.axis_names)
    for name, entry in zip(names, entries, strict=True):
        lacking = [a for a in _names((entry,)) if a not in axes]
        if lacking:
            problems.append(RuleMiss(path, "", (name, entry), lacking[0], axes))
    return (() if problems else entries), problems


def shared(sharding: Sequence[Any], pspec: Sequence[Any], path: str) -> list[Problem]:
    """A problem where flax nnx's resolution ``pspec`` of the names ``sharding`` puts
    one mesh axis on two dimensions: jax refuses that sharding (``DuplicateSpecError``,
    raised by flax nnx's own init and ``nnx.get_named_sharding``), and meshinit does
    not guess another."""
    dims: dict[str, list[int]] = {}
    for dim, entry in enumerate(pspec):
        for axis in dict.fromkeys(_names((entry,))):
            dims.setdefault(axis, []).append(dim)
    twice = {a: d for a, d in dims.items() if len(d) > 1}
    if not twice:
        return []
    names = (*sharding, *(None,) * (len(pspec) - len(sharding)))
    where = "; ".join(
        f"mesh axis {a!r} on dimensions " + " and ".join(f"{d} ({names[d]!r})" for d in ds)
        for a, ds in twice.items()
    )
    return [
        Problem(
            path,
            f"its logical axes {tuple(sharding)} resolve, as flax nnx resolves them (each "
            f"name's last rule, whatever the others took), to {PartitionSpec(*pspec)}: "
            f"{where}. jax refuses a mesh axis on two dimensions (flax nnx's own init "
            f"raises DuplicateSpecError), and meshinit does not guess a placement. "
            f"MaxText's own NNX init resolves the names as flax linen does, skipping a "
            f"rule whose mesh axes an earlier dimension took: for a MaxText model pass "
            f"rules=meshinit.maxtext.rules(config, nnx.eval_shape(factory)), which "
            f"resolves them so; otherwise change the rules so that no two of these "
            f"names map to one mesh axis",
        )
    ]


def settle(problems: Iterable[Problem], meshes: Iterable[Any]) -> list[Problem]:
    """``problems`` with each :class:`RuleMiss` worded as the core words it.

    A rule whose axis no mesh of the plan has is said once, at its first Variable, as
    :func:`meshinit._spec.rules.missing_axis_problems` says it for the other paths. A
    rule whose axis another mesh has is said at each Variable whose mesh lacks it:
    unlike linen's algorithm, nnx does not skip a rule on a mesh without its axes.
    """
    problems = list(problems)
    known = list(
        dict.fromkeys(
            [a for m in meshes for a in m.axis_names]
            + [a for p in problems if isinstance(p, RuleMiss) for a in p.mesh_axes]
        )
    )
    out: list[Problem] = []
    said: set[_rules.Rule] = set()
    for p in problems:
        if not isinstance(p, RuleMiss):
            out.append(p)
        elif p.axis in known:
            out.append(
                Problem(p.path, _rules.rule_axis_message(p.rule, p.axis, known, p.mesh_axes))
            )
        elif p.rule not in said:
            said.add(p.rule)
            out.append(Problem(p.path, _rules.rule_axis_message(p.rule, p.axis, known)))
    return out
