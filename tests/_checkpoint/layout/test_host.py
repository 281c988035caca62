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


def test_a_stacked_block_lets_go_of_its_parts_pages_as_it_reads_them(tmp_path, monkeypatch):
    """Parts each smaller than RELEASE_BYTES, stacked: the pages of those already in the
    block go once they add up to RELEASE_BYTES, while the block is still being read,
    not only as the parameter is closed (a 470 MiB stack of 14 MiB experts kept every
    page mapped beside the block)."""
    import pytest

    pytest.importorskip("safetensors.numpy")
    from helpers import stored

    from meshinit import safetensors as st

    parts = {f"w{k}": np.full((64, 64), k, np.float32) for k in range(8)}  # 16 KiB each
    stored(tmp_path, parts)
    plan = plan_of({"w": ((8, 64, 64), (None, None, None))})
    monkeypatch.setattr(host, "RELEASE_BYTES", 3 * (16 << 10))
    released, reading = [], [False]
    real_release, real_block = host.Part.release, host.Parts.block

    def release(self, mapped, base):
        if self._read:
            released.append((self.leaf.stored.name, reading[0]))
        return real_release(self, mapped, base)

    def block(self, index):
        reading[0] = True
        try:
            return real_block(self, index)
        finally:
            reading[0] = False

    monkeypatch.setattr(host.Part, "release", release)
    monkeypatch.setattr(host.Parts, "block", block)
    got = st.load(plan, tmp_path, names={"w": st.Stack(list(parts), axis=0)})["w"]
    assert (np.asarray(got) == np.stack(list(parts.values()))).all()
    # parts 0-2 go as part 3 is read, 3-5 as part 6 is; 6 and 7 (32 KiB) with the mapping
    assert released == [(f"w{k}", True) for k in range(6)], released
