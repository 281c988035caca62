"""``names=`` of :func:`meshinit.safetensors.load`: which stored tensors fill each plan
path, and how: :class:`Tensor` (a slice, a reshape, a transpose and a scale of one
stored tensor), :class:`Stack` and :class:`Concat` (several parts, as ``np.stack`` and
``np.concatenate`` join them), nested as the layout needs."""

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
    "a callable (path -> target or None), a Mapping of plan paths to those, or a rule "
    "table: a sequence of (regex, target or None) pairs, the first full match winning, "
    "whose names may use the match's groups (\\1); a target is a tensor name, a Tensor, "
    "a Stack or a Concat"
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


def _slices(index: Any) -> tuple[slice, ...] | None:
    """``index`` (a slice or a tuple of them, as ``np.s_`` gives) as a tuple of slices;
    TypeError for anything else: an int, an array, a step other than 1, an Ellipsis."""
    if index is None:
        return None
    parts = index if isinstance(index, tuple) else (index,)
    for s in parts:
        bounds = (s.start, s.stop) if isinstance(s, slice) else ()
        if (
            not isinstance(s, slice)
            or s.step not in (None, 1)
            or any(b is not None and (isinstance(b, bool) or not _is_int(b)) for b in bounds)
        ):
            raise TypeError(
                f"Tensor index must be basic slices with a step of 1, one per leading axis "
                f"(np.s_[:4096], np.s_[:, 512:1024]); got {index!r}"
            )
    return tuple(
        slice(*(None if b is None else operator.index(b) for b in (s.start, s.stop))) for s in parts
    )


