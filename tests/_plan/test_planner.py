"""``meshinit.plan``: every spec resolved to its exact ``NamedSharding``, grouped per mesh
in first-appearance order; every problem gathered with its path and raised once; a built
flax nnx Module refused with the fix."""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import three_mesh_specs
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit import _paths

zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


@pytest.mark.parametrize("explicit", [False, True])
def test_three_mesh_plan_has_exact_shardings_and_one_group_per_mesh(explicit):
    specs, (m1, m2, m3) = three_mesh_specs(explicit)
    p = meshinit.plan(specs)
    assert [e.path for e in p.entries] == ["small_linear1", "small_linear2", "small_linear3"]
    want = [
        NamedSharding(m1, P("a", "b")),
        NamedSharding(m2, P("x", "y", "z")),
        NamedSharding(m3, P("c", None)),
    ]
    assert [e.sharding for e in p.entries] == want
    assert [g.mesh for g in p.groups] == [m1, m2, m3]
    assert all(len(g.entries) == 1 for g in p.groups)


def test_entries_follow_tree_flatten_order_and_other_leaves_pass_through():
    m = AbstractMesh((8,), ("x",))
    tree = {
        "b": [meshinit.param((8,), zeros, axes=("x",), mesh=m), "keep"],
        "a": meshinit.param((2,), ones, mesh=m),
        "c": None,
        "d": 3.0,
    }
    p = meshinit.plan(tree)
    assert [e.path for e in p.entries] == ["a", "b.0"]
    abstract = p.abstract()
    assert abstract["b"][1] == "keep" and abstract["c"] is None and abstract["d"] == 3.0
    assert abstract["a"] == jax.ShapeDtypeStruct(
        (2,), jnp.float32, sharding=NamedSharding(m, P(None))
    )
    assert abstract["b"][0].sharding == NamedSharding(m, P("x"))


def test_groups_collect_entries_by_mesh_in_first_appearance_order():
    m1, m2 = AbstractMesh((8,), ("x",)), AbstractMesh((2, 4), ("x", "y"))
    tree = [meshinit.param((8,), zeros, axes=("x",), mesh=m) for m in (m1, m2, m1, m2, m1)]
    p = meshinit.plan(tree)
    assert [g.mesh for g in p.groups] == [m1, m2]
    assert [e.path for e in p.groups[0].entries] == ["0", "2", "4"]
    assert [e.path for e in p.groups[1].entries] == ["1", "3"]


def errors_of(tree) -> list[str]:
    with pytest.raises(meshinit.PlanError) as info:
        meshinit.plan(tree)
    return [str(p) for p in info.value.problems]


M = AbstractMesh((2, 4), ("fsdp", "tensor"))


@pytest.mark.parametrize(
    "spec, match",
    [
        (meshinit.param((8, 8), zeros, axes=("fsdp",), mesh=M), "have 1 entries but shape"),
        (
            meshinit.param((6, 8), zeros, axes=("tensor", None), mesh=M),
            r"dimension 0 of size 6 is not divisible by mesh axes 'tensor' of size 4",
        ),
        (
            meshinit.param((8, 8), zeros, axes=("fsdp", "fsdp"), mesh=M),
            "'fsdp' appear more than once",
        ),
        (
            meshinit.param((8, 8), zeros, axes=(("fsdp", "tensor"), "tensor"), mesh=M),
            "mesh axis 'tensor' used by more than one dimension",
        ),
        (
            meshinit.param((8, 8), zeros, axes=("data", None), mesh=M),
            r"mesh axis name\(s\) 'data' not in the mesh \(axes: fsdp, tensor\)",
        ),
        (meshinit.param((8, 8), zeros, axes=("fsdp", None)), "no mesh given and no default"),
        (meshinit.param((8, 8), zeros, mesh="mesh"), "must be a jax.sharding.Mesh"),
        (meshinit.param((8, 8), "normal", mesh=M), "init 'normal' is not callable"),
        (
            meshinit.param((8, 8), lambda k, s, d: jnp.zeros((8,), d), mesh=M),
            r"init returned float32\[8\], expected float32\[8, 8\]",
        ),
        (
            meshinit.param((8, 8), lambda k, s, d: jnp.zeros(s, jnp.int32), mesh=M),
            r"init returned int32\[8, 8\], expected float32\[8, 8\]",
        ),
        (meshinit.param((8, 8), lambda k, s: jnp.zeros(s), mesh=M), "init raised TypeError"),
        (
            meshinit.param((8, 8), lambda k, s, d: (jnp.zeros(s), 1), mesh=M),
            "init returned a tuple",
        ),
        (
            meshinit.param((8,), zeros, axes=("embed",), mesh=M, rules=(("mlp", "tensor"),)),
            r"logical axis 'embed' has no rule; known: mlp; add \('embed', None\)",
        ),
    ],
)
def test_each_bad_spec_is_a_plan_error_naming_its_path(spec, match):
    problems = errors_of({"layers": [{"w": spec}]})
    assert len(problems) == 1
    assert problems[0].startswith("layers.0.w: ")
    assert re.search(match, problems[0]), problems[0]


