"""``place``: a value onto exactly a sharding, the same object when it already has it."""

import jax
import numpy as np
from helpers import mesh8, submesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshinit._run.place import place


def test_an_array_already_on_the_sharding_is_returned_as_is():
    sharding = NamedSharding(mesh8(), P("fsdp", "tensor"))
    x = jax.device_put(np.arange(32.0).reshape(4, 8), sharding)
    assert place(x, sharding) is x


def test_a_host_value_is_placed_with_its_values_and_dtype():
    sharding = NamedSharding(mesh8(), P("tensor", None))
    host = np.arange(24, dtype=np.int16).reshape(8, 3)
    got = place(host, sharding)
    assert got.sharding == sharding and got.dtype == np.int16
    np.testing.assert_array_equal(np.asarray(got), host)


def test_an_array_on_other_devices_moves_with_its_values():
    source = jax.device_put(
        np.arange(64.0).reshape(8, 8),
        NamedSharding(submesh(range(4), (2, 2), ("a", "b")), P("a", "b")),
    )
    target = NamedSharding(submesh(range(4, 8), (4,), ("x",)), P(None, "x"))
    got = place(source, target)
    assert got.sharding == target
    np.testing.assert_array_equal(np.asarray(got), np.arange(64.0).reshape(8, 8))
