"""Typed PRNG keys, read as their stored key data: the data's entry, what may hold
it, and the key array wrapped shard by shard onto the planned sharding."""

import pathlib

import jax
import numpy as np
from flax import nnx
from helpers import mesh8

import meshinit
from meshinit._checkpoint.encodings import keys
from meshinit._checkpoint.store.local import LocalFile
from meshinit._checkpoint.store.source import Stored


class Keyed(nnx.Module):
    def __init__(self):
        self.rngs = nnx.Rngs(0)


def _key_entry():
    """The plan entry of an nnx stream's key: a 0-d ``key<fry>``."""
    with jax.set_mesh(mesh8()):
        plan = meshinit.nnx.plan(Keyed)
    (entry,) = [e for e in plan.entries if keys.is_key(e.spec.dtype)]
    return entry


def test_a_key_entry_reads_as_its_key_data_on_the_key_sharding_padded():
    entry = _key_entry()
    assert keys.is_key(entry.spec.dtype) and not keys.is_key(np.float32)
    data = keys.data_entry(entry)
    assert (data.spec.shape, data.spec.dtype) == ((2,), np.dtype(np.uint32))
    assert tuple(data.sharding.spec) == (*entry.sharding.spec, None)
    assert data.sharding.mesh == entry.sharding.mesh


def test_key_data_of_another_dtype_is_refused_never_cast():
    entry = _key_entry()
    file = LocalFile(pathlib.Path("m.safetensors"))
    assert keys.why_not(Stored(file, "k", "U32", (2,), 8, 8), entry) is None
    why = keys.why_not(Stored(file, "k", "I32", (2,), 8, 8), entry)
    assert why is not None and "never cast; store the key data" in why


def test_placed_key_data_wraps_into_keys_on_the_planned_sharding():
    entry = _key_entry()
    want = jax.random.key(3)
    data_sharding = keys.data_entry(entry).sharding
    data = jax.device_put(jax.random.key_data(want), data_sharding)
    got = keys.wrapped(data, entry)
    assert got.sharding == entry.sharding and got.dtype == entry.spec.dtype
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
