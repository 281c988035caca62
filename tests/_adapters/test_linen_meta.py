"""flax linen's partitioning boxes read as specs: every variable without an annotation
named at once, ``default=`` placing them (and refusing a malformed one)."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers import boxes_by_path
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
import meshinit.linen


class Unannotated(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(
            8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tensor"))
        )(x)
        x = nn.Dense(8, name="plain")(x)
        return nn.BatchNorm(use_running_average=True, name="bn")(x)


def test_unannotated_variables_are_named_all_at_once():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    x = np.ones((2, 4), np.float32)
    with pytest.raises(meshinit.PlanError, match="with_partitioning") as err:
        meshinit.linen.init(Unannotated(), jax.random.PRNGKey(0), x, mesh=mesh)
    paths = {p.path for p in err.value.problems}
    assert paths == {
        "params.plain.kernel",
        "params.plain.bias",
        "params.Dense_0.bias",
        "params.bn.scale",
        "params.bn.bias",
        "batch_stats.bn.mean",
        "batch_stats.bn.var",
    }, paths
    assert "params.plain.kernel" in str(err.value) and 'default="replicated"' in str(err.value)


@pytest.mark.parametrize("how", ["replicated", "mesh", "sharding"])
def test_a_catch_all_default_places_unannotated_variables(how):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    default = {"replicated": "replicated", "mesh": mesh, "sharding": NamedSharding(mesh, P())}
    x = np.ones((2, 4), np.float32)
    model, key = Unannotated(), jax.random.PRNGKey(0)
    variables = meshinit.linen.init(model, key, x, mesh=mesh, default=default[how])
    eager = model.init(key, x)
    kernel = variables["params"]["Dense_0"]["kernel"].value
    assert kernel.sharding == NamedSharding(mesh, P(None, "tensor"))
    for path, leaf in boxes_by_path(nn.unbox(variables)).items():
        assert leaf.sharding.mesh == mesh, path
        if path != "params.Dense_0.kernel":
            assert leaf.sharding.is_fully_replicated, (path, leaf.sharding)
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(variables), nn.unbox(eager))


def test_a_bad_default_is_rejected():
    dense = nn.Dense(4)
    with pytest.raises(ValueError, match="default must be"):
        meshinit.linen.init(dense, jax.random.PRNGKey(0), np.ones((1, 2)), default="sharded")
    with pytest.raises(TypeError, match="default must be"):
        meshinit.linen.init(dense, jax.random.PRNGKey(0), np.ones((1, 2)), default=3)


@pytest.mark.parametrize("call", ["plan", "init"])
def test_no_mesh_names_mesh_on_the_function_called(call):
    class Sharded(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tensor"))
            return nn.Dense(8, kernel_init=init, use_bias=False)(x)

    fn = getattr(meshinit.linen, call)
    with pytest.raises(
        meshinit.PlanError,
        match=rf"params\.Dense_0\.kernel: is annotated but has no mesh: pass mesh= to "
        rf"meshinit\.linen\.{call} or to its annotation",
    ):
        fn(Sharded(), jax.random.PRNGKey(0), np.ones((2, 4), np.float32))
