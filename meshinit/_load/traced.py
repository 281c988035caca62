"""A framework's layout code, followed without data, read back as ``names=`` targets.

A framework's checkpoint map may rearrange stored tensors with code of its own: tunix
transposes and reshapes each tensor as its map says, then its preprocess step stacks
experts and fuses q, k and v (``jnp.stack``, ``jnp.transpose``). Here a stored tensor
is a :class:`Stored` node (its name, shape and the transposes and reshapes taken so
far); :func:`permuted` and :func:`reshaped` follow one step; :func:`trace` runs a
function of a dict of arrays on abstract values (jax traces it: no data) and follows
each equation of its jaxpr; :func:`target` gives the :class:`~.names.Tensor`,
:class:`~.names.Stack` or :class:`~.names.Concat` that reads the same values from the
files, or says which operation no target can express. A chain of transposes and
reshapes becomes one ``Tensor``: every axis is cut into the factors the reshapes need
(``shape``), the factors are put in the final order (``permute``) and merged into the
final axes (``out_shape``); a reshape that cuts a factor unevenly has no such form.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .. import _caches
from .._jax import compat as _compat
from .._jax import jaxpr as _jaxpr
from .parts import Concat, Stack, Target, Tensor


@dataclasses.dataclass(frozen=True)
class Stored:
    """A stored tensor after ``ops``: ``("transpose", order)`` and ``("reshape", shape)``
    in the order taken; ``shape`` is the result's."""

    name: str
    stored: tuple[int, ...]
    shape: tuple[int, ...]
    ops: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class Joined:
    """Parts stacked along a new axis (``stack``) or concatenated along an existing one."""

    stack: bool
    parts: tuple[Node, ...]
    axis: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Refused:
    """A value no target can express, and why."""

    why: str
    shape: tuple[int, ...]


Node = Stored | Joined | Refused


def stored(name: str, shape: Sequence[int]) -> Stored:
    """The stored tensor ``name`` of ``shape``, as it is in the files."""
    shape = tuple(int(d) for d in shape)
    return Stored(name, shape, shape)


def permuted(node: Node, axes: Sequence[int]) -> Node:
    """``node`` transposed as ``np.transpose(x, axes)``; ValueError where numpy refuses."""
    n = len(node.shape)
    order = tuple(int(a) + n if int(a) < 0 else int(a) for a in axes)
    if sorted(order) != list(range(n)):
        raise ValueError(f"axes {tuple(axes)} are not an order of its {n} axes")
    shape = tuple(node.shape[a] for a in order)
    if order == tuple(range(n)):
        return node
    if isinstance(node, Refused):
        return Refused(node.why, shape)
    if isinstance(node, Stored):
        return dataclasses.replace(node, shape=shape, ops=(*node.ops, ("transpose", order)))
    a = node.axis
    if node.stack:  # the parts' axes are the node's without the stacked one
        inner = tuple(p - (p > a) for p in order if p != a)
        parts = tuple(permuted(p, inner) for p in node.parts)
    else:
        parts = tuple(permuted(p, order) for p in node.parts)
    return Joined(node.stack, parts, order.index(a), shape)


def reshaped(node: Node, shape: Sequence[int]) -> Node:
    """``node`` reshaped as numpy's row-major ``reshape`` (one ``-1`` allowed);
    ValueError where numpy refuses. Of joined parts, only unit axes may come or go."""
    new = _resolved(node.shape, tuple(int(d) for d in shape))
    if new == node.shape:
        return node
    if isinstance(node, Refused):
        return Refused(node.why, new)
    if isinstance(node, Stored):
        return dataclasses.replace(node, shape=new, ops=(*node.ops, ("reshape", new)))
    old = node.shape
    kept_old = [i for i, d in enumerate(old) if d != 1]
    kept_new = [i for i, d in enumerate(new) if d != 1]
    if [old[i] for i in kept_old] != [new[i] for i in kept_new] or old[node.axis] == 1:
        kind = "stacked" if node.stack else "concatenated"
        return Refused(f"a reshape of {kind} parts from {old} to {new}", new)
    b = kept_new[kept_old.index(node.axis)]
    if node.stack:
        parts = tuple(reshaped(p, new[:b] + new[b + 1 :]) for p in node.parts)
    else:
        parts = tuple(
            reshaped(p, new[:b] + (p.shape[node.axis],) + new[b + 1 :]) for p in node.parts
        )
    return Joined(node.stack, parts, b, new)


