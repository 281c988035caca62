"""What an export takes, as plan path -> ``jax.Array``: what ``load`` returns (a flat
Mapping of plan paths), any pytree of arrays (``materialize``'s nested dicts, linen
variables) under its dot-joined paths, or an nnx Module or State (its ``nnx.Param``
paths, as ``meshinit.nnx.plan`` names them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from ..._errors import Problem
from ..._paths import path_str


def arrays_of(given: Any) -> tuple[dict[str, Any], list[Problem]]:
    """Plan path -> leaf, and a problem for each leaf that is not a ``jax.Array`` on
    devices (a plan path without an array: None, a ShapeDtypeStruct, a numpy array)."""
    flat = _flat(given)
    problems = []
    for path, leaf in flat.items():
        if not isinstance(leaf, jax.Array):
            kind = "None" if leaf is None else type(leaf).__name__
            problems.append(
                Problem(
                    path,
                    f"has no array to write (it is {kind}): give a jax.Array (load it, make "
                    f"it with jax.device_put), or leave the path out",
                )
            )
        elif jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            problems.append(
                Problem(
                    path,
                    "is a PRNG key array: a checkpoint holds no keys (leave it out, "
                    "or give jax.random.key_data(key))",
                )
            )
    return flat, problems


def _flat(given: Any) -> dict[str, Any]:
    nnx = _nnx()
    if nnx is not None and isinstance(given, nnx.Module | nnx.State):
        given = nnx.state(given, nnx.Param)  # (a State's too: its RNG keys are no weights)
        flat = {}
        for keys, var in _state_items(nnx, given):
            flat[".".join(map(str, keys))] = (
                var.get_value() if hasattr(var, "get_value") else var.value
            )
        return flat
    if isinstance(given, Mapping) and all(
        isinstance(k, str) and not isinstance(v, Mapping) for k, v in given.items()
    ):
        return dict(given)  # load's result: plan paths already
    leaves = jax.tree_util.tree_flatten_with_path(given, is_leaf=lambda x: x is None)[0]
    return {path_str(p): leaf for p, leaf in leaves}


def _state_items(nnx: Any, state: Any) -> list[tuple[tuple[Any, ...], Any]]:
    flat = nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()
    return [(tuple(k), v) for k, v in flat]


def _nnx() -> Any:
    try:
        from flax import nnx
    except ImportError:  # flax is an extra
        return None
    return nnx
