"""eqx's trace-and-plan: ``factory(key)`` traced once and its array leaves planned by
``placements=``: full matches, every unplaced leaf named with its fix, every problem
of a table and of planning in one PlanError, and ``existing=`` as a Module of the
factory's structure."""

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import RULES, eqx_linear, eqx_mlp, mesh8, same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
import meshinit.eqx


def test_regexes_match_the_whole_path():
    mesh = jax.make_mesh((8,), ("x",))
    # "weight" alone would be a search hit in every weight path, but not a full match:
    # one line for the regex, with the fix, and one for the leaves it missed.
    with pytest.raises(meshinit.PlanError) as info:
        meshinit.eqx.init(eqx_mlp, 0, [(r"weight", None), (r".*bias", None)], mesh=mesh)
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 2
    assert 'placements[0] r"weight" matched no array leaf' in lines[0]
    assert "re.fullmatch" in lines[0] and "r'.*weight'" in lines[0]
    assert "3 array leaves matched no placement: layers.0.weight" in lines[1]


def test_unmatched_leaves_are_all_listed_with_the_fix():
    mesh = jax.make_mesh((8,), ("x",))
    with pytest.raises(meshinit.PlanError, match=r"3 problems") as info:
        meshinit.eqx.init(eqx_mlp, 0, [(r"layers\.\d+\.bias", None)], mesh=mesh)
    assert [p.path for p in info.value.problems] == [
        "layers.0.weight",
        "layers.1.weight",
        "layers.2.weight",
    ]
    message = str(info.value)
    assert "layers.2.weight: no placement matched this path" in message
    assert r'add one, for example (r"layers\.2\.weight", None) to replicate it' in message


def test_placement_problems_and_planning_problems_are_raised_together():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    placements = [
        ("(", None),  # does not compile
        (r"layers\.0\.weight", "mlp"),  # a str, not a tuple of axes
        (r"layers\.1\.weight", ("mlpp", "embed")),  # a typo: no rule
        (r"layers\.1\.bias", ("mlp",)),  # fine
        (r"layers\.2\.bias", ("embed", "mlp")),  # two axes for one dimension
        ("too", "many", "entries", "are", "here"),
    ]
    with pytest.raises(meshinit.PlanError, match=r"regex '\(' does not compile") as info:
        meshinit.eqx.init(eqx_mlp, 0, placements, mesh=mesh, rules=RULES)
    messages = [str(p) for p in info.value.problems]
    assert any(m.startswith("placements[5] must be (regex, axes)") for m in messages)
    assert any(
        m.startswith('placements[1] r"layers\\.0\\.weight": axes must be None, a jax.sharding')
        for m in messages
    )
    paths = [p.path for p in info.value.problems]
    assert "layers.0.weight" not in paths  # reported once, on its placement
    assert "layers.0.bias" in paths and "layers.2.weight" in paths  # unmatched
    assert any(m.startswith("layers.1.weight: logical axis 'mlpp' has no rule") for m in messages)
    assert any(m.startswith("layers.2.bias: ") for m in messages)
    assert "layers.1.bias" not in paths


def test_no_mesh_anywhere_is_a_plan_error():
    with pytest.raises(meshinit.PlanError, match=r'placements\[0\] r".\*": no mesh for') as e:
        meshinit.eqx.init(eqx_mlp, 0, [(r".*", None)])
    assert "pass mesh= to meshinit.eqx.init" in str(e.value) and "param()" not in str(e.value)


@pytest.mark.parametrize("call", ["plan", "init"])
def test_a_sharding_placement_without_a_mesh_names_mesh_on_the_function_called(call):
    with pytest.raises(
        meshinit.PlanError,
        match=rf'placements\[0\] r".\*weight": no mesh for the leaves it places '
        rf"\(layers\.0\.weight, \.\.\.\); pass mesh= to meshinit\.eqx\.{call},",
    ):
        getattr(meshinit.eqx, call)(eqx_mlp, 0, [(r".*weight", P("x")), (r".*bias", None)])


def test_key_leaves_are_reported_by_path():
    mesh = jax.make_mesh((8,), ("x",))
    with pytest.raises(meshinit.PlanError, match=r"1: holds a key<fry> array"):
        meshinit.eqx.init(lambda k: (eqx_linear(k), k), 0, [(r".*", None)], mesh=mesh)


def test_the_factory_is_traced_exactly_once():
    # A factory that builds something else on each call still gets one consistent
    # module: the engine traces it once and never calls it again.
    widths = iter([8, 16, 16])
    calls = []

    def drifting(key):
        calls.append(key)
        return eqx.nn.Linear(4, next(widths), key=key)

    mesh = jax.make_mesh((8,), ("x",))
    out = meshinit.eqx.init(drifting, 0, [(r".*", None)], mesh=mesh)
    assert len(calls) == 1
    assert out.weight.shape == (8, 4) and out.bias.shape == (8,)
    ref = eqx.nn.Linear(4, 8, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.weight), np.asarray(ref.weight))


def test_placements_must_be_a_sequence():
    # a dict is a tree of shardings; one keyed by regexes says what a table is
    with pytest.raises(meshinit.PlanError, match=r"a list of \(regex, axes\) tuples"):
        meshinit.eqx.init(eqx_mlp, 0, {r".*": None})
    with pytest.raises(TypeError, match="placements must be an ordered sequence"):
        meshinit.eqx.init(eqx_mlp, 0, r".*")


def test_an_eqx_module_of_arrays_given_as_existing_is_placed_as_given():
    mesh = mesh8(("fsdp", "tp"), explicit=True)

    def factory(k):
        return eqx.nn.MLP(4, 4, 8, 1, key=k)

    given = factory(jax.random.key(7))  # a checkpoint restored into the structure
    table = [(r".*weight", ("fsdp", None)), (r".*", None)]
    got = meshinit.eqx.init(factory, 0, table, mesh=mesh, existing=given)
    for layer, want in zip(got.layers, given.layers, strict=True):
        same_bits(layer.weight, want.weight, "weight")
        same_bits(layer.bias, want.bias, "bias")
        assert layer.weight.sharding == NamedSharding(mesh, P("fsdp", None))