def _resolved(old: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, ...]:
    size = math.prod(old)
    if new.count(-1) > 1 or any(d < -1 for d in new):
        raise ValueError(f"cannot reshape {old} to {new}")
    if -1 in new:
        known = math.prod(d for d in new if d != -1)
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape {old} to {new}")
        new = tuple(size // known if d == -1 else d for d in new)
    if math.prod(new) != size:
        raise ValueError(f"cannot reshape {old} to {new}")
    return new


def stacked(nodes: Sequence[Node], axis: int) -> Node:
    """``np.stack(nodes, axis)``."""
    shape = nodes[0].shape
    n = len(shape) + 1
    axis = axis + n if axis < 0 else axis
    if any(x.shape != shape for x in nodes) or not 0 <= axis < n:
        raise ValueError(f"cannot stack shapes {[x.shape for x in nodes]} along axis {axis}")
    return Joined(True, tuple(nodes), axis, shape[:axis] + (len(nodes),) + shape[axis:])


def concatenated(nodes: Sequence[Node], axis: int) -> Node:
    """``np.concatenate(nodes, axis)``: unit slices (as ``np.stack`` makes them) as a
    stack, and a concatenation of stacks along their own axis as one stack (jax
    concatenates at most 16 operands at a time)."""
    n = len(nodes[0].shape)
    axis = axis + n if axis < 0 else axis
    shape = list(nodes[0].shape)
    shape[axis] = sum(x.shape[axis] for x in nodes)
    if all(x.shape[axis] == 1 for x in nodes):
        return stacked([reshaped(x, x.shape[:axis] + x.shape[axis + 1 :]) for x in nodes], axis)
    flat: list[Node] = []
    for x in nodes:
        joined = isinstance(x, Joined) and not x.stack and x.axis == axis
        flat += x.parts if isinstance(x, Joined) and joined else [x]
    if all(isinstance(x, Joined) and x.stack and x.axis == axis for x in flat):
        parts = tuple(p for x in flat if isinstance(x, Joined) for p in x.parts)
        return Joined(True, parts, axis, tuple(shape))
    return Joined(False, tuple(flat), axis, tuple(shape))


def tensors(node: Node) -> list[str]:
    """The names of the stored tensors ``node`` reads, in order."""
    if isinstance(node, Stored):
        return [node.name]
    if isinstance(node, Joined):
        return [name for p in node.parts for name in tensors(p)]
    return []


def target(node: Node) -> Target | str:
    """The target that reads ``node``'s values from the files, or why there is none."""
    if isinstance(node, Refused):
        return node.why
    if isinstance(node, Stored):
        return _view(node)
    parts = []
    for p in node.parts:
        t = target(p)
        if isinstance(t, str):
            return t
        parts.append(t)
    return Stack(tuple(parts), node.axis) if node.stack else Concat(tuple(parts), node.axis)


def _view(leaf: Stored) -> Tensor | str:
    """``leaf``'s transposes and reshapes as one reshape, transpose and merge."""
    form = _form(leaf.stored, leaf.ops, leaf.shape)
    if isinstance(form, str):
        return f"{leaf.name}: {form}"
    shape, permute, out_shape = form
    return Tensor(leaf.name, shape=shape, permute=permute, out_shape=out_shape)


Form = tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[int, ...] | None]


