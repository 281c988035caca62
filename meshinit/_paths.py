"""Dot-joined parameter paths and the per-parameter key derived from them.

The value contract: the parameter at ``path`` is ``init(param_key(key, path), shape,
dtype)``. The key depends on the path string alone, never on the tree's order, its
other leaves, the mesh or the grouping, so values do not depend on topology.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np
from jax import tree_util

from ._jax.threefry import SHARDING_INVARIANT_IMPL


def path_str(keypath: Sequence[Any]) -> str:
    """Joins a jax key path with dots: dict keys, sequence indices, attribute names.

    Example: ``{"layers": [{"attn": {"q": ...}}]}`` gives ``"layers.0.attn.q"``.
    """
    parts = []
    for k in keypath:
        if isinstance(k, tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(getattr(k, "key", k)))
    return ".".join(parts)


def path_digest(path: str) -> tuple[int, int]:
    """A stable 64-bit digest of ``path`` as (high, low) uint32 halves.

    blake2b, not Python's ``hash()``, which is salted per process.
    """
    d = int.from_bytes(hashlib.blake2b(path.encode("utf-8"), digest_size=8).digest(), "big")
    return d >> 32, d & 0xFFFFFFFF


def fold_digest(key: jax.Array, hi: Any, lo: Any) -> jax.Array:
    """Folds both digest halves into ``key``; traceable, so it runs inside compiled code."""
    return jax.random.fold_in(jax.random.fold_in(key, hi), lo)


def param_key(key: Any, path: str) -> jax.Array:
    """The key used for the parameter at ``path``.

    Args:
      key: an int seed, a typed key (``jax.random.key``) or a legacy uint32 key
        (``jax.random.PRNGKey``). All three give the same values.
      path: the parameter's dot-joined path, for example ``"layers.0.attn.q"``.

    Returns:
      A key of the same kind as ``key`` (a typed key for an int seed).

    Examples:
      >>> k = meshinit.param_key(0, "layers.0.w")
      >>> w = init(k, (4, 4), jnp.float32)  # equals meshinit.init(...)["layers"][0]["w"]
    """
    if not isinstance(path, str):
        raise TypeError(
            f'path must be the parameter\'s dot-joined path as a str ("layers.0.w"), got '
            f"{type(path).__name__} {path!r}"
        )
    if isinstance(key, int | np.integer) and not isinstance(key, bool):
        key = jax.random.key(int(key))
    hi, lo = path_digest(path)
    return fold_digest(key, np.uint32(hi), np.uint32(lo))


def seed_data(seed: int) -> np.ndarray:
    """``jax.random.key_data(jax.random.key(seed))`` for threefry, without a device.

    Computed on the host so that materializing from an int seed allocates nothing
    beyond the parameters. Like jax, only the low 32 bits count unless x64 is on.
    """
    if not -(2**63) <= seed < 2**63:
        raise OverflowError(f"seed {seed} does not fit in 64 bits")
    hi = (seed >> 32) & 0xFFFFFFFF if cast(Any, jax.config).jax_enable_x64 else 0
    return np.array([hi, seed & 0xFFFFFFFF], dtype=np.uint32)


def _is_key_array(x: Any) -> bool:
    """Whether ``x`` is a key array: typed keys, or legacy uint32 key data."""
    if not isinstance(x, jax.Array | np.ndarray):
        return False
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return True
    return x.dtype == np.uint32 and x.shape[-1:] == (2,)


def unwrap_key(key: Any) -> Any:
    """The jax key a wrapper holds (kauldron's ``kd.random.PRNGKey``), else ``key``.

    Two protocols are taken, both jax's own: an object whose ``__jax_array__()`` gives
    a key array, and a registered pytree node (not a tuple, list, dict or None) whose
    one and only leaf is a key array, as kauldron's ``PRNGKey`` holds its ``rng``.
    jax and flax take such a wrapper only where it is unwrapped first (kauldron's own
    patch of them does that), so its values are those of the key it holds. Anything
    else is returned as it is, for :func:`host_key` to check.
    """
    if isinstance(key, bool | int | np.integer | jax.Array | np.ndarray | tuple | list | dict):
        return key
    if key is None:
        return key
    if callable(getattr(type(key), "__jax_array__", None)):
        try:
            held = key.__jax_array__()
        except Exception:
            return key
        return held if _is_key_array(held) else key
    leaves, treedef = jax.tree_util.tree_flatten(key)
    if jax.tree_util.treedef_is_leaf(treedef) or len(leaves) != 1:
        return key
    return leaves[0] if _is_key_array(leaves[0]) else key


def key_type_error(key: Any) -> TypeError:
    """What :func:`host_key` says of a key of a type it does not take: the full type
    (kauldron's ``PRNGKey`` has the name of ``jax.random.PRNGKey``), and what to pass."""
    kind = type(key)
    name = f"{kind.__module__}.{kind.__qualname__}"
    return TypeError(
        f"key must be an int seed, a jax.random.key, a jax.random.PRNGKey (uint32[2]), or "
        f"an object holding one (a pytree whose only leaf is the key, as kauldron's "
        f"kd.random.PRNGKey, or one with __jax_array__); got {name}. Pass the jax key "
        f"itself (jax.random.key(0), or the key array your wrapper holds)"
    )


def host_key(key: Any) -> tuple[np.ndarray, str]:
    """Splits ``key`` into host key data and its implementation.

    materialize passes the data into each group's computation as a numpy value and
    rebuilds the key there with ``wrap_key_data``: a key placed on a context mesh, or
    a multi-process run where ``device_put`` to other processes' devices fails, then
    cannot get in the way. A wrapper that holds a key (:func:`unwrap_key`) stands for
    the key it holds.

    Raises:
      TypeError: ``key`` is not a seed or a single key, or is traced.
      ValueError: the key's values would depend on sharding.
    """
    key = unwrap_key(key)
    if isinstance(key, bool) or not isinstance(key, int | np.integer | jax.Array | np.ndarray):
        raise key_type_error(key)
    if isinstance(key, jax.core.Tracer):
        raise TypeError("materialize runs outside jit: pass a concrete key, not a traced one")
    data: jax.Array | np.ndarray
    if isinstance(key, int | np.integer):
        impl, data = str(cast(Any, jax.config).jax_default_prng_impl), seed_data(int(key))
    elif jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise TypeError(f"key must be a single key; got a batch of shape {key.shape}")
        impl = str(jax.random.key_impl(key))
        data = jax.random.key_data(key)
    else:
        impl = str(cast(Any, jax.config).jax_default_prng_impl)
        data = key
    if impl != SHARDING_INVARIANT_IMPL:
        raise ValueError(
            f"key implementation {impl!r} generates values that depend on the sharding, "
            f"which breaks meshinit's value contract; use a threefry key "
            f"(jax.random.key(seed, impl='threefry2x32'))"
        )
    if data.dtype != np.uint32 or data.shape != (2,):
        raise TypeError(
            f"a legacy key must be uint32[2] (jax.random.PRNGKey); "
            f"got {data.dtype}{list(data.shape)}"
        )
    if not cast(Any, jax.config).jax_threefry_partitionable:
        raise ValueError(
            "jax_threefry_partitionable is off, so random values would depend on the "
            "sharding; turn it on with jax.config.update('jax_threefry_partitionable', True)"
        )
    return np.asarray(data), impl
