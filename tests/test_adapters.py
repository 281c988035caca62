"""One model, declared as a dict, an nnx Module and an equinox Module: identical values."""

import equinox as eqx
import jax
import numpy as np
import pytest
from flax import nnx

import meshinit

RULES = (("embed", "fsdp"), ("mlp", "tensor"))
lecun = jax.nn.initializers.lecun_normal


def up():
    return meshinit.param((64, 256), lecun(), axes=("embed", "mlp"))


def bias():
    return meshinit.param((256,), jax.nn.initializers.normal(0.02), axes=("mlp",))


class NnxBlock(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(up())
        self.b = nnx.Param(bias())


class NnxModel(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([NnxBlock() for _ in range(2)])


class EqxBlock(eqx.Module):
    w: object
    b: object

    def __init__(self):
        self.w, self.b = up(), bias()


class EqxModel(eqx.Module):
    layers: list

    def __init__(self):
        self.layers = [EqxBlock() for _ in range(2)]


def test_dict_nnx_and_equinox_declarations_give_identical_values():
    # Three different meshes too: values do not depend on topology.
    with meshinit.defaults(mesh=jax.make_mesh((2, 4), ("fsdp", "tensor")), rules=RULES):
        as_dict = meshinit.init({"layers": [{"w": up(), "b": bias()} for _ in range(2)]}, 11)
    with meshinit.defaults(mesh=jax.make_mesh((4, 2), ("fsdp", "tensor")), rules=RULES):
        as_nnx = meshinit.nnx.materialize(NnxModel(), 11)
    with meshinit.defaults(mesh=jax.make_mesh((8,), ("tensor",)), rules=RULES):
        as_eqx = meshinit.eqx.materialize(EqxModel(), 11)
    for i in range(2):
        for name in ("w", "b"):
            want = np.asarray(as_dict["layers"][i][name])
            got_nnx = np.asarray(getattr(as_nnx.layers[i], name).get_value())
            got_eqx = np.asarray(getattr(as_eqx.layers[i], name))
            assert np.array_equal(got_nnx, want), f"nnx layers.{i}.{name}"
            assert np.array_equal(got_eqx, want), f"eqx layers.{i}.{name}"
    assert as_eqx.layers[0].w.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")


# --------------------------------------------------------------- shared refusals


def test_unconstrained_annotations_are_refused_by_every_adapter_with_the_path():
    import flax.linen as nn
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    free = P.UNCONSTRAINED

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.ones, (free, "tensor"))
            return x @ self.param("w", init, (4, 8))

    with pytest.raises(meshinit.PlanError, match="UNCONSTRAINED in its names") as err:
        meshinit.linen.init(Linen(), 0, np.ones((2, 4), np.float32), mesh=mesh)
    assert [p.path for p in err.value.problems] == ["params.w"]

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.numpy.ones((4, 8)), out_sharding=(free, "tensor"), mesh=mesh)

    with pytest.raises(meshinit.PlanError, match="UNCONSTRAINED in its sharding") as err:
        meshinit.nnx.init(lambda: Nnx(nnx.Rngs(0)))
    assert [p.path for p in err.value.problems] == ["w"]
    assert "name mesh axes or None" in str(err.value)


def test_key_arrays_are_refused_with_the_path_and_the_fix():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

    class Holder(eqx.Module):
        w: jax.Array
        key: jax.Array

        def __init__(self, key):
            self.w = jax.random.normal(key, (8, 8))
            self.key = jax.random.split(key)  # a typed key array: not placeable

    with pytest.raises(meshinit.PlanError, match="a PRNG key") as err:
        meshinit.eqx.init(Holder, jax.random.key(0), [(r"w", ("fsdp", None))], mesh=mesh)
    (problem,) = err.value.problems
    assert problem.path == "key" and "make it a static field" in problem.message
