"""flax nnx's logical axis rules, checked before flax resolves them: a rule naming a mesh
axis the mesh lacks, and a name no rule maps, said in the words the spec path, linen and
equinox use for the same mistake."""

import equinox as eqx
import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import meshinit
import meshinit.eqx
import meshinit.linen
import meshinit.nnx

BAD_RULE = (("embed", "fsdp"), ("mlp", "model"))  # no mesh has 'model'


class Up(nnx.Module):
    def __init__(self, rngs, names=("embed", "mlp")):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
        self.up = nnx.Linear(8, 16, kernel_init=init, use_bias=False, rngs=rngs)


class LinenUp(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return nn.Dense(16, kernel_init=init, use_bias=False, name="up")(x)


def _mesh(kind: str):
    if kind == "explicit":  # jax.make_mesh: Explicit axes
        return jax.make_mesh((2, 4), ("fsdp", "tensor"))
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))  # Auto axes


def _message(call) -> str:
    with pytest.raises(meshinit.PlanError) as exc:
        call()
    [problem] = exc.value.problems
    return problem.message


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_rule_naming_a_missing_axis_reads_the_same_on_every_path(kind):
    mesh = _mesh(kind)
    spec = meshinit.param(
        (8, 16),
        jax.nn.initializers.lecun_normal(),
        axes=("embed", "mlp"),
        mesh=mesh,
        rules=BAD_RULE,
    )
    want = (
        "rule ('mlp', 'model') names mesh axis 'model', which is in none of the plan's "
        "meshes (axes: fsdp, tensor); flax would build a PartitionSpec jax refuses, and "
        "meshinit does not guess a placement instead: fix the axis name, add the axis to "
        "the mesh, or drop the rule"
    )
    # nnx resolved the rule itself and said only that the mesh lacks 'model'
    with pytest.raises(meshinit.PlanError, match=r"up\.kernel: rule \('mlp', 'model'\) names"):
        meshinit.nnx.plan(lambda: Up(nnx.Rngs(0)), rules=BAD_RULE, mesh=mesh)
    messages = {
        "nnx": _message(
            lambda: meshinit.nnx.plan(lambda: Up(nnx.Rngs(0)), rules=BAD_RULE, mesh=mesh)
        ),
        "spec": _message(lambda: meshinit.plan({"up": spec})),
        "linen": _message(
            lambda: meshinit.linen.plan(
                LinenUp(), jax.random.key(0), np.ones((1, 8), np.float32), rules=BAD_RULE, mesh=mesh
            )
        ),
        "eqx": _message(
            lambda: meshinit.eqx.plan(
                lambda k: eqx.nn.Linear(8, 16, use_bias=False, key=k),
                0,
                [(r"weight", ("mlp", "embed"))],
                rules=BAD_RULE,
                mesh=mesh,
            )
        ),
    }
    assert messages == dict.fromkeys(messages, want)


def test_a_rule_is_named_once_however_many_variables_use_it():
    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a = Up(rngs)
            self.b = Up(rngs)

    mesh = _mesh("explicit")
    with pytest.raises(
        meshinit.PlanError, match=r"^1 problem found while planning:\n  a\.up\.kernel: rule"
    ):
        meshinit.nnx.plan(lambda: Two(nnx.Rngs(0)), rules=BAD_RULE, mesh=mesh)


def test_a_rule_whose_axis_only_another_mesh_has_is_named_at_each_variable_it_breaks():
    # nnx applies a rule on every mesh (flax's get_var_pspec); linen's algorithm would
    # skip it on a mesh without the axis. Here flax's own spelling is refused by jax.
    devices = jax.devices()
    here = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[:4])
    there = jax.make_mesh((2, 2), ("fsdp", "model"), devices=devices[4:])

    class Stages(nnx.Module):
        def __init__(self, rngs):
            self.s0 = Up(rngs)
            self.s1 = Up(rngs)

    with nnx.use_eager_sharding(False), nn.logical_axis_rules(BAD_RULE):
        made = Stages(nnx.Rngs(0))
        with pytest.raises(ValueError, match="model"):
            nnx.get_named_sharding(nnx.state(made.s0), here)
    with pytest.raises(
        meshinit.PlanError,
        match=r"^1 problem found while planning:\n  s0\.up\.kernel: rule \('mlp', 'model'\) "
        r"names mesh axis 'model', which its mesh lacks \(axes: fsdp, tensor; another mesh "
        r"of the plan has it\); .*drop the rule$",
    ):
        meshinit.nnx.plan(
            lambda: Stages(nnx.Rngs(0)),
            rules=BAD_RULE,
            meshes=[(r"s0\..*", here), (r"s1\..*", there)],
        )


def test_a_typo_in_nnx_metadata_gets_the_guess_first():
    mesh = _mesh("explicit")
    rules = (("embed", "fsdp"), ("mlp", "tensor"))
    with pytest.raises(
        meshinit.PlanError,
        match=r"up\.kernel: logical axis 'mlpp' in its sharding \('embed', 'mlpp'\) has no rule in "
        r"flax's logical axis rules and is not a mesh axis \(axes: fsdp, tensor\); did you mean "
        r"'mlp'\? \(known: embed, mlp\); fix the name, or add \('mlpp', None\) to the rules",
    ):
        meshinit.nnx.plan(lambda: Up(nnx.Rngs(0), ("embed", "mlpp")), rules=rules, mesh=mesh)
