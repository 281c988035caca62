"""flax nnx's logical axis rules checked as the core checks a spec's: a name no rule maps,
and a rule that names a mesh axis the mesh lacks, in the core's words
(:mod:`meshinit._spec.rules`), so that nnx, linen, equinox and the spec path say one
thing for one mistake.

nnx resolves a Variable's names itself (``nnx.spmd.get_var_pspec``: a name with a rule
becomes the rule's mesh axes, on any mesh; a name without one passes through as a mesh
axis), so what reaches the planner are mesh axes, and the rule that produced a wrong
one would be lost: it is found here, before."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from flax.core import spmd as flax_spmd

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
