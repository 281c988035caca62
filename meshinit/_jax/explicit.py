"""jit's float code on an Explicit mesh, without computing any array whole.

Traced under a mesh with Explicit axes (what ``jax.make_mesh`` makes), every value
carries a sharding in its type, and jax's lowering wraps each equation's result in a
sharding constraint (``mlir.lower_with_sharding_in_types``); an elementwise equation
with a scalar operand (``x * 0.02``) also gets that scalar broadcast and constrained
(``mlir.multi_broadcast_in_dim``). The constraints change no value, but they hide
constants from XLA's algebraic simplifier: on an Auto mesh XLA folds
``(erf_inv(u) * sqrt(2)) * 0.02`` into ``erf_inv(u) * 0.0282842703``, and on an
Explicit one it cannot, so the same initializer rounds otherwise (read in the
optimized HLO of jax 0.10.2 on CPU; 1 ulp in 4-27% of the elements of a
``normal(0.02)``, on a (1, 1) mesh too).

:func:`explicit_bind` gives meshinit's programs, which are traced under the mesh's
all-Auto twin so that the out_shardings partition the generation, the same
constraints in the same places: each scalar operand of an elementwise equation
broadcast and constrained, each result constrained. A value of the parameter's shape
is constrained to the parameter's sharding (where jax's constraint is replicated, and
XLA computes the whole array on each device before slicing it); any other value is
left to the partitioner (an open constraint), so no array is made whole on a device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import compat as _compat
from .jaxpr import Lit, Node

Bind = Callable[[Node, list[Any]], Sequence[Any]]


def is_explicit(mesh: Any) -> bool:
    """Whether values traced under ``mesh`` carry their sharding in their type: a mesh
    with an Explicit axis (jax then constrains every value it lowers)."""
    if mesh is None or getattr(mesh, "empty", True):
        return False
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def context_is_explicit() -> bool:
    """Whether the ``jax.set_mesh`` context mesh of this call is Explicit: what a jit
    of the caller's would be traced under."""
    return is_explicit(jax.sharding.get_mesh())


def _broadcasts_scalars(node: Node) -> bool:
    """An elementwise equation whose lowering broadcasts its scalar operands
    (``select_n`` takes a scalar predicate as it is)."""
    return _compat.elementwise(node.primitive) and node.primitive is not _compat.prim("select_n")


def _broadcast(x: Any, operand: Any, shape: tuple[int, ...]) -> Any:
    """The scalar ``x`` broadcast to ``shape``, in its operand's dtype (a literal's
    value may be a Python number)."""
    dtype = operand.aval.dtype if isinstance(operand, Lit) else x.dtype
    return jax.lax.broadcast_in_dim(jax.numpy.asarray(x, dtype), shape, ())


def explicit_bind(bind: Bind, mesh: Mesh, shape: tuple[int, ...], spec: PartitionSpec) -> Bind:
    """``bind`` with the sharding constraints jax lowers on an Explicit mesh.

    Args:
      bind: evaluates one node (``bind(node, ins)``).
      mesh: the all-Auto mesh the program is traced under.
      shape: the parameter's shape: values of it are constrained to ``spec``.
      spec: the parameter's PartitionSpec.
    """
    own = NamedSharding(mesh, spec)
    replicated = NamedSharding(mesh, PartitionSpec())

    def constrain(x: Any) -> Any:
        aval = getattr(x, "aval", None)
        if aval is None or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            return x  # a Python value, or a key (its data is what jax constrains)
        if tuple(x.shape) == tuple(shape):
            sharding = own
        elif x.ndim == 0:
            sharding = replicated
        else:  # left to the partitioner: never made whole to match a constraint
            sharding = NamedSharding(mesh, PartitionSpec(*([PartitionSpec.UNCONSTRAINED] * x.ndim)))
        return jax.lax.with_sharding_constraint(x, sharding)

    def bound(node: Node, ins: list[Any]) -> Sequence[Any]:
        ins = _scalars_broadcast(node, ins, constrain)
        return [constrain(x) for x in bind(node, ins)]

    return bound


def _scalars_broadcast(node: Node, ins: list[Any], wrap: Callable[[Any], Any]) -> list[Any]:
    """``ins`` with each scalar operand of an elementwise ``node`` whose result is an
    array broadcast to that array's shape and passed through ``wrap``."""
    if not _broadcasts_scalars(node) or len(node.outs) != 1:
        return ins
    ranks = [np.ndim(x) for x in ins]
    rank = max(ranks, default=0)
    if rank == 0 or 0 not in ranks:
        return ins
    full = next(np.shape(x) for x, r in zip(ins, ranks, strict=True) if r == rank)
    return [
        wrap(_broadcast(x, operand, full)) if r == 0 else x
        for x, operand, r in zip(ins, node.ins, ranks, strict=True)
    ]


def bind_in_manual(node: Node, ins: list[Any], params: dict[str, Any]) -> Any:
    """``node``'s one result, in ``shard_map``'s manual region (a tile loop), with its
    scalar operands hidden as jit's constraints hide them in the whole program.

    There no constraint hides anything: with every axis manual, XLA drops it before
    its simplifier runs (read in the TPU's optimized programs: a tile loop folded
    ``(x * 1.414) * 0.03113`` into ``x * 0.04395``, which the whole program keeps
    apart). So the scalar operand of an exact operation (``compat.exact``) goes
    behind an optimization barrier, which XLA removes only after fusion: the tile then reads
    it as a value, which changes no bit of an exact operation. Any other operation
    (``pow``, ``atan2``, ``rem``, ``div``, ...) keeps its constant: XLA's TPU code for
    them differs for a constant operand, and a barrier made a tile's ``|n| ** 2.5`` read
    2.5 as a value (``power(%abs, %param)`` in the optimized program where the whole one
    has ``power(%abs, broadcast(constant(2.5)))``: 891,008 of 1,229,700 elements of
    ``|n|**2.5 + atan2(n, 0.3) + rem(10 n, 3)`` differed on a TPU v5e, issue 67)."""
    if _compat.exact(node.primitive):
        ins = _scalars_broadcast(node, ins, jax.lax.optimization_barrier)
    (value,) = _compat.bind(node.primitive, ins, params)
    return value
