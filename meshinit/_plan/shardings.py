"""The exact sharding tree of placed parameters, optimizer state or an nnx Module."""

from __future__ import annotations

import sys
from typing import Any

import jax

from .. import _paths
from .._errors import PlanError, Problem


def shardings(tree: Any) -> Any:
    """The sharding of every leaf: what a jit's ``out_shardings`` or a restore needs.

    Args:
      tree: a tree of placed ``jax.Array``s or of ``jax.ShapeDtypeStruct``s with
        shardings (parameters, or optimizer state from :func:`meshinit.optax.init`),
        or a flax nnx Module, whose ``nnx.state`` is used.

    Returns:
      The same tree with each leaf's ``.sharding`` in its place (for a Module, its
      ``nnx.State``'s tree).

    Raises:
      PlanError: a leaf carries no sharding (a Python number, a numpy array, or a
        ``ShapeDtypeStruct`` without one); one problem per such path.

    Examples:
      >>> params = meshinit.materialize(meshinit.plan(specs), 0)
      >>> step = jax.jit(train_step, out_shardings=meshinit.shardings(params))
    """
    # flax is imported only if the caller already did: an nnx object implies it.
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    missing = [
        Problem(_paths.path_str(p), f"a {type(x).__name__} with no sharding")
        for p, x in flat
        if getattr(x, "sharding", None) is None
    ]
    if missing:
        raise PlanError(
            missing,
            header="these leaves carry no sharding; place them (jax.device_put, "
            "meshinit.materialize) or give each ShapeDtypeStruct a sharding:",
        )
    return jax.tree_util.tree_unflatten(treedef, [x.sharding for _, x in flat])