def test_all_problems_are_gathered_and_raised_once():
    tree = {
        "a": meshinit.param((8, 8), zeros, axes=("fsdp",), mesh=M),
        "b": meshinit.param((8, 8), zeros),
        "c": meshinit.param((8, 8), zeros, axes=("fsdp", "tensor"), mesh=M),  # fine
        "d": meshinit.param((8, 8), 3, mesh=M),
    }
    with pytest.raises(meshinit.PlanError, match="3 problems found while planning") as info:
        meshinit.plan(tree)
    assert [p.path for p in info.value.problems] == ["a", "b", "d"]
    assert isinstance(info.value, ValueError)


def test_duplicate_paths_are_an_error():
    spec = meshinit.param((8,), zeros, mesh=M)
    problems = errors_of({"a.b": spec, "a": {"b": spec}})
    assert problems == [
        "a.b: two parameters have this path; rename one (paths join keys "
        "with '.', so 'a.b' and a/b collide)"
    ]


def test_digest_collisions_are_detected(monkeypatch):
    monkeypatch.setattr(_paths, "path_digest", lambda path: (1, 2))
    spec = meshinit.param((8,), zeros, mesh=M)
    problems = errors_of({"x": spec, "y": spec})
    assert problems == ["y: its 64-bit key digest collides with 'x'; rename one of them"]


def test_uneven_shardings_are_rejected_so_every_device_of_a_mesh_holds_the_same():
    with pytest.raises(meshinit.PlanError, match="dimension 0 of size 6 is not divisible"):
        meshinit.plan(meshinit.param((6,), ones, axes=("tensor",), mesh=M))


def test_bad_replication_marks_are_named_all_at_once():
    mesh = AbstractMesh((2, 4), ("data", "fsdp"))
    init = jax.nn.initializers.zeros
    specs = {
        "typo": meshinit.param((16,), init, mesh=mesh, replicated="dta"),
        "sharded": meshinit.param((16,), init, axes=("fsdp",), mesh=mesh, replicated="fsdp"),
        "also": meshinit.param((16,), init, mesh=mesh, replicated=("data", "tensr")),
    }
    with pytest.raises(meshinit.PlanError) as err:
        meshinit.plan(specs)
    got = {p.path: p.message for p in err.value.problems}
    assert "'dta', which no mesh of the plan has (they have: data, fsdp)" in got["typo"]
    assert sorted(got) == ["also", "typo"]  # sharded over a marked axis: not replicated, fine
    assert "'tensr'" in got["also"]
    with meshinit.defaults(mesh=mesh, replicated="dta"):  # a model-wide typo: said once
        many = [meshinit.param((16,), init) for _ in range(5)]
    with pytest.raises(meshinit.PlanError) as err:
        meshinit.plan(many)
    (problem,) = err.value.problems
    assert problem.path == "0" and "(so do 4 more parameters)" in problem.message
    with pytest.raises(TypeError, match="replicated must be a mesh axis name"):
        meshinit.param((16,), init, mesh=mesh, replicated=3)


# A built flax nnx Module: a PlanError that points to meshinit.nnx. Ordinary nnx code holds
# arrays (with or without flax sharding metadata), never specs.

MESH = jax.make_mesh((2, 4), ("fsdp", "tensor"))
lecun_init = jax.nn.initializers.lecun_normal()


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
            self.w = nnx.Param(lecun_init(rngs.params(), (8, 16)), **metadata)

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
