"""One placement checked alike whatever form gave it: the axes, mesh and memory kind a
tree's leaf or a rule's answer gives, and what is wrong with one that is malformed."""

import jax
import pytest
from helpers import mesh8
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshinit._adapters.placement import parsed


def test_a_named_sharding_gives_its_mesh_spec_and_memory_kind():
    mesh = mesh8()
    got = parsed.given("tree", NamedSharding(mesh, P("fsdp", None)), "fix")
    assert isinstance(got, parsed.Parsed)
    assert (got.axes, got.mesh_axes, got.mesh) == (("fsdp", None), True, mesh)
    assert got.memory_kind is None  # jax's "device" is left to the defaults() one
    assert got.spelled == 2 and got.per_path


@pytest.mark.parametrize(
    ("value", "axes", "mesh_axes"),
    [(None, None, False), (P("fsdp"), ("fsdp",), True), (("embed", None), ("embed", None), False)],
    ids=["replicated", "partitionspec", "logical tuple"],
)
def test_specs_tuples_and_none_give_axes_without_a_mesh(value, axes, mesh_axes):
    got = parsed.given("rule", value, "fix")
    assert (got.axes, got.mesh_axes, got.mesh) == (axes, mesh_axes, None)


def test_a_partitionspec_pads_with_none_to_the_rank_as_jax_pads_it_and_a_tuple_does_not():
    spec = parsed.given("rule", P("fsdp"), "fix")
    assert spec.axes_for(3) == ("fsdp", None, None)
    assert spec.rules_for((("embed", "fsdp"),)) is None  # mesh axes, never resolved
    logical = parsed.given("rule", ("embed",), "fix")
    assert logical.axes_for(3) == ("embed",)  # the planner says the length is wrong
    assert logical.rules_for("rules") == "rules"


@pytest.mark.parametrize(
    ("value", "wrong"),
    [
        ("mlp", "for one dimension write ('mlp',)"),
        (3, "got int 3; give a jax.sharding.NamedSharding"),
        (P(P.UNCONSTRAINED), "UNCONSTRAINED cannot be placed exactly"),
        ((1, None), "each axes entry must be a name, a tuple of names or None; got 1"),
    ],
    ids=["str", "int", "unconstrained", "number entry"],
)
def test_what_is_wrong_with_a_malformed_placement_is_said(value, wrong):
    got = parsed.given("rule", value, "fix")
    assert isinstance(got, str) and wrong in got


def test_a_variable_holding_no_array_is_named_with_its_placement_and_fix():
    problem = parsed.not_an_array("step", 'placements[0] r"step"', 3, "narrow it")
    assert str(problem) == (
        'step: placements[0] r"step": holds int, not an array; meshinit cannot place it; narrow it'
    )
    assert parsed.Parsed.shards(("a", None)) and not parsed.Parsed.shards((None,))
    assert not parsed.Parsed.shards(None)
    assert jax.sharding.PartitionSpec() == P()  # P() is what None is spelled as
