"""The export's programs: one per signature (every layer of a scanned parameter shares
one), each stored tensor gathered onto its processes split by rows over their devices."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import xy_mesh
from jax.sharding import PartitionSpec as P

from _checkpoint.write.test_save import MESHES, _random, _round_trip
from meshinit._checkpoint.write.programs import gathered
from meshinit.safetensors import Stack, Tensor


@MESHES
def test_a_stack_writes_one_tensor_per_layer_with_one_program(explicit, tmp_path):
    from meshinit._checkpoint.write import programs

    mesh = xy_mesh((2, 4), explicit)
    layers = 6
    stored = {
        f"model.layers.{i}.mlp.up_proj.weight": _random((32, 8), np.float32, i)
        for i in range(layers)
    }
    names = {
        "up": Stack(
            [Tensor(f"model.layers.{i}.mlp.up_proj.weight", permute=(1, 0)) for i in range(layers)],
            axis=0,
        )
    }
    programs.programs.clear()
    _round_trip(
        tmp_path,
        stored,
        {"up": ((layers, 8, 32), jnp.float32)},
        names,
        mesh,
        {"up": (None, "x", "y")},
    )
    assert len(programs.programs) == 1  # every layer shares the program: depth changes nothing


def test_a_gathered_tensor_is_whole_on_its_process_split_by_rows_where_they_divide():
    devices = tuple(jax.devices())
    split = gathered(devices, (16, 3))
    assert split.spec == P("d") and split.mesh.shape == {"p": 1, "d": 8}
    assert gathered(devices, (5, 3)).spec == P()  # 5 rows do not divide over 8
    assert gathered(devices, ()).spec == P()
