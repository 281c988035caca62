"""flax nnx's logical axis rules, checked before flax resolves them: a rule naming a mesh
axis the mesh lacks, and a name no rule maps, said in the words the spec path, linen and
equinox use for the same mistake."""

import types

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
import meshinit.eqx
import meshinit.linen
import meshinit.maxtext
import meshinit.nnx

BAD_RULE = (("embed", "fsdp"), ("mlp", "model"))  # no mesh has 'model'


class Up(nnx.Module):
    def __init__(self, rngs, names=("embed", "mlp"), features=16):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
        self.up = nnx.Linear(8, features, kernel_init=init, use_bias=False, rngs=rngs)


class LinenUp(nn.Module):
    features: int = 16

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return nn.Dense(self.features, kernel_init=init, use_bias=False, name="up")(x)


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


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_dimension_that_does_not_divide_names_its_logical_axis_on_every_path(kind):
    mesh, rules = _mesh(kind), (("embed", "fsdp"), ("mlp", "tensor"))
    init = jax.nn.initializers.lecun_normal()
    spec = meshinit.param((8, 14), init, axes=("embed", "mlp"), mesh=mesh, rules=rules)
    want = (
        "dimension 1 (logical 'mlp') of size 14 is not divisible by mesh axes 'tensor' of "
        "size 4; pad the dimension or map it to other mesh axes"
    )

    class Own(nnx.Module):  # the rules in the Variable's own metadata
        def __init__(self, rngs):
            value = nnx.initializers.lecun_normal()(rngs.params(), (8, 14))
            self.up = nnx.Param(value, out_sharding=("embed", "mlp"), sharding_rules=rules)

    messages = {
        # nnx resolved the names to mesh axes before planning and the message lost them
        "nnx": _message(
            lambda: meshinit.nnx.plan(lambda: Up(nnx.Rngs(0), features=14), rules=rules, mesh=mesh)
        ),
        "nnx own rules": _message(lambda: meshinit.nnx.init(lambda: Own(nnx.Rngs(0)), mesh=mesh)),
        "spec": _message(lambda: meshinit.plan({"up": spec})),
        "linen": _message(
            lambda: meshinit.linen.plan(
                LinenUp(14), jax.random.key(0), np.ones((1, 8), np.float32), rules=rules, mesh=mesh
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


@pytest.mark.parametrize("typo", ["mlpp", "mpl"])  # an extra letter; two swapped
def test_a_typo_in_nnx_metadata_gets_the_guess_first(typo):
    mesh = _mesh("explicit")
    rules = (("embed", "fsdp"), ("mlp", "tensor"))
    with pytest.raises(
        meshinit.PlanError,
        match=rf"up\.kernel: logical axis '{typo}' in its sharding \('embed', '{typo}'\) has no "
        r"rule in flax's logical axis rules and is not a mesh axis \(axes: fsdp, tensor\); did "
        rf"you mean 'mlp'\? \(known: embed, mlp\); fix the name, or add \('{typo}', None\) to",
    ):
        meshinit.nnx.plan(lambda: Up(nnx.Rngs(0), ("embed", typo)), rules=rules, mesh=mesh)


# -- MaxText's resolution: two names of one Variable on one mesh axis -------------------

# MaxText's order (gdn_head and embed_attn both list fsdp_transpose; embed has two rules)
GDN_RULES = (
    ("embed_attn", ("fsdp", "fsdp_transpose")),
    ("mlp", ("fsdp_transpose", "tensor")),
    ("gdn_head", ("fsdp_transpose", "tensor")),
    ("embed", ("fsdp", "fsdp_transpose")),
    ("embed", "fsdp"),
)
GDN_NAMES = {
    "in_proj": ("embed_attn", "gdn_head"),  # flax nnx: fsdp_transpose on both dimensions
    "out_proj": ("gdn_head", "embed_attn"),
    "up": ("embed", "mlp"),  # linen: mlp takes fsdp_transpose, embed falls to 'fsdp'
    "norm": ("embed",),  # nnx: embed's last rule; linen: its first
    "local": ("embed_attn", "gdn_head"),  # its own sharding_rules come first (MaxText)
}
LOCAL = (("gdn_head", ("tensor",)),)


class Gdn(nnx.Module):
    def __init__(self, rngs, local=True):
        def param(names, shape, **more):
            value = jax.random.normal(rngs.params(), shape)
            return nnx.Param(value, out_sharding=names, **more)

        self.in_proj = param(GDN_NAMES["in_proj"], (8, 16))
        self.out_proj = param(GDN_NAMES["out_proj"], (16, 8))
        self.up = param(GDN_NAMES["up"], (8, 16))
        self.norm = param(GDN_NAMES["norm"], (8,))
        if local:  # flax nnx raises on a local rule that differs from the context's
            self.local = param(GDN_NAMES["local"], (8, 16), sharding_rules=LOCAL)


def _gdn_mesh(kind: str):
    names = ("fsdp", "fsdp_transpose", "tensor")  # every axis 2: no unit axis is dropped
    if kind == "explicit":
        return jax.make_mesh((2, 2, 2), names)
    return Mesh(np.array(jax.devices()).reshape(2, 2, 2), names)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_maxtext_rules_resolve_nnx_names_as_flax_linen_does(kind):
    mesh = _gdn_mesh(kind)
    config = types.SimpleNamespace(logical_axis_rules=[list(r) for r in GDN_RULES])
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Gdn(nnx.Rngs(0)))
    rules = meshinit.maxtext.rules(config, abstract)
    # flax's own function, as MaxText's NNX init calls it: the Variable's sharding_rules,
    # then the table
    want = {
        path: NamedSharding(
            mesh,
            nn.logical_to_mesh_axes(names, (*LOCAL, *GDN_RULES) if path == "local" else GDN_RULES),
        )
        for path, names in GDN_NAMES.items()
    }
    # gdn_head's one rule skipped (embed_attn took fsdp_transpose), embed's first rule
    assert want["in_proj"].spec == P(("fsdp", "fsdp_transpose"), None)
    assert want["norm"].spec == P(("fsdp", "fsdp_transpose"))
    assert want["local"].spec == P(("fsdp", "fsdp_transpose"), ("tensor",))
    with jax.set_mesh(mesh):
        plan = meshinit.nnx.plan(lambda: Gdn(nnx.Rngs(0)), rules=rules)
        model = meshinit.nnx.init(lambda: Gdn(nnx.Rngs(0)), rules=rules)
    assert {e.path: e.sharding for e in plan.entries if e.path in want} == want
    placed = {p: getattr(model, p).get_value().sharding for p in want}
    assert placed == want


def test_flax_nnx_resolution_of_one_axis_on_two_dimensions_is_refused_naming_the_fix():
    mesh = _gdn_mesh("explicit")
    with nnx.use_eager_sharding(False), nn.logical_axis_rules(GDN_RULES):
        made = Gdn(nnx.Rngs(0), local=False)
        # flax nnx's own placement of the same Variable: jax refuses it (its
        # DuplicateSpecError is no ValueError on jax 0.10)
        with pytest.raises(Exception, match="duplicate entries for `fsdp_transpose`"):
            nnx.get_named_sharding(nnx.state(made), mesh)
    with pytest.raises(meshinit.PlanError) as exc:
        meshinit.nnx.plan(lambda: Gdn(nnx.Rngs(0), local=False), rules=GDN_RULES, mesh=mesh)
    # up and norm resolve under nnx: embed's last rule, 'fsdp'
    assert [p.path for p in exc.value.problems] == ["in_proj", "out_proj"]
    message = exc.value.problems[0].message
    assert message.startswith(
        "its logical axes ('embed_attn', 'gdn_head') resolve, as flax nnx resolves them "
        "(each name's last rule, whatever the others took), to "
        "P(('fsdp', 'fsdp_transpose'), ('fsdp_transpose', 'tensor')): mesh axis "
        "'fsdp_transpose' on dimensions 0 ('embed_attn') and 1 ('gdn_head'). jax refuses"
    ), message
    assert "pass rules=meshinit.maxtext.rules(config, nnx.eval_shape(factory))" in message
    assert "change the rules so that no two of these names map to one mesh axis" in message


def test_maxtext_rules_under_nnx_refuse_a_name_without_rule_and_a_missing_axis():
    mesh = _gdn_mesh("explicit")
    config = types.SimpleNamespace(logical_axis_rules=[("embed", "fsdp"), ("mlp", "model")])
    rules = meshinit.maxtext.rules(config, {})  # nothing completed: 'heads' has no rule

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Param(jnp.zeros((8, 16)), out_sharding=("embed", "heads"))
            self.b = nnx.Param(jnp.zeros((8, 16)), out_sharding=("embed", "mlp"))

    with pytest.raises(meshinit.PlanError) as exc:
        meshinit.nnx.plan(lambda: Two(nnx.Rngs(0)), rules=rules, mesh=mesh)
    found = {p.path: p.message for p in exc.value.problems}
    assert found["a"].startswith(
        "logical axis 'heads' in its sharding ('embed', 'heads') has no rule in the rules"
    ), found
    assert found["b"].startswith("rule ('mlp', 'model') names mesh axis 'model', which is in none")
