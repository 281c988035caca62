import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    LAYERED_RULES,
    assert_exact,
    flat_values,
    layered_specs,
    lecun,
    reference,
    same_bits,
    submesh,
    three_mesh_specs,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh

import meshinit
from meshinit._run import strategies as _strategies


@pytest.mark.parametrize(
    "context, explicit",  # the fast tier: each mesh kind once, with and without a context
    [
        (False, False),
        pytest.param(False, True, marks=pytest.mark.slow),
        pytest.param(True, False, marks=pytest.mark.slow),
        (True, True),
    ],
)
def test_three_meshes_materialize_exactly_with_or_without_context_mesh(explicit, context):
    specs, _ = three_mesh_specs(explicit)
    plan = meshinit.plan(specs)
    if context:
        with jax.set_mesh(jax.make_mesh((4, 2), ("data", "context"))):
            out = meshinit.materialize(plan, jax.random.key(0))
    else:
        out = meshinit.materialize(plan, jax.random.key(0))
    by_path = assert_exact(plan, out)
    for e in plan.entries:
        want = reference(e.spec, jax.random.key(0), e.path, e.sharding)
        same_bits(by_path[e.path], want, e.path)


@pytest.mark.parametrize("explicit", [False, True])
def test_disjoint_pipeline_stages_materialize_under_a_context_mesh(explicit):
    # flax/jit fail here with "incompatible devices": one jit cannot output to both.
    stages = [
        submesh(range(0, 4), (2, 2), ("fsdp", "tensor"), explicit),
        submesh(range(4, 8), (2, 2), ("fsdp", "tensor"), explicit),
    ]
    specs = [
        {
            "w": meshinit.param((32, 64), lecun(), axes=("fsdp", "tensor"), mesh=m),
            "b": meshinit.param((64,), jax.nn.initializers.zeros, axes=("tensor",), mesh=m),
        }
        for m in stages
    ]
    plan = meshinit.plan(specs)
    assert len(plan.groups) == 2
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        key = jax.random.key(1)  # placed on the context mesh
        out = meshinit.materialize(plan, key)
    by_path = assert_exact(plan, out)
    assert {d.id for d in by_path["0.w"].devices()} == {0, 1, 2, 3}
    assert {d.id for d in by_path["1.w"].devices()} == {4, 5, 6, 7}


def test_overlapping_and_reordered_submeshes():
    meshes = [
        submesh([0, 1, 2, 3], (4,), ("x",)),
        submesh([2, 3, 4, 5], (2, 2), ("x", "y")),
        submesh([7, 6, 5, 4, 3, 2, 1, 0], (8,), ("x",), explicit=True),
    ]
    specs = {
        f"m{i}": meshinit.param((16, 8), lecun(), axes=("x", None), mesh=m)
        for i, m in enumerate(meshes)
    }
    plan = meshinit.plan(specs)
    out = meshinit.materialize(plan, 0)
    assert_exact(plan, out)


def test_seed_typed_and_legacy_keys_give_the_same_values():
    specs, _ = three_mesh_specs(explicit=True)
    plan = meshinit.plan(specs)
    a = meshinit.materialize(plan, 5)
    b = meshinit.materialize(plan, jax.random.key(5))
    c = meshinit.materialize(plan, jax.random.PRNGKey(5))
    for k in a:
        assert np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k])


def test_values_are_bit_identical_across_meshes_groupings_order_and_other_params():
    base = flat_values(
        meshinit.init(layered_specs(jax.make_mesh((2, 4), ("fsdp", "tensor")), 2, LAYERED_RULES), 0)
    )
    one_device = submesh([5], (1, 1), ("fsdp", "tensor"))
    variants = [
        layered_specs(jax.make_mesh((4, 2), ("fsdp", "tensor")), 2, LAYERED_RULES),
        layered_specs(submesh([3, 1, 2, 0], (2, 2), ("fsdp", "tensor")), 2, LAYERED_RULES),
        layered_specs(one_device, 2, LAYERED_RULES),
        layered_specs(
            jax.make_mesh((1, 8), ("fsdp", "tensor")), 2, LAYERED_RULES
        ),  # fsdp of size 1
        layered_specs(
            jax.make_mesh((2, 4), ("fsdp", "tensor")), 3, LAYERED_RULES, extra=True
        ),  # more params
    ]
    # Another grouping: every layer on its own mesh.
    split = layered_specs(jax.make_mesh((2, 4), ("fsdp", "tensor")), 2, LAYERED_RULES)
    split["layers"][1] = layered_specs(
        submesh(range(4), (2, 2), ("fsdp", "tensor")), 2, LAYERED_RULES
    )["layers"][1]
    variants.append(split)
    # Declaration order: a tree whose flatten order differs, same paths.
    variants.append(
        {
            "layers": {
                "1": layered_specs(one_device, 2, LAYERED_RULES)["layers"][1],
                "0": layered_specs(one_device, 2, LAYERED_RULES)["layers"][0],
            },
            "embed": layered_specs(one_device, 1, LAYERED_RULES)["embed"],
        }
    )
    for tree in variants:
        got = flat_values(meshinit.init(tree, 0))
        for path, value in base.items():
            assert np.array_equal(got[path], value), path


def test_values_equal_the_jitted_reference_on_the_planned_shardings_bit_for_bit():
    tree = layered_specs(jax.make_mesh((2, 4), ("fsdp", "tensor")), 2, LAYERED_RULES)
    plan = meshinit.plan(tree)
    got = flat_values(meshinit.materialize(plan, jax.random.key(42)))
    for e in plan.entries:
        same_bits(got[e.path], reference(e.spec, jax.random.key(42), e.path, e.sharding), e.path)