@_caches.memo(maxsize=4096)  # one per kind of tensor: a model repeats them per layer
def _form(
    stored: tuple[int, ...], ops: tuple[tuple[str, tuple[int, ...]], ...], result: tuple[int, ...]
) -> Form | str:
    """``Tensor``'s ``(shape, permute, out_shape)`` for ``ops`` on a stored tensor of
    shape ``stored``, or why there is none."""
    sizes: list[int] = []  # factor number -> size
    order: list[int] = []  # factors as the stored tensor's row-major order has them

    def factor(size: int) -> int:
        sizes.append(size)
        return len(sizes) - 1

    if 0 in stored:
        return f"a tensor of no elements {stored}"
    axes: list[list[int]] = []  # each axis of the value so far as its factors
    for d in stored:
        axes.append([] if d == 1 else [factor(d)])
        order += axes[-1]
    for op, arg in ops:
        if op == "transpose":
            axes = [axes[i] for i in arg]
            continue
        seq = [f for ax in axes for f in ax]
        i, new = 0, []
        for r in arg:
            group, have = [], 1
            while have < r:
                need, s = r // have, sizes[seq[i]]
                if r % have or (s > need and s % need):
                    steps = ", ".join(f"{op} {arg}" for op, arg in ops)
                    return (
                        f"the reshape to {arg} cuts an axis of size {s} unevenly "
                        f"(after {steps}): no slice-free reshape and transpose gives it"
                    )
                if s <= need:
                    group.append(seq[i])
                    have, i = have * s, i + 1
                else:  # the factor splits: its outer part goes here, the rest next
                    outer, inner = factor(need), factor(s // need)
                    k = order.index(seq[i])
                    order[k : k + 1] = [outer, inner]
                    group.append(outer)
                    have, seq[i] = have * need, inner
            new.append(group)
        axes = new
    for group in axes:
        if not group:  # a unit axis of the result: a unit axis of the reshape, moved
            group.append(factor(1))
            order.append(group[0])
    _merge(axes, order, sizes, factor)
    flat = [f for ax in axes for f in ax]
    shape = tuple(sizes[f] for f in order)
    permute = tuple(order.index(f) for f in flat)
    out = tuple(math.prod(sizes[f] for f in ax) for ax in axes)
    assert out == result, (out, result)
    return (
        None if shape == stored else shape,
        None if permute == tuple(range(len(flat))) else permute,
        None if out == tuple(sizes[f] for f in flat) else out,
    )


def _merge(
    axes: list[list[int]], order: list[int], sizes: list[int], factor: Callable[[int], int]
) -> None:
    """Merges factors next to each other both in the stored order and within one axis
    of the result: the fewest axes that give the same view."""
    merged = True
    while merged:
        merged = False
        for group in axes:
            for j in range(len(group) - 1):
                x, y = group[j], group[j + 1]
                k = order.index(x)
                if k + 1 < len(order) and order[k + 1] == y:
                    z = factor(sizes[x] * sizes[y])
                    order[k : k + 2] = [z]
                    group[j : j + 2] = [z]
                    merged = True
                    break


# ------------------------------------------------------------------- traced code


def trace(
    fn: Callable[[dict[str, Any]], Any],
    inputs: Mapping[str, Node],
    dtypes: Mapping[str, Any],
) -> dict[str, Node]:
    """``fn`` (a dict of arrays to a dict of arrays) run on ``inputs``, followed
    equation by equation: jax traces it with abstract values of ``inputs``' shapes
    and ``dtypes`` (no data). An operation no target expresses makes its result a
    :class:`Refused` naming it. Raises what ``fn`` raises, and TypeError if it
    returns anything but a dict of arrays keyed by strings."""
    structs = {
        k: jax.ShapeDtypeStruct(n.shape, jax.dtypes.canonicalize_dtype(dtypes[k]))
        for k, n in inputs.items()
    }
    keys = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(structs)[0]]
    closed, result = jax.make_jaxpr(fn, return_shape=True)(structs)
    out = jax.tree_util.tree_flatten_with_path(result)[0]
    named = [getattr(path[0], "key", None) if len(path) == 1 else None for path, _ in out]
    if not isinstance(result, Mapping) or not all(isinstance(k, str) for k in named):
        raise TypeError(f"it returned {type(result).__name__}, not a dict of arrays")
    nodes = _follow(_jaxpr.flatten(closed), [inputs[k] for k in keys])
    return dict(zip(named, nodes, strict=True))  # type: ignore[arg-type]


