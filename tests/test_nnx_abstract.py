"""``meshinit.nnx.abstract``: the Module ``init`` would return, holding
``ShapeDtypeStruct``s with their exact shardings, and the restore target of an nnx
checkpoint in any layout."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

import meshinit


def _mesh(ids, shape, axis_types=None):
    devices = np.array([jax.devices()[i] for i in ids]).reshape(shape)
    return Mesh(devices, ("a", "b"), axis_types=axis_types)


def mesh8():
    return _mesh(range(8), (2, 4))


def stages():
    return _mesh(range(4), (2, 2)), _mesh(range(4, 8), (2, 2))


class Block(nnx.Module):
    def __init__(self, rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b"))
        self.up = nnx.Linear(8, 16, kernel_init=kernel, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((16,), jnp.bfloat16), out_sharding=("b",))
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Block(rngs) for _ in range(3)])
        self.rngs = rngs  # typed keys in the state


def factory():
    return Model(nnx.Rngs(0))


def _flat(module):
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(module))}


STAGES = [(r"layers\.0\..*", 0), (r".*", 1)]


def _stage_meshes():
    s = stages()
    return [(pattern, s[i]) for pattern, i in STAGES]


@pytest.mark.parametrize("staged", [False, True], ids=["one mesh", "two stages"])
def test_abstract_is_init_as_structs_with_the_same_shardings_and_metadata(staged, count_compiles):
    meshes = _stage_meshes() if staged else None
    with jax.set_mesh(mesh8()):
        with count_compiles() as compiles:
            before = {id(x) for x in jax.live_arrays()}
            abstract = meshinit.nnx.abstract(factory, meshes=meshes)
            assert {id(x) for x in jax.live_arrays()} <= before  # nothing allocated
        model = meshinit.nnx.init(factory, meshes=meshes)
    assert compiles.count == 0
    structs, arrays = _flat(abstract), _flat(model)
    assert structs.keys() == arrays.keys()
    for path, var in structs.items():
        struct, array = var.get_value(), arrays[path].get_value()
        assert isinstance(struct, jax.ShapeDtypeStruct), path
        assert (struct.shape, struct.dtype) == (array.shape, array.dtype), path
        assert struct.sharding == array.sharding, path
        assert type(var) is type(arrays[path]), path
        assert var.get_metadata() == arrays[path].get_metadata(), path
    assert jax.dtypes.issubdtype(structs["rngs.default.key"].get_value().dtype, jax.dtypes.prng_key)
    if staged:
        first, rest = stages()
        assert structs["layers.0.up.kernel"].get_value().sharding.mesh == first
        assert structs["layers.2.up.kernel"].get_value().sharding.mesh == rest


def test_abstract_plans_on_abstract_meshes_before_the_hardware_exists():
    auto = (AxisType.Auto,) * 2
    big = jax.sharding.AbstractMesh((16, 64), ("a", "b"), axis_types=auto)

    class Wide(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b"))
            self.w = nnx.Linear(1024, 4096, kernel_init=init, use_bias=False, rngs=rngs)

    struct = meshinit.nnx.abstract(lambda: Wide(nnx.Rngs(0)), meshes=[(r".*", big)]).w.kernel
    assert struct.get_value().sharding.mesh == big
    assert struct.get_value().sharding.shard_shape((1024, 4096)) == (64, 64)


@pytest.mark.parametrize(
    "saved, restored",
    [("one mesh", "two stages"), ("two stages", "one mesh"), ("one mesh", "4x2 explicit")],
)
def test_an_nnx_checkpoint_restores_into_abstract_in_another_layout(saved, restored, tmp_path):
    def layout(name):
        if name == "one mesh":
            return [(r".*", mesh8())]
        if name == "two stages":
            return _stage_meshes()
        return [(r".*", _mesh(range(8), (4, 2), (AxisType.Explicit,) * 2))]

    model = meshinit.nnx.init(factory, meshes=layout(saved))
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, nnx.state(model))  # flax's usual checkpoint
        checkpointer.wait_until_finished()
        graphdef, target = nnx.split(meshinit.nnx.abstract(factory, meshes=layout(restored)))
        back = nnx.merge(graphdef, checkpointer.restore(path, target))
    want, structs, got = _flat(model), _flat(nnx.merge(graphdef, target)), _flat(back)
    assert got.keys() == want.keys()
    for p, var in got.items():
        value, saved_value = var.get_value(), want[p].get_value()
        assert value.sharding == structs[p].get_value().sharding, p
        assert value.dtype == saved_value.dtype, p
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value, saved_value = jax.random.key_data(value), jax.random.key_data(saved_value)
        assert np.asarray(value).tobytes() == np.asarray(saved_value).tobytes(), p
    # the restored Module is an ordinary one: its keys draw as the saved model's do
    drawn, want_drawn = back.rngs.params(), model.rngs.params()
    assert np.array_equal(jax.random.key_data(drawn), jax.random.key_data(want_drawn))
