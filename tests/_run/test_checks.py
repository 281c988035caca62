"""What the run loop checks before it allocates anything."""

import jax.numpy as jnp
import pytest
from helpers import lecun, mesh8

import meshinit
from meshinit._run import checks


def plan_wb():
    mesh = mesh8()
    return meshinit.plan(
        {
            "w": meshinit.param((8, 4), lecun(), axes=("fsdp", "tensor"), mesh=mesh),
            "b": meshinit.param((4,), lecun(in_axis=0, out_axis=0), axes=("tensor",), mesh=mesh),
        }
    )


def test_split_given_leaves_only_what_is_to_be_made():
    plan = plan_wb()
    given, todo = checks.split_given(plan, {"b": jnp.zeros(4)}, "test")
    assert [e.path for e in todo.entries] == ["w"]
    assert [plan.entries[i].path for i, e in enumerate(plan.entries) if id(e) in given] == ["b"]


def test_split_given_refuses_what_does_not_fit_the_plan_all_at_once():
    with pytest.raises(meshinit.PlanError, match="test: existing= does not fit") as info:
        checks.split_given(plan_wb(), {"b": jnp.zeros(5), "nope": jnp.zeros(1)}, "test")
    assert {p.path for p in info.value.problems} == {"b", "nope"}


def test_a_bound_smaller_than_a_parameter_is_a_problem_naming_it():
    plan = plan_wb()
    problems = checks.bound_problems(plan.entries, 8)
    assert [p.path for p in problems] == ["w"]
    assert "max_bytes_per_call=8" in problems[0].message


def test_an_unplanned_existing_path_gets_no_guess_that_names_another_weight():
    # difflib's ratio (0.67) named the MLP path for the attention one: the advice would
    # place the attention array as the MLP weight
    plan = meshinit.plan(
        {"layers.0.mlp.up": meshinit.param((8, 4), lecun(), axes=("fsdp", "tensor"), mesh=mesh8())}
    )
    with pytest.raises(meshinit.PlanError) as info:
        checks.split_given(plan, {"layers.0.attn.q": jnp.zeros((8, 4))}, "test")
    assert "not a planned parameter" in str(info.value)
    assert "did you mean" not in str(info.value), str(info.value)
    with pytest.raises(meshinit.PlanError, match=r"did you mean 'layers\.0\.mlp\.up'\?"):
        checks.split_given(plan, {"layers.0.mpl.up": jnp.zeros((8, 4))}, "test")
