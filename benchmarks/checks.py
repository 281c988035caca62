"""The checks every recipe's arrays must pass: the exact expected placement of each
array (:func:`expected`, :func:`placement_problems`), per recipe, and meshinit's value
contract (:func:`value_problems`).
"""

from __future__ import annotations

from typing import Any

from models import Leaf, Model, leaves, sharding_of, stage_of
from recipes_eqx import eqx_layout


def _normalized(spec: Any, ndim: int) -> tuple[tuple[str, ...] | None, ...]:
    out = []
    for entry in (*spec, *[None] * (ndim - len(spec))):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        out.append(names or None)
    return tuple(out)


def expected(model: Model, mesh: Any, recipe: str = "meshinit") -> list[tuple[str, Leaf, Any]]:
    """(path, leaf as the recipe stores it, exact sharding) in ``jax.tree`` flatten order.

    For ``meshinit.nnx:2mesh`` each path's mesh is its stage's (:func:`stage_of`); for
    the equinox recipes a Linear's weight is (out, in) (:func:`eqx_layout`).
    """
    mesh_of = stage_of(model, mesh) if recipe.endswith(":2mesh") else (lambda path: mesh)
    layout = eqx_layout if "eqx" in recipe else (lambda path, leaf: leaf)
    out = []
    for path, leaf in leaves(model):
        stored = layout(path, leaf)
        out.append((path, stored, sharding_of(mesh_of(path), stored)))
    return out


def placement_problems(
    model: Model, mesh: Any, arrays: Any, limit: int = 5, recipe: str = "meshinit"
) -> list[str]:
    """Where ``arrays`` differ from the exact planned placement (empty if none).

    Checks each array's shape, dtype, mesh (devices, names, axis types), PartitionSpec,
    and the index and shape of every addressable shard, against :func:`expected` for
    ``recipe``.
    """
    import jax
    from jax.sharding import NamedSharding

    problems: list[str] = []
    got = jax.tree.leaves(arrays)
    want = expected(model, mesh, recipe)
    if len(got) != len(want):
        return [f"{len(got)} arrays for {len(want)} parameters"]
    for (path, leaf, sharding), array in zip(want, got, strict=True):
        s = getattr(array, "sharding", None)
        if not isinstance(array, jax.Array):
            problems.append(f"{path}: a {type(array).__name__}, not a jax.Array")
        elif array.shape != leaf.shape or array.dtype != model.jnp_dtype:
            problems.append(f"{path}: {array.dtype}{array.shape}, want {leaf.shape}")
        elif not isinstance(s, NamedSharding) or s.mesh != sharding.mesh:
            problems.append(f"{path}: placed by {s}, want {sharding}")
        elif _normalized(s.spec, leaf.ndim) != _normalized(sharding.spec, leaf.ndim):
            problems.append(f"{path}: {s.spec}, want {sharding.spec}")
        else:
            indices = sharding.devices_indices_map(leaf.shape)
            shard_shape = sharding.shard_shape(leaf.shape)
            for shard in array.addressable_shards:
                if shard.index != indices[shard.device] or shard.data.shape != shard_shape:
                    problems.append(f"{path}: shard on {shard.device} is {shard.index}")
                    break
    if len(problems) > limit:
        problems = [*problems[:limit], f"and {len(problems) - limit} more"]
    return problems


def value_problems(arrays: Any, seed: int, model: Model) -> list[str]:
    """meshinit's value contract: ``init(param_key(seed, path), shape, dtype)`` within 2 ulp."""
    import jax
    import numpy as np

    import meshinit

    problems = []
    for (path, leaf), array in zip(leaves(model), jax.tree.leaves(arrays), strict=True):
        key = meshinit.param_key(seed, path)
        ref = jax.jit(lambda k, leaf=leaf: leaf.init()(k, leaf.shape, model.jnp_dtype))(key)
        try:
            np.testing.assert_array_max_ulp(np.asarray(array), np.asarray(ref), maxulp=2)
        except AssertionError as e:
            problems.append(f"{path}: values differ from the contract: {str(e)[:200]}")
    return problems
