"""Typed PRNG keys of a plan, read from their stored key data.

safetensors holds numbers, so a key array (``key<fry>``, an nnx ``Rngs`` stream's
key) is stored as its ``jax.random.key_data``: uint32, of the key's shape plus its
implementation's own trailing dimensions (``(2,)`` for threefry, ``(4,)`` for rbg).
An adapter's plan shows such a key at its own shape and key dtype
(:func:`meshinit._spec.spec.key_spec`). The loader reads it as an entry of the key
data (:func:`data_entry`: the data's shape and dtype, on the key's sharding padded
with None, so every block reads the trailing dimensions whole), then wraps each
shard with the plan's implementation (:func:`wrapped`), as ``existing=`` rewraps the
key data it places: the key array lands on exactly the planned sharding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..._plan.plan import PlanEntry
from ..store.header import READABLE
from ..store.source import Stored


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``key<fry>``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def implementation(dtype: Any) -> Any:
    """The key implementation of the key dtype ``dtype``, as ``jax.random.key_impl``
    gives it (which takes arrays only: asked of an abstract one, nothing allocated)."""
    found = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), jax.ShapeDtypeStruct((), dtype))
    return found[0]


def data_entry(entry: PlanEntry) -> PlanEntry:
    """``entry``, which plans a key array, as the entry of its key data: the data's shape
    and dtype, on the key's sharding padded with None for the trailing dimensions."""
    key = jax.ShapeDtypeStruct(entry.spec.shape, entry.spec.dtype)
    data = jax.eval_shape(jax.random.key_data, key)
    spec = dataclasses.replace(entry.spec, shape=tuple(data.shape), dtype=np.dtype(data.dtype))
    axes = tuple(entry.sharding.spec)
    axes += (None,) * (len(data.shape) - len(axes))
    sharding = NamedSharding(
        entry.sharding.mesh, PartitionSpec(*axes), memory_kind=entry.sharding.memory_kind
    )
    return dataclasses.replace(entry, spec=spec, sharding=sharding)


def described(entry: PlanEntry) -> str:
    """How a message names the planned key: ``key<fry>[4] (threefry2x32 keys, stored
    as their key data, uint32 (4, 2))``."""
    data = data_entry(entry).spec
    dims = ",".join(map(str, entry.spec.shape))
    return (
        f"{entry.spec.dtype}[{dims}] ({implementation(entry.spec.dtype)} keys, stored as "
        f"their key data, {data.dtype.name} {data.shape})"
    )


def why_not(stored: Stored, entry: PlanEntry) -> str | None:
    """Why ``stored`` cannot hold the key data of the key ``entry`` plans, or None."""
    want = data_entry(entry).spec.dtype
    if READABLE.get(stored.dtype) == want:
        return None
    return (
        f"is {stored.dtype}, planned {described(entry)}: a key is stored as "
        f"jax.random.key_data of the keys, {want.name}, never cast; store the key data"
    )


def wrapped(data: jax.Array, entry: PlanEntry) -> jax.Array:
    """The key array of the placed key ``data`` (on :func:`data_entry`'s sharding), on
    exactly ``entry.sharding``: each shard wrapped where it lies, then assembled, so a
    sharded key array is built from the shards this process holds."""
    impl = implementation(entry.spec.dtype)
    shards = [jax.random.wrap_key_data(s.data, impl=impl) for s in data.addressable_shards]
    # dtype: a process whose devices hold none of it passes no shards to tell it
    return jax.make_array_from_single_device_arrays(
        entry.spec.shape, entry.sharding, shards, dtype=entry.spec.dtype
    )
