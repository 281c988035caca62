"""``names=`` of :func:`meshinit.safetensors.load`: which stored tensor fills each plan
path, and how (:class:`Tensor`: a reshape, then a transpose, as numpy does them)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _patterns
from .._errors import PlanError, Problem, printable

FORMS = (
    "a callable (path -> name, Tensor or None), a Mapping of plan paths to those, or a "
    "rule table: a sequence of (regex, name or Tensor or None) pairs, the first full "
    "match winning, whose names may use the match's groups (\\1)"
)


def _ints(value: Any, what: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        out = tuple(operator.index(v) for v in value)
    except TypeError:
        raise TypeError(f"Tensor {what} must be a sequence of ints, got {value!r}") from None
    if any(isinstance(v, bool) for v in value):
        raise TypeError(f"Tensor {what} must be a sequence of ints, got {value!r}")
    return out


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A stored tensor, reshaped then transposed into a parameter.

    The parameter is ``stored.reshape(shape).transpose(permute)``, as numpy does them:
    ``shape`` row-major, with at most one ``-1`` for the size the others leave (None
    keeps the stored shape); then ``permute`` as for ``np.transpose``, negative axes
    counting from the end (None keeps the order). Both are views of the memory-mapped
    file: only the bytes of each shard are read.

    A map written for tunix or MaxText transposes first, then reshapes. For a split
    of a torch ``(out, in)`` weight the two agree once the reshape is moved first:
    tunix's ``permute=(1, 0)`` then ``reshape=(d, heads, head_dim)`` of a
    ``(heads * head_dim, d)`` weight is ``Tensor(name, shape=(heads, head_dim, -1),
    permute=(2, 0, 1))``.

    In a rule table of ``names=``, ``name`` may use the groups of the rule's regex
    (``\\1``, ``\\g<layer>``), as :meth:`re.Match.expand` does.

    Attributes:
      name: the tensor's name in the files (``model.layers.0.mlp.up_proj.weight``).
      shape: the shape to reshape the stored tensor to, or None.
      permute: the axis order after the reshape, or None.

    Examples:
      >>> Tensor("model.layers.0.mlp.up_proj.weight", permute=(1, 0))  # (out, in) -> (in, out)
      Tensor(name='model.layers.0.mlp.up_proj.weight', shape=None, permute=(1, 0))
      >>> heads, head_dim = 32, 128
      >>> Tensor("model.layers.0.self_attn.q_proj.weight",
      ...        shape=(heads, head_dim, -1), permute=(-1, 0, 1))
      Tensor(name='model.layers.0.self_attn.q_proj.weight', shape=(32, 128, -1),
             permute=(-1, 0, 1))
    """

    name: str
    shape: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    permute: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Tensor name must be a str, got {self.name!r}")
        shape, permute = _ints(self.shape, "shape"), _ints(self.permute, "permute")
        if shape is not None:
            if sum(d == -1 for d in shape) > 1 or any(d < -1 for d in shape):
                raise ValueError(
                    f"Tensor shape {shape}: sizes are non-negative, with at most one -1 "
                    f"(inferred, as numpy's reshape)"
                )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "permute", permute)

    def transformed(self, stored: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shape of the reshape (its ``-1`` resolved) and the transpose's axis order
        (negative axes resolved), for a stored tensor of shape ``stored``; ValueError
        saying why where numpy would refuse them."""
        size = math.prod(stored)
        shape = stored
        if self.shape is not None:
            known = math.prod(d for d in self.shape if d != -1)
            if -1 in self.shape:
                if known == 0 or size % known:
                    raise ValueError(f"cannot be reshaped from {stored} to {self.shape}")
                shape = tuple(size // known if d == -1 else d for d in self.shape)
            elif known != size:
                raise ValueError(f"cannot be reshaped from {stored} to {self.shape}")
            else:
                shape = self.shape
        n = len(shape)
        if self.permute is None:
            return shape, tuple(range(n))
        order = tuple(a + n if a < 0 else a for a in self.permute)
        if sorted(order) != list(range(n)):
            raise ValueError(f"permute={self.permute} is not an order of {n} axes")
        return shape, order


@dataclasses.dataclass(frozen=True)
class _Rule:
    index: int
    pattern: re.Pattern[str]
    target: str | Tensor | None


def _target(found: Any) -> Tensor | None | str:
    """A name, a Tensor or None as a Tensor or None; anything else as its type's name."""
    if found is None or isinstance(found, Tensor):
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
        if not (target is None or isinstance(target, str | Tensor)):
            problems.append(
                Problem(
                    "",
                    f"names[{i}]: the target must be a tensor name, a "
                    f"meshinit.safetensors.Tensor or None, got {type(target).__name__}",
                )
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


def _expand(rule: _Rule, match: re.Match[str]) -> Tensor | None:
    if rule.target is None:
        return None
    if isinstance(rule.target, str):
        return Tensor(match.expand(rule.target))
    return dataclasses.replace(rule.target, name=match.expand(rule.target.name))


def targets(
    paths: Sequence[str], names: Any, what: str
) -> tuple[dict[str, Tensor | None], list[Problem]]:
    """Each plan path's stored tensor (None: not in the files), and the problems of a
    Mapping or rule table against the paths. A path that a Mapping lacks or that no
    rule matches is looked up under its own name, as with ``names=None``; a rule that
    matches no path is an :class:`~meshinit.UnusedPatternWarning`."""
    problems: list[Problem] = []
    if names is None:
        return {p: Tensor(p) for p in paths}, []
    if isinstance(names, Mapping):
        known = set(paths)
        for key in names:
            if key not in known:
                close = difflib.get_close_matches(str(key), paths, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append(
                    Problem(str(key), f"names maps it, but it is not a plan path{hint}")
                )
        found = {p: _target(names.get(p, p)) for p in paths}
        source = "names[{path!r}] is {kind}"
    elif isinstance(names, Sequence) and not isinstance(names, str | bytes):
        rules = _rules(names)
        used: set[int] = set()
        found = {}
        for p in paths:
            found[p] = Tensor(p)
            for rule in rules:
                if m := rule.pattern.fullmatch(p):
                    used.add(rule.index)
                    try:
                        found[p] = _expand(rule, m)
                    except (re.error, IndexError) as e:
                        problems.append(
                            Problem(
                                p,
                                f"{_patterns.pattern_name('names', rule.index, rule.pattern)}"
                                f": its target does not expand: {e}",
                            )
                        )
                    break
        idle = [
            _patterns.pattern_name("names", r.index, r.pattern)
            for r in rules
            if r.index not in used
        ]
        _patterns.warn_idle(
            what, idle, paths, "plan path", "It maps nothing (every path is matched without it)"
        )
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
            f"target must be a tensor name, a meshinit.safetensors.Tensor, or None for a "
            f"path the files do not hold"
        )
    return {p: t for p, t in found.items() if not isinstance(t, str)}, problems
