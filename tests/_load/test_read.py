"""Checked files read block by block: each distinct block of this process's devices
once, casts that would change a value refused, and no array left holding the loader's
memory."""

import types

import jax
import numpy as np
import pytest
from helpers import plan_of

import meshinit
from meshinit._load import read


def test_each_distinct_block_is_listed_once_with_every_device_that_holds_it():
    (entry,) = plan_of({"w": ((8, 4), ("fsdp", None))}).entries
    found = read.holders(entry)
    assert len(found) == 2  # fsdp splits the rows in two; tensor (4 devices) replicates
    for index, devices in found.values():
        assert index[0].stop - index[0].start == 4 and len(devices) == 4
    assert sum(len(d) for _, d in found.values()) == 8


def test_a_cast_that_would_change_a_value_is_a_plan_error_naming_the_part():
    leaf = types.SimpleNamespace(label="", stored=types.SimpleNamespace(name="t"))
    np.testing.assert_array_equal(
        read.cast(np.array([1, 2], np.int32), np.dtype(np.int8), "p", leaf), [1, 2]
    )
    with pytest.raises(meshinit.PlanError, match="holds values from 1 to 300, outside int8"):
        read.cast(np.array([1, 300], np.int32), np.dtype(np.int8), "p", leaf)


def test_a_placed_block_keeps_none_of_the_memory_it_was_read_from():
    memory = np.zeros(1 << 16, np.float32)  # aligned and contiguous: a view of it may alias
    block = memory[: 1 << 12]
    placed = read.put(block, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    placed.block_until_ready()
    memory[:] = 7
    assert not np.asarray(placed).any()