def test_second_key_and_same_shaped_model_trigger_zero_compiles(count_compiles):
    meshinit.clear_cache()
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    plan = meshinit.plan(layered_specs(mesh, 3, LAYERED_RULES))
    keys = [jax.random.key(i) for i in range(3)]  # the user's own key ops compile outside
    with count_compiles() as first:
        a = meshinit.materialize(plan, keys[0])
    assert first.count >= 1
    with count_compiles() as second:
        b = meshinit.materialize(plan, keys[1])
        c = meshinit.materialize(
            meshinit.plan(layered_specs(mesh, 3, LAYERED_RULES)), 2
        )  # fresh closures
        meshinit.materialize(plan, jax.random.PRNGKey(5))
    assert second.count == 0
    assert not np.array_equal(a["embed"], b["embed"])
    assert not np.array_equal(b["embed"], c["embed"])


def largest_array_in(compiled) -> int:
    shapes = re.findall(r"\b(?:f32|bf16|u32|s32|f16)\[([\d,]*)\]", compiled.as_text())
    return max(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)


@pytest.mark.parametrize(
    "explicit",
    [pytest.param(False, marks=pytest.mark.slow), True],  # Auto axes: in "all"
)
def test_no_device_ever_holds_a_full_copy(explicit):
    mesh = submesh(range(8), (2, 4), ("fsdp", "tensor"), explicit)
    specs = {
        "up": meshinit.param((512, 1024), lecun(), axes=("fsdp", "tensor"), mesh=mesh),
        "down": meshinit.param(
            (1024, 512), jax.nn.initializers.normal(), axes=("tensor", "fsdp"), mesh=mesh
        ),
    }
    plan = meshinit.plan(specs)
    group = plan.groups[0]
    full = 512 * 1024
    for name, strategy in _strategies.STRATEGIES.items():
        for exe in strategy.executables(group, "threefry2x32"):
            # Per-device programs see only shard-sized arrays (1/8 of a parameter).
            assert largest_array_in(exe) <= full // 8, name


def test_abstract_mesh_cannot_be_materialized():
    plan = meshinit.plan({"w": meshinit.param((8, 8), lecun(), mesh=AbstractMesh((8,), ("x",)))})
    with pytest.raises(meshinit.PlanError, match="w: mesh .* is abstract"):
        meshinit.materialize(plan, 0)


def test_materialize_rejects_sharding_dependent_keys():
    plan = meshinit.plan(
        {"w": meshinit.param((8,), jax.nn.initializers.normal(), mesh=jax.make_mesh((8,), ("x",)))}
    )
    with pytest.raises(ValueError, match="'rbg' generates values that depend on the sharding"):
        meshinit.materialize(plan, jax.random.key(0, impl="rbg"))


def test_materialize_rejects_non_plans_with_the_fix():
    with pytest.raises(TypeError, match=r"call meshinit.init\(tree, key\)"):
        meshinit.materialize({"w": 1}, 0)


def test_empty_and_spec_free_trees_pass_through():
    assert meshinit.init({"a": 1, "b": [None, "x"]}, 0) == {"a": 1, "b": [None, "x"]}


FACTORIZATIONS = [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8), (8, 1), (2, 1, 4)]
INITS = [
    jax.nn.initializers.normal(0.5),
    jax.nn.initializers.uniform(2.0),
    jax.nn.initializers.truncated_normal(),
]
FAN_INITS = [lecun(), jax.nn.initializers.he_uniform()]  # need at least 2 dimensions


@st.composite
def mesh_and_specs(draw):
    shape = draw(st.sampled_from(FACTORIZATIONS))
    names = tuple("abc"[: len(shape)])
    perm = draw(st.permutations(range(8)))
    explicit = draw(st.booleans())
    mesh = submesh(perm, shape, names, explicit)
    specs = {}
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        dims = tuple(8 * draw(st.integers(1, 3)) for _ in range(ndim))
        free = list(names)
        axes = []
        for _ in range(ndim):
            choice = draw(st.sampled_from([None, *free]))
            if choice is not None:
                free.remove(choice)
            axes.append(choice)
        specs[f"p{i}"] = meshinit.param(
            dims,
            draw(st.sampled_from(INITS + (FAN_INITS if ndim > 1 else []))),
            axes=tuple(axes),
            mesh=mesh,
            dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        )
    return mesh, specs


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(mesh_and_specs(), st.integers(0, 2**31 - 1))
def test_property_exact_placement_and_value_contract_on_random_meshes(mesh_specs, seed):
    mesh, specs = mesh_specs
    plan = meshinit.plan(specs)
    by_path = assert_exact(plan, meshinit.materialize(plan, seed))
    single = submesh([0], (1,) * len(mesh.axis_names), mesh.axis_names)
    alone = {
        k: meshinit.param(s.shape, s.init, axes=s.axes, mesh=single, dtype=s.dtype)
        for k, s in specs.items()
    }
    single_values = meshinit.init(alone, seed)
    for e in plan.entries:
        want = reference(e.spec, jax.random.key(seed), e.path, e.sharding)
        same_bits(by_path[e.path], want, e.path)
        # one device: jit's bits there, the same as on the mesh wherever jit's are
        # (XLA's CPU code may round a narrow block otherwise than the whole array)
        one = reference(e.spec, jax.random.key(seed), e.path)
        same_bits(single_values[e.path], one, f"{e.path} on one device")
