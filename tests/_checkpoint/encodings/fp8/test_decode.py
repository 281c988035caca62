"""A dequantized parameter's blocks on the devices (``QuantParts``): a block larger
than a slice is read and placed in slices, each dequantized with its part of the
block's scales, with the bits of the block whole, one compile as whole, and nothing
left alive on a failure between two slices. (The route's bits on every view, Stack
and sharding are tested end to end in test_pairing.py.)"""

import jax.numpy as jnp
import numpy as np
import pytest
from fp8_files import bits, experts
from helpers import plan_on, xy_mesh

from meshinit import safetensors as st


@pytest.mark.parametrize(
    ("grid", "spec", "joined", "explicit"),
    [
        ((2, 4), ("x", None, None, "y"), "stack", True),  # rows of experts, columns
        ((2, 4), (None, None, "y", None), "stack", False),  # each block on 2 devices
        ((1, 8), (None, None, "y", None), "concat", True),
        ((1, 8), (None, None, "y", None), "merge", False),
    ],
)
def test_a_block_larger_than_a_slice_is_read_and_placed_in_slices_with_the_same_bits(
    tmp_path, monkeypatch, count_compiles, new_arrays, grid, spec, joined, explicit
):
    """The host never holds more than a slice of a dequantized parameter's block: a
    stack of experts (a concat, a concat merged into rows: the tiles' program) is
    read and placed in slices its program joins, with weight_dequant's bits on every
    shard, on Explicit and Auto meshes, one compile as unsliced, and on a failure
    between two slices no array stays alive."""
    from meshinit._checkpoint.encodings.fp8 import decode as dequant
    from meshinit._checkpoint.encodings.fp8 import slices
    from meshinit._checkpoint.layout import host

    mesh = xy_mesh(grid, explicit)
    folder, stack, want = experts(tmp_path, 4)  # up [4 experts, 4 layers, 136, 200]
    if joined == "concat":  # the experts concatenated, through the tiles' program
        stack = st.Concat(list(stack.parts), axis=0)
        want = want.reshape(16, 136, 200)
        spec = spec[1:]
    elif joined == "merge":  # and their layers' rows merged: slices of whole rows
        stack = st.Concat(list(stack.parts), axis=0, out_shape=(16 * 136, 200))
        want = want.reshape(16 * 136, 200)
        spec = ("y", None)
    plan = plan_on(mesh, {"up": want.shape}, jnp.bfloat16, spec)
    (entry,) = plan.entries
    held = host.holders(entry)
    (whole,) = {int(np.prod([s.stop - s.start for s in i])) for i, _ in held.values()}
    monkeypatch.setattr(slices, "SLICE_BYTES", whole // 3)  # a byte an element
    largest, puts = [0], [0]
    real_put = host.put

    def put(block, where):
        largest[0], puts[0] = max(largest[0], block.nbytes), puts[0] + 1
        return real_put(block, where)

    monkeypatch.setattr(host, "put", put)
    dequant.program.cache_clear()
    with count_compiles() as sliced:
        got = st.load(plan, folder, names={"up": stack})["up"]
    assert got.sharding == entry.sharding
    for shard in got.addressable_shards:  # each device's own block, replicas too
        assert (bits(shard.data) == bits(want[shard.index])).all(), shard.device
    # every distinct block in at least 4 slices (a third of its bytes, as the axes divide)
    assert 0 < largest[0] <= whole // 3 and puts[0] >= 4 * len(held), (largest, puts, whole)
    monkeypatch.setattr(slices, "SLICE_BYTES", 1 << 40)
    dequant.program.cache_clear()
    with count_compiles() as unsliced:
        again = st.load(plan, folder, names={"up": stack})["up"]
    assert (bits(again) == bits(got)).all()
    assert sliced.count == unsliced.count
    # a failure between two slices: every slice placed so far is let go
    monkeypatch.setattr(slices, "SLICE_BYTES", whole // 3)
    calls = [0]
    real_copies = host.copies

    def copies(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError("the third slice")
        return real_copies(*args, **kwargs)

    monkeypatch.setattr(host, "copies", copies)
    with pytest.raises(OSError, match="the third slice"), new_arrays() as made:
        st.load(plan, folder, names={"up": stack})
    assert not made, made
