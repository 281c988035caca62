"""This process's files written front to back; a failed write leaves nothing that a
loader would take; a gathered tensor's shards in row order, once each."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import xy_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit._checkpoint.write.writer import shards


def test_a_failed_write_leaves_nothing_a_loader_would_take(tmp_path, monkeypatch):
    from meshinit._checkpoint.write import writer

    s = NamedSharding(xy_mesh((2, 4), False), P("x"))
    arrays = {f"w{i}": jax.device_put(jnp.ones((8, 4)), s) for i in range(4)}
    real = writer.Writer._write
    calls = []

    def failing(self, f, update):
        calls.append(f.name)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(self, f, update)

    monkeypatch.setattr(writer.Writer, "_write", failing)
    with pytest.raises(OSError, match="disk full"):
        meshinit.safetensors.save(arrays, tmp_path / "out", max_shard_size=100, config={"a": 1})
    assert [f for f in os.listdir(tmp_path / "out") if not f.startswith(".")] == []


def test_shards_are_in_row_order_once_each():
    mesh = xy_mesh((2, 4), False)
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("y")))
    got = shards(x)
    assert [s.index[0].start for s in got] == [0, 2, 4, 6]  # replicated over x: one each
    np.testing.assert_array_equal(np.concatenate([np.asarray(s.data) for s in got]), np.asarray(x))
