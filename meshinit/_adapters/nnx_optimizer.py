"""``meshinit.nnx.optimizer``: an ordinary ``nnx.Optimizer`` whose state is placed
exactly like the params it mirrors, by ``meshinit.optax.init`` (re-exported by
:mod:`meshinit.nnx`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from .._run import agree as _agree

__all__ = ["optimizer"]


class _Prebuilt:
    """A transformation whose ``init`` hands back state made beforehand.

    ``nnx.Optimizer`` calls ``tx.init`` itself, eagerly, on every parameter at once;
    given this instead, it wraps the placed state in its own Variables (``OptArray``,
    ``OptVariable`` with the parameter's metadata) and computes nothing.
    """

    def __init__(self, tx: Any, state: Any):
        self.update = tx.update
        self._state = state

    def init(self, params: Any) -> Any:
        return self._state


def optimizer(
    model: nnx.Module,
    tx: Any,
    *,
    wrt: Any = nnx.Param,
    shard_over: str | tuple[str, ...] | None = None,
    memory_kind: str | None = None,
) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=wrt)``, with its state placed exactly like the params.

    Every state leaf that mirrors a parameter (Adam's ``mu`` and ``nu``, momentum)
    gets that parameter's sharding, and the step counts (``opt.step`` and the
    transformation's own counts) are replicated on the mesh of the first ``wrt``
    Variable in nnx state order, all made by :func:`meshinit.optax.init`: one
    computation per mesh, values equal to ``tx.init`` on one device. This works for
    Params on several meshes, disjoint submeshes included, where
    ``nnx.Optimizer(model, tx, wrt=...)`` puts the counts on one default device, and
    fails with "incompatible devices" under ``nnx.jit`` or an Auto ``jax.set_mesh``.

    flax's own constructor builds the object, so it is an ordinary ``nnx.Optimizer``
    with the same Variable types, metadata and tree structure as flax's. It is handed
    a transformation whose ``init`` returns the placed state, so flax computes no
    state and re-applies no sharding; ``opt.tx`` is then set to ``tx``, and
    ``opt.step`` to the placed count. The model is read, never moved or resharded.

    One ``opt.update(model, grads)`` spans every parameter, so it runs only where
    one computation may: Auto meshes over the same devices. Params on disjoint
    meshes, or on different Explicit meshes, are trained per stage: one optimizer per
    stage's sub-Module.

    Args:
      model: an nnx Module whose ``wrt`` Variables hold arrays placed with a
        ``NamedSharding``, as :func:`init` and :func:`materialize` leave them.
      tx: an ``optax.GradientTransformation``.
      wrt: the nnx filter of the Variables to optimize, as for ``nnx.Optimizer``.
      shard_over: mesh axes to shard the mirroring state further over (ZeRO-1), as
        for :func:`meshinit.optax.init`; each such Variable's ``out_sharding``
        metadata then names its own PartitionSpec.
      memory_kind: the memory of the mirroring state (``"pinned_host"``), as for
        :func:`meshinit.optax.init`; recorded in the Variables' metadata.

    Returns:
      An ``nnx.Optimizer`` whose ``opt_state`` and ``step`` are placed as above.

    Raises:
      TypeError: a ``wrt`` Variable is not placed with a ``NamedSharding``.
      PlanError: ``wrt`` selects no Variable, or a state leaf would combine
        parameters on different meshes.

    Examples:
      >>> model = meshinit.nnx.init(lambda: Model(rngs=nnx.Rngs(0)))
      >>> opt = meshinit.nnx.optimizer(model, optax.adamw(1e-3))
      >>> opt.opt_state[0].mu["w"].get_value().sharding == model.w.get_value().sharding
      True
    """
    from .. import optax as meshinit_optax

    with _agree.collective("meshinit.nnx.optimizer"):
        params = nnx.state(model, wrt)
        step, state = meshinit_optax.init(
            _WithStep(tx), params, shard_over=shard_over, memory_kind=memory_kind
        )
    flags = [_eager_flag(v) for v in jax.tree.leaves(state, is_leaf=_is_variable)]
    # flax's to_opt_state rebuilds each mirror as an OptVariable with its Param's
    # metadata, which re-applies the sharding the array already has; under an Auto
    # jax.set_mesh over other devices that fails. Off while it builds, then restored.
    state = jax.tree.map(
        lambda v: v.replace(eager_sharding=False) if _is_variable(v) else v,
        state,
        is_leaf=_is_variable,
    )
    opt = nnx.Optimizer(model, _Prebuilt(tx, state), wrt=wrt)
    for var, flag in zip(jax.tree.leaves(opt.opt_state, is_leaf=_is_variable), flags, strict=True):
        if flag is not None:
            var.set_metadata("eager_sharding", flag)
        if shard_over is not None or memory_kind is not None:
            _say_own_placement(var)
    opt.tx = tx
    opt.step.set_value(step)
    return opt


def _say_own_placement(var: Any) -> None:
    """A state Variable's metadata names its own array's placement, where flax copied
    its Param's (``shard_over`` and ``memory_kind`` make them differ)."""
    if not _is_variable(var):
        return
    sharding = getattr(var.get_value(), "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return
    meta = var.get_metadata()
    if "out_sharding" in meta and tuple(sharding.spec) != tuple(meta["out_sharding"] or ()):
        var.set_metadata("out_sharding", tuple(sharding.spec))
        if meta.get("sharding_rules") is not None:
            var.set_metadata("sharding_rules", None)  # mesh axes now, not logical names
    if sharding.memory_kind not in (None, "device") or "memory_kind" in meta:
        var.set_metadata("memory_kind", sharding.memory_kind)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _eager_flag(x: Any) -> bool | None:
    return x.get_metadata("eager_sharding", None) if _is_variable(x) else None


class _WithStep:
    """``tx`` with flax's step count in front of its state, so one call makes both.

    Its ``init`` is a ``functools.partial`` of ``tx.init``, so ``meshinit.optax``
    tells what it computes by ``tx.init``'s own code and closure, as for ``tx``.
    """

    def __init__(self, tx: Any):
        self.init = functools.partial(_init_with_step, tx.init)


def _init_with_step(init: Callable[[Any], Any], params: Any) -> Any:
    return jax.numpy.zeros((), jax.numpy.uint32), init(params)