def _is_int(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A stored tensor, sliced, reshaped, transposed and scaled into a parameter (or a
    part of one, in a :class:`Stack` or :class:`Concat`).

    The parameter is ``stored[index].reshape(shape).transpose(permute)``, as numpy does
    them: ``index`` a basic slice (``np.s_[:4096]``, ``np.s_[:, 512:1024]``: slices with
    a step of 1, one per leading axis, None for the whole tensor), so that one fused
    stored tensor (``qkv_proj``, ``gate_up_proj``) feeds several parameters; ``shape``
    row-major, with at most one ``-1`` for the size the others leave (None keeps the
    shape); then ``permute`` as for ``np.transpose``, negative axes counting from the end
    (None keeps the order). All three are views of the memory-mapped file: only the
    bytes of each shard are read. A slice that the reshape could not view without a
    copy is refused before anything is read.

    ``out_shape`` reshapes the transposed view once more, and may only merge axes
    that are side by side (``(d, heads, head_dim // 2, 2)`` to ``(d, heads,
    head_dim)``): MaxText's interleaved rotary layout is Hugging Face's halves,
    ``Tensor(name, shape=(heads, 2, head_dim // 2, -1), permute=(3, 0, 2, 1),
    out_shape=(d, heads, head_dim))``. Each block is read from the view and merged
    alone; a sharding whose blocks cut a merged axis other than along its outer
    axis is refused before anything is read.

    ``scale`` multiplies the values as MaxText's conversion does (its query scale
    ``1 / sqrt(head_dim)``), with the planned dtype in the role of MaxText's save
    dtype: the stored values are cast to the planned dtype first (rounded once, as
    any tensor is), then, as its hooks compute
    ``(x.astype(np.float32) * np.float32(scale)).astype(x.dtype)``, taken to float32,
    multiplied by ``scale`` rounded to float32, and rounded back to the planned dtype
    (a float64 plan computes in float64). So a float32 tensor planned as bfloat16 is
    rounded twice, as MaxText rounds it. A value that overflows the product or the
    planned dtype is a :class:`~meshinit.PlanError`. Floating-point tensors only.

    A map written for tunix or MaxText transposes first, then reshapes. For a split
    of a torch ``(out, in)`` weight the two agree once the reshape is moved first:
    tunix's ``permute=(1, 0)`` then ``reshape=(d, heads, head_dim)`` of a
    ``(heads * head_dim, d)`` weight is ``Tensor(name, shape=(heads, head_dim, -1),
    permute=(2, 0, 1))``.

    In a rule table of ``names=``, ``name`` may use the groups of the rule's regex
    (``\\1``, ``\\g<layer>``), as :meth:`re.Match.expand` does.

    Attributes:
      name: the tensor's name in the files (``model.layers.0.mlp.up_proj.weight``).
      shape: the shape to reshape the stored tensor (or its slice) to, or None.
      permute: the axis order after the reshape, or None.
      index: the slice of the stored tensor taken first, or None.
      scale: a Python float the values are multiplied by, or None.
      out_shape: the shape the transposed view is reshaped to last, merging axes
        that the transpose left side by side, or None.

    Examples:
      >>> Tensor("model.layers.0.mlp.up_proj.weight", permute=(1, 0))  # (out, in) -> (in, out)
      Tensor(name='model.layers.0.mlp.up_proj.weight', shape=None, permute=(1, 0),
             index=None, scale=None, out_shape=None)
      >>> heads, head_dim = 32, 128
      >>> Tensor("model.layers.0.self_attn.q_proj.weight",
      ...        shape=(heads, head_dim, -1), permute=(-1, 0, 1))
      Tensor(name='model.layers.0.self_attn.q_proj.weight', shape=(32, 128, -1),
             permute=(-1, 0, 1), index=None, scale=None, out_shape=None)
      >>> Tensor("model.layers.0.mlp.gate_up_proj.weight", index=np.s_[:14336]).index  # gate half
      (slice(None, 14336, None),)
    """

    name: str
    shape: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    permute: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    index: tuple[slice, ...] | None = dataclasses.field(default=None, kw_only=True)
    scale: float | None = dataclasses.field(default=None, kw_only=True)
    out_shape: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Tensor name must be a str, got {self.name!r}")
        shape, permute = _ints(self.shape, "shape"), _ints(self.permute, "permute")
        object.__setattr__(self, "index", _slices(self.index))
        if self.scale is not None:
            if isinstance(self.scale, bool) or not isinstance(self.scale, int | float):
                raise TypeError(f"Tensor scale must be a Python float, got {self.scale!r}")
            if not math.isfinite(self.scale):
                raise ValueError(f"Tensor scale must be finite, got {self.scale!r}")
            object.__setattr__(self, "scale", float(self.scale))
        if shape is not None:
            if sum(d == -1 for d in shape) > 1 or any(d < -1 for d in shape):
                raise ValueError(
                    f"Tensor shape {shape}: sizes are non-negative, with at most one -1 "
                    f"(inferred, as numpy's reshape)"
                )
        out_shape = _ints(self.out_shape, "out_shape")
        if out_shape is not None and any(d < 0 for d in out_shape):
            raise ValueError(f"Tensor out_shape {out_shape}: sizes are non-negative")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "permute", permute)
        object.__setattr__(self, "out_shape", out_shape)

    def sliced(self, stored: tuple[int, ...]) -> tuple[slice, ...]:
        """``index`` over every axis of a stored tensor of shape ``stored``, each slice's
        bounds resolved as numpy resolves them; ValueError where numpy would refuse it."""
        index = self.index or ()
        if len(index) > len(stored):
            raise ValueError(f"index has {len(index)} slices for {len(stored)} axes")
        padded = index + (slice(None),) * (len(stored) - len(index))
        return tuple(slice(*s.indices(n)[:2]) for s, n in zip(padded, stored, strict=True))

    def transformed(self, stored: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shape of the reshape (its ``-1`` resolved) and the transpose's axis order
        (negative axes resolved), for a stored tensor (after ``index``) of shape
        ``stored``; ValueError saying why where numpy would refuse them."""
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


def _part(part: Any, kind: str, i: int) -> Tensor | Stack | Concat:
    if isinstance(part, str):
        return Tensor(part)
    if isinstance(part, Tensor | Stack | Concat):
        return part
    raise TypeError(
        f"{kind} parts[{i}] must be a tensor name, a Tensor, a Stack or a Concat, got "
        f"{type(part).__name__}"
    )


def _joined(self: Stack | Concat) -> None:
    kind = type(self).__name__
    parts = self.parts
    if isinstance(parts, str | bytes) or not isinstance(parts, Sequence) or not parts:
        raise TypeError(f"{kind} parts must be a non-empty sequence of parts, got {parts!r}")
    if isinstance(self.axis, bool) or not _is_int(self.axis):
        raise TypeError(f"{kind} axis must be an int, got {self.axis!r}")
    object.__setattr__(self, "parts", tuple(_part(p, kind, i) for i, p in enumerate(parts)))
    object.__setattr__(self, "axis", operator.index(self.axis))


@dataclasses.dataclass(frozen=True)
class Stack:
    """Parts stacked along a new axis into one parameter, as ``np.stack`` does: every
    layer's stored tensor in the layer axis of a scanned model.

    Each part is a tensor name, a :class:`Tensor` or a nested :class:`Stack` or
    :class:`Concat`, and all must give the same shape. ``axis`` counts as in
    ``np.stack`` (negative from the end of the result). Each device reads only its own
    shard of each part it holds: a device whose shard spans layers 0-3 of a 16-layer
    stack reads its block of those four stored tensors, and nothing of the others.

    In a rule table, the parts' names may use the groups of the rule's regex.

    Attributes:
      parts: the parts, in order (names are read as ``Tensor(name)``).
      axis: the new axis.

    Examples:
      >>> n = 4  # MaxText's scanned query kernel: [embed, layers, heads, head_dim]
      >>> Stack([Tensor(f"model.layers.{i}.self_attn.q_proj.weight",
      ...               shape=(8, 64, -1), permute=(2, 0, 1)) for i in range(n)], axis=1).axis
      1
    """

    parts: tuple[Tensor | Stack | Concat, ...]
    axis: int

    def __post_init__(self) -> None:
        _joined(self)


@dataclasses.dataclass(frozen=True)
class Concat:
    """Parts concatenated along an existing axis into one parameter, as
    ``np.concatenate`` does: k and v into a fused ``kv_einsum``, gate and up into
    ``gating_einsum``.

    Each part is a tensor name, a :class:`Tensor` or a nested :class:`Stack` or
    :class:`Concat`; the parts agree on every axis but ``axis`` (negative from the
    end). Each device reads only the parts, and the bytes of each, that its shard holds.

    Attributes:
      parts: the parts, in order (names are read as ``Tensor(name)``).
      axis: the axis they are joined along.

    Examples:
      >>> Concat(["model.layers.0.mlp.gate_proj.weight",
      ...         "model.layers.0.mlp.up_proj.weight"], axis=0).parts[1].name
      'model.layers.0.mlp.up_proj.weight'
    """

    parts: tuple[Tensor | Stack | Concat, ...]
    axis: int

    def __post_init__(self) -> None:
        _joined(self)


Target = Tensor | Stack | Concat
"""What fills one plan path: a stored tensor, or parts of several."""


def leaves(target: Target) -> list[Tensor]:
    """Every :class:`Tensor` of ``target``, in order."""
    if isinstance(target, Tensor):
        return [target]
    return [t for part in target.parts for t in leaves(part)]


@dataclasses.dataclass(frozen=True)
class _Rule:
    index: int
    pattern: re.Pattern[str]
    target: str | Target | None


def _target(found: Any) -> Target | None | str:
    """A name, a target or None as a target or None; anything else as its type's name."""
    if found is None or isinstance(found, Tensor | Stack | Concat):
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
        if not (target is None or isinstance(target, str | Tensor | Stack | Concat)):
            problems.append(
                Problem(
                    "",
                    f"names[{i}]: the target must be a tensor name, a "
                    f"meshinit.safetensors.Tensor, Stack or Concat, or None, got "
                    f"{type(target).__name__}",
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


def _expand(target: str | Target | None, match: re.Match[str]) -> Target | None:
    """``target`` with every tensor name expanded by the rule's match (``\\1``)."""
    if target is None:
        return None
    if isinstance(target, str):
        return Tensor(match.expand(target))
    if isinstance(target, Tensor):
        return dataclasses.replace(target, name=match.expand(target.name))
    parts = [_expand(p, match) for p in target.parts]
    return dataclasses.replace(target, parts=tuple(p for p in parts if p is not None))


def targets(
    paths: Sequence[str], names: Any, what: str
) -> tuple[dict[str, Target | None], list[Problem]]:
    """Each plan path's target (None: not in the files), and the problems of a
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
                        found[p] = _expand(rule.target, m)
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
            f"target must be a tensor name, a meshinit.safetensors.Tensor, Stack or "
            f"Concat, or None for a path the files do not hold"
        )
    return {p: t for p, t in found.items() if not isinstance(t, str)}, problems
