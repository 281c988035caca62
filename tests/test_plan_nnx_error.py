"""``meshinit.plan`` on a built flax nnx Module: a PlanError that points to meshinit.nnx.

Ordinary nnx code holds arrays (with or without flax sharding metadata), never specs;
planning it used to give an empty plan without a word.
"""

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

import meshinit

MESH = jax.make_mesh((2, 4), ("fsdp", "tensor"))
ones = jax.nn.initializers.ones
lecun = jax.nn.initializers.lecun_normal()


class Annotated(nnx.Module):
    """Existing nnx code: flax sharding metadata on its kernels, as flax's guide writes it."""

    def __init__(self, rngs):
        meta = {"out_sharding": ("fsdp", "tensor"), "mesh": MESH}
        self.up = nnx.Linear(8, 16, kernel_metadata=meta, rngs=rngs)
        self.down = nnx.Linear(16, 8, kernel_metadata=meta, rngs=rngs)


class Plain(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(8, 16, rngs=rngs)


class Declared(nnx.Module):
    """Spec-declared: what meshinit.plan and meshinit.nnx.materialize take."""

    def __init__(self):
        self.w = nnx.Param(meshinit.param((8, 8), ones, axes=("fsdp", "tensor"), mesh=MESH))
        self.count = nnx.BatchStat(jnp.zeros(3))  # an array beside the spec


def points_to_nnx(name):
    return rf"plan its constructor instead, which allocates nothing: meshinit\.nnx\.plan\(lambda: {name}\(\.\.\.\)\)"  # noqa: E501


def test_metadata_module_is_a_plan_error_naming_the_metadata_and_the_fix():
    with pytest.raises(meshinit.PlanError, match=points_to_nnx("Annotated")) as e:
        meshinit.plan(Annotated(nnx.Rngs(0)))
    assert isinstance(e.value, ValueError)
    [problem] = e.value.problems
    assert problem.path == ""  # the tree itself
    assert problem.message.startswith(
        "Annotated is an nnx Module whose Variables hold arrays with flax sharding "
        "metadata (down.kernel: out_sharding, mesh, up.kernel: out_sharding, mesh), not "
        "meshinit specs, so there is nothing to plan"
    )
    assert problem.message.endswith(
        "meshinit.nnx.init(lambda: Annotated(...)) builds it placed as that metadata says"
    )


@pytest.mark.parametrize(
    "metadata, named",
    [
        ({"out_sharding": ("fsdp", None), "mesh": MESH}, "out_sharding, mesh"),
        ({"out_sharding": ("fsdp", None)}, "out_sharding"),
        # flax 0.12 stores the older keys as out_sharding; older flax kept them
        ({"sharding": ("fsdp", None), "mesh": MESH}, "(out_)?sharding, mesh"),
        ({"sharding_names": ("fsdp", None), "mesh": MESH}, "(out_sharding|sharding_names), mesh"),
        ({"mesh": MESH}, "mesh"),
    ],
    ids=["out_sharding", "no mesh", "sharding (older)", "sharding_names (older)", "mesh only"],
)
def test_every_flax_sharding_key_is_recognised(metadata, named):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(lecun(rngs.params(), (8, 16)), **metadata)

    with warnings.catch_warnings(), nnx.use_eager_sharding(False):
        warnings.simplefilter("ignore", DeprecationWarning)  # sharding=, sharding_names=
        model = Model(nnx.Rngs(0))
    with pytest.raises(meshinit.PlanError, match=rf"flax sharding metadata \(w: {named}\)"):
        meshinit.plan(model)


def test_module_without_metadata_is_the_same_error_and_says_it_would_replicate():
    with pytest.raises(meshinit.PlanError, match=points_to_nnx("Plain")) as e:
        meshinit.plan(Plain(nnx.Rngs(0)))
    assert e.value.problems[0].message.startswith(
        "Plain is an nnx Module whose Variables hold arrays (l.bias, l.kernel) with no flax "
        "sharding metadata, not meshinit specs"
    )
    assert e.value.problems[0].message.endswith(
        "Variables without metadata are replicated; or declare specs: "
        "nnx.Param(meshinit.param(...))"
    )


def test_abstract_module_from_eval_shape_says_abstract_arrays():
    abstract = nnx.eval_shape(lambda: Annotated(nnx.Rngs(0)))
    with pytest.raises(
        meshinit.PlanError,
        match=r"hold abstract arrays \(jax\.ShapeDtypeStruct\) with flax sharding metadata",
    ):
        meshinit.plan(abstract)


def test_many_arrays_are_counted_not_listed():
    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])

    with pytest.raises(
        meshinit.PlanError, match=r"\(layers\.0\.bias, layers\.0\.kernel and 4 more\)"
    ):
        meshinit.plan(Deep(nnx.Rngs(0)))


def test_a_module_inside_a_tree_is_named_by_its_path():
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.plan({"lr": 3e-4, "model": Annotated(nnx.Rngs(0))})
    assert [p.path for p in e.value.problems] == ["model"]
    assert str(e.value).splitlines()[1].startswith("  model: Annotated is an nnx Module")


def test_init_raises_it_too_before_allocating(new_arrays):
    model = Annotated(nnx.Rngs(0))
    with new_arrays() as made, pytest.raises(meshinit.PlanError, match=points_to_nnx("Annotated")):
        meshinit.init(model, 0)
    assert made == []


def test_spec_declared_module_still_plans_with_its_pytree_paths():
    plan = meshinit.plan(Declared())
    # the Module's pytree paths, as before; the array beside the spec passes through
    assert [e.path for e in plan.entries] == ["w.value"]
    assert plan.entries[0].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    placed = meshinit.nnx.materialize(Declared(), 0)
    assert placed.w.get_value().sharding == plan.entries[0].sharding


def test_specs_beside_a_built_module_plan_and_the_module_passes_through():
    model = Plain(nnx.Rngs(0))
    tree = {"w": meshinit.param((8, 8), ones, mesh=AbstractMesh((2,), ("x",))), "model": model}
    plan = meshinit.plan(tree)
    assert [e.path for e in plan.entries] == ["w"]
    assert plan.fill([None])["model"] is not None


def test_modules_without_arrays_plan_empty_as_an_empty_tree_does():
    class Empty(nnx.Module):
        def __init__(self):
            self.depth = 3

    assert meshinit.plan(Empty()).entries == ()
    assert meshinit.plan({}).entries == ()


def test_an_empty_plan_does_not_import_flax():
    code = (
        "import sys, meshinit\n"
        "assert meshinit.plan({'lr': 3e-4}).entries == ()\n"
        "assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert r.returncode == 0, r.stderr
