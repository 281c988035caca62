"""The host side of a parameter's read: each distinct block of this process's devices
listed once with its devices, and placed in memory of its own."""

import jax
import numpy as np
from helpers import plan_of

from meshinit._checkpoint.layout import host


def test_each_distinct_block_is_listed_once_with_every_device_that_holds_it():
    (entry,) = plan_of({"w": ((8, 4), ("fsdp", None))}).entries
    found = host.holders(entry)
    assert len(found) == 2  # fsdp splits the rows in two; tensor (4 devices) replicates
    for index, devices in found.values():
        assert index[0].stop - index[0].start == 4 and len(devices) == 4
    assert sum(len(d) for _, d in found.values()) == 8


def test_a_placed_block_keeps_none_of_the_memory_it_was_read_from():
    memory = np.zeros(1 << 16, np.float32)  # aligned and contiguous: a view of it may alias
    block = memory[: 1 << 12]
    placed = host.put(block, jax.sharding.make_single_device_sharding(jax.devices()[0]))
    placed.block_until_ready()
    memory[:] = 7
    assert not np.asarray(placed).any()
