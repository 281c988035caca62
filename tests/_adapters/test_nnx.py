"""``rules=`` on ``meshinit.nnx.init``, ``plan`` and ``abstract``; what nnx plans show
in their logical column; RNG state and scalars never suggested for sharding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import mesh8
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

# A MaxText-style table: several rules per name, the first that fits wins (linen's
# algorithm, which flax's nnx context rules follow through get_var_pspec).
MAXTEXT_LIKE_RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"), ("norm", None))


class Block(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            16,
            32,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
            rngs=rngs,
        )
        self.scale = nnx.Param(jnp.ones((16,)), out_sharding=("norm",))
        self.rngs = rngs  # RNG state: a key (2,) and a counter ()


def factory():
    return Block(nnx.Rngs(0))


def _shardings(module):
    return {
        ".".join(map(str, p)): v.get_value().sharding
        for p, v in nnx.to_flat_state(nnx.state(module))
    }


def test_rules_place_as_flax_logical_axis_rules_does():
    mesh = mesh8()
    with jax.set_mesh(mesh), nn.logical_axis_rules(MAXTEXT_LIKE_RULES):
        want = _shardings(meshinit.nnx.init(factory))
    with jax.set_mesh(mesh):
        got = _shardings(meshinit.nnx.init(factory, rules=MAXTEXT_LIKE_RULES))
        plan = meshinit.nnx.plan(factory, rules=MAXTEXT_LIKE_RULES)
        abstract = meshinit.nnx.abstract(factory, rules=MAXTEXT_LIKE_RULES)
    assert got == want
    assert got["up.kernel"] == NamedSharding(mesh, P("fsdp", "tensor"))
    assert got["up.bias"] == NamedSharding(mesh, P("tensor"))
    planned = {e.path: e.sharding for e in plan.entries}
    assert planned["rngs.default.key"].spec == P()  # the scalar key, as init gives it
    assert planned == got
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        assert var.get_value().sharding == got[".".join(map(str, path))]
    # flax's metadata is kept as written: the logical names, not the mesh axes
    with jax.set_mesh(mesh):
        kept = meshinit.nnx.init(factory, rules=MAXTEXT_LIKE_RULES).up.kernel.out_sharding
    assert kept == ("embed", "mlp")


def test_rules_replace_the_callers_table_for_the_call_only():
    other = (("embed", "tensor"), ("mlp", "fsdp"), ("vocab", None), ("norm", None))
    with jax.set_mesh(mesh8()), nn.logical_axis_rules(other):
        got = _shardings(meshinit.nnx.init(factory, rules=MAXTEXT_LIKE_RULES))
        assert nn.get_logical_axis_rules() == other  # the caller's table is back
        theirs = _shardings(meshinit.nnx.init(factory))
    assert got["up.kernel"].spec == P("fsdp", "tensor")
    assert theirs["up.kernel"].spec == P("tensor", "fsdp")


def test_malformed_rules_are_a_clear_error_before_tracing():
    traced = []

    def counting():
        traced.append(1)
        return factory()

    with pytest.raises(TypeError, match=r"bad rule \('embed',\): a rule is \(logical_name"):
        meshinit.nnx.init(counting, rules=[("embed",)])
    assert traced == []


def test_a_rule_naming_an_axis_the_mesh_lacks_is_a_plan_error_naming_the_variable():
    with jax.set_mesh(mesh8()), pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.init(factory, rules=(("embed", "fsdpp"), *MAXTEXT_LIKE_RULES[1:]))
    assert [p.path for p in e.value.problems] == ["up.kernel"]
    assert "'fsdpp'" in str(e.value)


def test_nnx_plans_show_flax_names_and_never_suggest_sharding_rng_state_or_scalars():
    with jax.set_mesh(mesh8()):
        plan = meshinit.nnx.plan(factory, rules=MAXTEXT_LIKE_RULES)
        bare = meshinit.nnx.plan(  # no rules: the names are mesh axes already
            lambda: nnx.Linear(
                16,
                32,
                kernel_init=nnx.with_partitioning(nnx.initializers.ones, ("fsdp", "tensor")),
                rngs=nnx.Rngs(0),
            )
        )
    rows = {line.split()[0]: line for line in str(plan).splitlines() if line.startswith("  ")}
    assert "(embed, mlp)" in rows["up.kernel"] and "fsdp=2,tensor=4" in rows["up.kernel"]
    assert "(mlp)" in rows["up.bias"]
    compact = plan.compact()
    assert "embed,mlp" in compact and "fsdp,tensor" in compact
    flagged = {e.path for g in plan.groups for e in g.shardable_entries}
    assert not any(p.startswith("rngs.") for p in flagged), flagged
    assert "up.kernel" not in flagged  # sharded over both axes: nothing to suggest
    key = next(e for e in plan.entries if e.path == "rngs.default.key")
    assert key.spec.shape == () and key.spec.dtype == jax.random.key(0).dtype  # as init gives it
    assert key.shardable_axes == ()
    bare_rows = [line for line in str(bare).splitlines() if line.startswith("  kernel")]
    assert bare_rows and " - " in bare_rows[0]
