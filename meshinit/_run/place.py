"""An array placed on exactly a planned sharding, never whole on one device.

``existing=`` arrays, the loader's values and the constructor engine's host values
and captured constants all reach their planned shardings through :func:`place`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import NamedSharding


def place(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` with exactly ``sharding``; the same object if it already has it.

    An array on the same devices is resharded by jax on the devices; one on other
    devices whose target blocks are all blocks it holds is copied block to block. Any
    other (another mesh's layout: jax would gather the whole array on the host) is
    built block by block from the source's shards, so no full copy exists anywhere.
    """
    if isinstance(value, jax.Array):
        if value.sharding == sharding:
            return value
        if value.sharding.device_set == sharding.device_set or _blocks_held(value, sharding):
            return jax.device_put(value, sharding)
        return _blockwise(value, sharding)
    # A host value: each process fills only its addressable shards, so this also works
    # for meshes that span processes, where device_put of a numpy array fails.
    host = np.asarray(value)
    # dtype given: on a mesh with no device here there is no shard to infer it from.
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index], dtype=host.dtype
    )


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))


def _blocks_held(value: jax.Array, sharding: NamedSharding) -> bool:
    held = {_key(s.index, value.shape) for s in value.addressable_shards}
    # a NamedSharding gives every addressable device an index; jax's annotation allows None
    wanted = cast(
        "Iterable[tuple[slice, ...]]",
        sharding.addressable_devices_indices_map(value.shape).values(),
    )
    return all(_key(i, value.shape) in held for i in wanted)


def _blockwise(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``value`` on ``sharding``, each target block assembled from the overlapping
    blocks of ``value``'s addressable shards (one copy of each, on the host)."""
    shape = value.shape
    sources: dict[Any, Any] = {}
    for s in value.addressable_shards:  # one shard per block: replicas add nothing
        sources.setdefault(_key(s.index, shape), s)

    def block(index: Any) -> np.ndarray:
        want = _key(index, shape)
        out = np.empty([b - a for a, b in want], value.dtype)
        filled = 0
        for have, s in sources.items():
            lo = [max(a, c) for (a, _), (c, _) in zip(want, have, strict=True)]
            hi = [min(b, d) for (_, b), (_, d) in zip(want, have, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            src = tuple(slice(low - c, h - c) for low, h, (c, _) in zip(lo, hi, have, strict=True))
            dst = tuple(slice(low - a, h - a) for low, h, (a, _) in zip(lo, hi, want, strict=True))
            out[dst] = np.asarray(s.data)[src]  # on the host: no dispatch under a context mesh
            filled += int(np.prod([h - low for low, h in zip(lo, hi, strict=True)]))
        if filled != out.size:
            raise ValueError(
                f"cannot place an array of sharding {value.sharding} on {sharding}: this "
                f"process does not hold every block its devices need (a multi-process "
                f"array on other devices); place it on the planned sharding first"
            )
        return out

    return jax.make_array_from_callback(shape, sharding, block, dtype=value.dtype)
