"""A framework's layout code traced by jax, followed on :class:`~.trace.Sym` stand-ins.

tunix transposes and reshapes each stored tensor as its map says, then its preprocess
step stacks experts and fuses q, k and v (``jnp.stack``, ``jnp.transpose``): jax code,
not numpy. :func:`trace` runs such a function of a dict of arrays on abstract values
(jax traces it: no data) and follows its jaxpr equation by equation, each on the
stand-ins of :mod:`.trace` (``transpose`` as :meth:`~.trace.Sym.transpose`,
``reshape``, ``squeeze`` and a unit-axis ``broadcast_in_dim`` as
:meth:`~.trace.Sym.reshape`, ``concatenate`` as :func:`.trace.concatenate`), so
both front-ends share one normal form and one set of joins. An operation no target
expresses makes its result :func:`.trace.refused`, naming it: only a result that is
used as a target refuses the map.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ..._jax import compat as _compat
from ..._jax import jaxpr as _jaxpr
from . import trace as _trace
from .trace import Inexpressible, Sym


def trace(
    fn: Callable[[dict[str, Any]], Any],
    inputs: Mapping[str, Sym],
    dtypes: Mapping[str, Any],
) -> dict[str, Sym]:
    """``fn`` (a dict of arrays to a dict of arrays) run on ``inputs``, followed
    equation by equation: jax traces it with abstract values of ``inputs``' shapes
    and ``dtypes`` (no data). An operation no target expresses makes its result a
    :func:`.trace.refused` stand-in naming it. Raises what ``fn`` raises, and
    TypeError if it returns anything but a dict of arrays keyed by strings."""
    structs = {
        k: jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(dtypes[k]))
        for k, x in inputs.items()
    }
    keys = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(structs)[0]]
    closed, result = jax.make_jaxpr(fn, return_shape=True)(structs)
    out = jax.tree_util.tree_flatten_with_path(result)[0]
    named = [getattr(path[0], "key", None) if len(path) == 1 else None for path, _ in out]
    if not isinstance(result, Mapping) or not all(isinstance(k, str) for k in named):
        raise TypeError(f"it returned {type(result).__name__}, not a dict of arrays")
    syms = _follow(_jaxpr.flatten(closed), [inputs[k] for k in keys])
    return dict(zip(named, syms, strict=True))  # type: ignore[arg-type]


def _follow(prog: _jaxpr.Program, inputs: list[Sym]) -> list[Sym]:
    env: dict[int, Sym] = dict(zip(prog.inputs, inputs, strict=True))
    for n in prog.consts:
        env[n] = _refused("a constant of the code, not a stored tensor", prog.avals[n])

    def read(x: int | _jaxpr.Lit) -> Sym:
        if isinstance(x, _jaxpr.Lit):
            return _refused("a literal of the code, not a stored tensor", x.aval)
        return env[x]

    for node in prog.nodes:
        ins = [read(x) for x in node.ins]
        avals = [prog.avals[n] for n in node.outs]
        why = next((str(x.node) for x in ins if isinstance(x.node, Inexpressible)), None)
        if not _known(node.primitive):
            why = f"the operation {getattr(node.primitive, 'name', node.primitive)}"
        if why is None:
            try:
                outs = [_step(node, ins, [prog.avals[x] for x in node.ins if isinstance(x, int)])]
            except Inexpressible as e:
                why = str(e)
        if why is not None:
            outs = [_refused(why, aval) for aval in avals]
        for n, sym in zip(node.outs, outs, strict=True):
            if n >= 0:
                env[n] = sym
    return [read(x) for x in prog.outputs]


def _refused(why: str, aval: Any) -> Sym:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    try:
        dtype = np.dtype(aval.dtype)
    except (AttributeError, TypeError):  # a key, say: no numpy dtype, and none needed
        dtype = np.dtype(np.float32)
    return _trace.refused(why, shape, dtype)


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


def _step(node: _jaxpr.Node, ins: list[Sym], avals: list[Any]) -> Sym:
    """The one result of ``node`` on ``ins`` (their abstract values ``avals``)."""
    p, params = node.primitive, node.params
    name = getattr(p, "name", str(p))
    x = ins[0]
    if len(node.outs) != 1:
        raise Inexpressible(f"the operation {name} (several results)")
    if p is _compat.prim("transpose"):
        return x.transpose(tuple(params["permutation"]))
    if p is _compat.prim("reshape"):
        if params.get("dimensions") is not None:
            raise Inexpressible("the operation reshape with dimensions= (a transpose first)")
        return x.reshape(tuple(params["new_sizes"]))
    if p is _compat.prim("squeeze"):
        gone = {d % x.ndim for d in params["dimensions"]}
        return x.reshape(tuple(d for i, d in enumerate(x.shape) if i not in gone))
    if p is _compat.prim("broadcast_in_dim"):
        shape, dims = tuple(params["shape"]), tuple(params["broadcast_dimensions"])
        kept = [shape[d] for d in dims] == list(x.shape) and list(dims) == sorted(dims)
        if kept and all(d == 1 for i, d in enumerate(shape) if i not in dims):
            return x.reshape(shape)  # unit axes added, nothing repeated
        raise Inexpressible(f"the operation broadcast_in_dim to {shape} (values repeated)")
    if p is _compat.prim("concatenate"):
        return _trace.concatenate(ins, params["dimension"])
    if p is _compat.prim("stack"):
        return _trace.stack(ins, params["axis"])
    if p is _compat.prim("convert_element_type"):
        old, new = np.dtype(avals[0].dtype), np.dtype(params["new_dtype"])
        widened = np.issubdtype(old, np.floating) and np.promote_types(old, new) == new
        if old == new or widened:  # exact: the cast to the planned dtype is the same
            return x
        raise Inexpressible(f"the operation convert_element_type from {old} to {new} (rounds)")
    return x  # a copy, or a placement: the same values