def _follow(prog: _jaxpr.Program, inputs: list[Node]) -> list[Node]:
    env: dict[int, Node] = dict(zip(prog.inputs, inputs, strict=True))
    for n in prog.consts:
        env[n] = Refused("a constant of the code, not a stored tensor", _shape(prog.avals[n]))

    def read(x: int | _jaxpr.Lit) -> Node:
        if isinstance(x, _jaxpr.Lit):
            return Refused("a literal of the code, not a stored tensor", _shape(x.aval))
        return env[x]

    for node in prog.nodes:
        ins = [read(x) for x in node.ins]
        shapes = [_shape(prog.avals[n]) for n in node.outs]
        refused = next((x for x in ins if isinstance(x, Refused)), None)
        if not _known(node.primitive):
            name = getattr(node.primitive, "name", str(node.primitive))
            outs: list[Node] = [Refused(f"the operation {name}", s) for s in shapes]
        elif refused is not None:
            outs = [Refused(refused.why, s) for s in shapes]
        else:
            try:
                outs = [_step(node, ins, [prog.avals[x] for x in node.ins if isinstance(x, int)])]
            except _Unknown as e:
                outs = [Refused(str(e), s) for s in shapes]
        for n, out in zip(node.outs, outs, strict=True):
            if n >= 0:
                env[n] = out
    return [read(x) for x in prog.outputs]


_OPERATIONS = (
    "transpose",
    "reshape",
    "squeeze",
    "broadcast_in_dim",
    "concatenate",
    "stack",
    "convert_element_type",
    "copy",
)


def _known(primitive: Any) -> bool:
    return primitive in _compat.prims(*_OPERATIONS) or _compat.placement_only(primitive)


class _Unknown(Exception):
    """An operation no target expresses."""


def _shape(aval: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(aval, "shape", ()))


def _step(node: _jaxpr.Node, ins: list[Node], avals: list[Any]) -> Node:
    """The one result of ``node`` on ``ins`` (their abstract values ``avals``)."""
    p, params = node.primitive, node.params
    name = getattr(p, "name", str(p))
    if len(node.outs) != 1:
        raise _Unknown(f"the operation {name} (several results)")
    if p is _compat.prim("transpose"):
        return permuted(ins[0], params["permutation"])
    if p is _compat.prim("reshape"):
        if params.get("dimensions") is not None:
            raise _Unknown("the operation reshape with dimensions= (a transpose first)")
        return reshaped(ins[0], params["new_sizes"])
    if p is _compat.prim("squeeze"):
        gone = {d % len(ins[0].shape) for d in params["dimensions"]}
        return reshaped(ins[0], [d for i, d in enumerate(ins[0].shape) if i not in gone])
    if p is _compat.prim("broadcast_in_dim"):
        shape, dims = tuple(params["shape"]), tuple(params["broadcast_dimensions"])
        kept = [shape[d] for d in dims] == list(ins[0].shape) and list(dims) == sorted(dims)
        if kept and all(d == 1 for i, d in enumerate(shape) if i not in dims):
            return reshaped(ins[0], shape)  # unit axes added, nothing repeated
        raise _Unknown(f"the operation broadcast_in_dim to {shape} (values repeated)")
    if p is _compat.prim("concatenate"):
        return concatenated(ins, params["dimension"])
    if p is _compat.prim("stack"):
        return stacked(ins, params["axis"])
    if p is _compat.prim("convert_element_type"):
        old, new = np.dtype(avals[0].dtype), np.dtype(params["new_dtype"])
        widened = np.issubdtype(old, np.floating) and np.promote_types(old, new) == new
        if old == new or widened:  # exact: the cast to the planned dtype is the same
            return ins[0]
        raise _Unknown(f"the operation convert_element_type from {old} to {new} (rounds)")
    return ins[0]  # a copy, or a placement: the same values
