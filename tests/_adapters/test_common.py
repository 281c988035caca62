"""One model, declared as a dict, an nnx Module and an equinox Module: identical values.

And what every adapter shares: refusals, and patterns that match nothing.
"""

import re
import warnings

import equinox as eqx
import jax
import numpy as np
import pytest
from flax import nnx
from helpers import lecun

import meshinit

EMBED_MLP_RULES = (("embed", "fsdp"), ("mlp", "tensor"))


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
    with meshinit.defaults(mesh=jax.make_mesh((2, 4), ("fsdp", "tensor")), rules=EMBED_MLP_RULES):
        as_dict = meshinit.init({"layers": [{"w": up(), "b": bias()} for _ in range(2)]}, 11)
    with meshinit.defaults(mesh=jax.make_mesh((4, 2), ("fsdp", "tensor")), rules=EMBED_MLP_RULES):
        as_nnx = meshinit.nnx.materialize(NnxModel(), 11)
    with meshinit.defaults(mesh=jax.make_mesh((1, 8), ("fsdp", "tensor")), rules=EMBED_MLP_RULES):
        as_eqx = meshinit.eqx.materialize(EqxModel(), 11)
    for i in range(2):
        for name in ("w", "b"):
            want = np.asarray(as_dict["layers"][i][name])
            got_nnx = np.asarray(getattr(as_nnx.layers[i], name).get_value())
            got_eqx = np.asarray(getattr(as_eqx.layers[i], name))
            assert np.array_equal(got_nnx, want), f"nnx layers.{i}.{name}"
            assert np.array_equal(got_eqx, want), f"eqx layers.{i}.{name}"
    assert as_eqx.layers[0].w.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


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


# --------------------------------------------------------------- patterns that match nothing

# Each adapter's path of a linear layer's weight, and a typo of it that matches no path.
WEIGHT = {
    "nnx": ("kernel", "kernal"),
    "linen": (r"params\.kernel", r"params\.kernal"),
    "eqx": ("weight", "wieght"),
}
IDLE = {  # what the warning says, up to the regex
    "nnx": "meshes[0] {} matched no variable path",
    "linen": "meshes[0] {} matched no variable path",
    "eqx": "placements[0] {} matched no array leaf",
}


def stages():
    devices = jax.devices()
    return tuple(
        jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[i : i + 4]) for i in (0, 4)
    )


def linear(adapter, call, regex, stage0, stage1):
    """``adapter``'s init or plan of a 16 -> 32 linear layer, ``regex`` putting its weight
    on ``stage1`` and a catch-all everything else on ``stage0``."""
    import flax.linen as nn

    if adapter == "nnx":
        meta = {"out_sharding": ("fsdp", "tensor")}
        factory = lambda: nnx.Linear(16, 32, kernel_metadata=meta, rngs=nnx.Rngs(0))  # noqa: E731
        return getattr(meshinit.nnx, call)(factory, meshes=[(regex, stage1), (r".*", stage0)])
    if adapter == "linen":
        init = nn.with_partitioning(nn.initializers.lecun_normal(), ("fsdp", "tensor"))
        return getattr(meshinit.linen, call)(
            nn.Dense(32, kernel_init=init),
            0,
            np.ones((1, 16), np.float32),
            default="replicated",
            meshes=[(regex, stage1), (r".*", stage0)],
        )
    placements = [(regex, ("fsdp", "tensor"), stage1), (r".*", None, stage0)]
    return getattr(meshinit.eqx, call)(lambda k: eqx.nn.Linear(16, 32, key=k), 0, placements)


@pytest.mark.parametrize("call", ["init", "plan"])
@pytest.mark.parametrize("adapter", ["nnx", "linen", "eqx"])
def test_a_pattern_that_matches_nothing_is_warned_naming_it_and_the_adapter(adapter, call):
    # A typo'd pattern quietly left the weight on the other stage; every leaf is still
    # placed (by the catch-all), so it is a warning naming the idle pattern, not an error.
    stage0, stage1 = stages()
    weight, typo = WEIGHT[adapter]
    said = f"meshinit.{adapter}.{call}: " + IDLE[adapter].format(f'r"{typo}"')
    with pytest.warns(meshinit.UnusedPatternWarning, match=re.escape(said)) as caught:
        out = linear(adapter, call, typo, stage0, stage1)
    (warning,) = [w for w in caught if w.category is meshinit.UnusedPatternWarning]
    assert "re.fullmatch" in str(warning.message) and "fix the regex" in str(warning.message)
    assert warning.filename == __file__, "the warning points at the caller's line"
    if call == "plan":
        (entry,) = [e for e in out.entries if re.fullmatch(weight, e.path)]
        assert entry.mesh == stage0, "the typo left the weight on the catch-all's mesh"


@pytest.mark.parametrize("adapter", ["nnx", "linen", "eqx"])
def test_a_pattern_list_whose_every_pattern_matches_warns_nothing(adapter):
    stage0, stage1 = stages()
    weight, _ = WEIGHT[adapter]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = linear(adapter, "plan", weight, stage0, stage1)
        linear(adapter, "init", weight, stage0, stage1)
    (entry,) = [e for e in plan.entries if re.fullmatch(weight, e.path)]
    assert entry.mesh == stage1


def test_an_eqx_leaf_no_placement_matches_is_one_plan_error_before_compiling(
    count_compiles, new_arrays
):
    # The leaf the typo missed is left unplaced: an error naming the leaf and the idle
    # pattern, its likely cause, raised before anything is compiled or allocated.
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    placements = [(r"wieght", ("fsdp", "tensor")), (r"bias", None), (r"head\..*", None)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error, and no warning besides
        with count_compiles() as compiled, new_arrays() as made:
            with pytest.raises(
                meshinit.PlanError, match=r"1 array leaves matched no placement: weight"
            ) as info:
                meshinit.eqx.init(lambda k: eqx.nn.Linear(16, 32, key=k), 0, placements, mesh=mesh)
    lines = str(info.value).splitlines()
    assert lines[0] == "3 problems found while planning:", lines
    assert 'placements[0] r"wieght" matched no array leaf' in lines[1]
    assert "the paths are like 'weight', 'bias'" in lines[1]
    assert r'placements[2] r"head\..*" matched no array leaf' in lines[2]
    assert compiled.count == 0 and not made, (compiled.count, made)
