"""``names=`` of :func:`meshinit.safetensors.load`: which target (:mod:`.parts`) fills
each plan path, from a callable, a Mapping or a rule table whose targets' names use the
groups of each rule's regex."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ... import _patterns
from ..._errors import PlanError, Problem, printable
from ..._typos import closest
from ..layout.parts import PARTS, Fill, Pad, Target, Tensor

FORMS = (
    "a callable (path -> target or None), a Mapping of plan paths to those, or a rule "
    "table: a sequence of (regex, target or None) pairs, the first full match winning, "
    "whose names may use the match's groups (\\1); a target is a tensor name, a Tensor, "
    "a Stack, a Concat, a Fill or a Pad"
)

KINDS = "a tensor name, a meshinit.safetensors.Tensor, Stack, Concat, Fill or Pad"


@dataclasses.dataclass(frozen=True)
class _Rule:
    index: int
    pattern: re.Pattern[str]
    target: str | Target | None


def _target(found: Any) -> Target | None | str:
    """A name, a target or None as a target or None; anything else as its type's name."""
    if found is None or isinstance(found, PARTS):
        return found
    if isinstance(found, str):
        return Tensor(found)
    return type(found).__name__


def _rules(names: Sequence[Any]) -> list[_Rule]:
    rules, problems = [], []
    for i, pair in enumerate(names):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            problems.append(Problem("", f"names[{i}] must be a (regex, target) pair; got {pair!r}"))
            continue
        regex, target = pair
        if not (target is None or isinstance(target, (str, *PARTS))):
            kind = type(target).__name__
            problems.append(
                Problem("", f"names[{i}]: the target must be {KINDS}, or None, got {kind}")
            )
            continue
        pattern = _patterns.compile_regex(f"names[{i}]", regex)
        if isinstance(pattern, Problem):
            problems.append(pattern)
        else:
            rules.append(_Rule(i, pattern, target))
    if problems:
        raise PlanError(problems, header="names= is malformed:")
    return rules


def _expand(target: str | Target | None, match: re.Match[str]) -> Target | None:
    """``target`` with every tensor name expanded by the rule's match (``\\1``)."""
    if target is None:
        return None
    if isinstance(target, str):
        return Tensor(match.expand(target))
    if isinstance(target, Tensor):
        return dataclasses.replace(target, name=match.expand(target.name))
    if isinstance(target, Fill):
        return target
    if isinstance(target, Pad):
        part = _expand(target.part, match)
        assert part is not None  # a part is never None
        return dataclasses.replace(target, part=part)
    parts = [_expand(p, match) for p in target.parts]
    return dataclasses.replace(target, parts=tuple(p for p in parts if p is not None))


def targets(
    paths: Sequence[str], names: Any, what: str
) -> tuple[dict[str, Target | None], list[Problem], dict[str, str]]:
    """Each plan path's target (None: not in the files), the problems of a Mapping or
    rule table against the paths, and for each path no rule matched while a rule
    matched no path, a note naming those rules (:func:`linked`).

    A path that a Mapping lacks or that no rule matches is looked up under its own
    name, as with ``names=None``; a rule that matches no path is an
    :class:`~meshinit.UnusedPatternWarning`. A path whose rule's target does not
    expand is that one problem, not looked up (None), so it is not also reported as
    absent from the files."""
    problems: list[Problem] = []
    notes: dict[str, str] = {}
    if names is None:
        return {p: Tensor(p) for p in paths}, [], notes
    if isinstance(names, Mapping):
        known = set(paths)
        for key in names:
            if key not in known:
                close = closest(str(key), paths)
                hint = f"; did you mean {close!r}?" if close else ""
                problems.append(
                    Problem(str(key), f"names maps it, but it is not a plan path{hint}")
                )
        found = {p: _target(names.get(p, p)) for p in paths}
        source = "names[{path!r}] is {kind}"
    elif isinstance(names, Sequence) and not isinstance(names, str | bytes):
        rules = _rules(names)
        used: set[int] = set()
        found = {}
        unmatched = []
        for p in paths:
            found[p] = Tensor(p)
            for rule in rules:
                if m := rule.pattern.fullmatch(p):
                    used.add(rule.index)
                    try:
                        found[p] = _expand(rule.target, m)
                    except (re.error, IndexError) as e:
                        found[p] = None  # this problem, not also "not in the files"
                        problems.append(
                            Problem(
                                p,
                                f"{_patterns.pattern_name('names', rule.index, rule.pattern)}"
                                f": its target does not expand: {e}",
                            )
                        )
                    break
            else:
                unmatched.append(p)
        idle = [
            _patterns.pattern_name("names", r.index, r.pattern)
            for r in rules
            if r.index not in used
        ]
        _patterns.warn_idle(
            what, idle, paths, "plan path", "It maps nothing (every path is matched without it)"
        )
        if idle:
            them = "that regex" if len(idle) == 1 else "those regexes"
            note = (
                f"no rule of names= matched the path, and {' and '.join(idle)} matched no "
                f"plan path (the UnusedPatternWarning): fix {them} to match it"
            )
            notes = dict.fromkeys(unmatched, note)
        source = ""
    elif callable(names):
        found = {p: _target(names(p)) for p in paths}
        source = "names({path!r}) returned {kind}"
    else:
        raise TypeError(f"names must be {FORMS}; got {type(names).__name__}")
    bad = [(p, t) for p, t in found.items() if isinstance(t, str)]
    if bad:
        shown = "; ".join(source.format(path=printable(p), kind=k) for p, k in bad[:3])
        raise TypeError(
            f"{shown}{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''}: each path's "
            f"target must be {KINDS}, or None for a path the files do not hold"
        )
    return {p: t for p, t in found.items() if not isinstance(t, str)}, problems, notes


def linked(problem: Problem, notes: Mapping[str, str]) -> Problem:
    """``problem`` (a path's tensor not in the files) with the note :func:`targets`
    gave its path, if any: the rule meant to map it matched nothing."""
    note = notes.get(problem.path)
    return Problem(problem.path, f"{problem.message}; {note}") if note else problem
