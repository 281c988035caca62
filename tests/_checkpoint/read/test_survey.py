"""What a load reads, found before it reads: every file checked, every plan path
resolved, the dtype policy (casts within a kind), every stored tensor accounted for."""

import jax
import numpy as np
import pytest
from helpers import load_refused, mesh8, plan_for, stored

import meshinit
from meshinit._checkpoint.read import survey

save_file = pytest.importorskip("safetensors.numpy").save_file


def test_a_survey_accounts_for_every_path_and_every_tensor(tmp_path):
    path = stored(tmp_path, {"a": np.ones(4, np.float32), "extra": np.ones(2, np.float32)})
    plan = plan_for({"a": (4,), "b": (4,)})
    found = survey.survey(plan, path, None, "what")
    assert found.problems == []
    assert found.inventory.files == (path,)
    assert list(found.inventory.loaded) == ["a"] and found.inventory.unused == ("extra",)
    assert found.inventory.missing == {"b": "b"}
    assert [p.path for p in found.absent] == ["b"]
    assert [j.entry.path for j in found.jobs] == ["a"]


def test_a_cast_across_kinds_is_a_problem_and_within_a_kind_is_not(tmp_path):
    path = stored(tmp_path, {"a": np.ones(4, np.int32), "b": np.ones(4, np.float16)})
    found = survey.survey(plan_for({"a": (4,), "b": (4,)}), path, None, "what")
    (problem,) = found.problems
    assert problem.path == "a"
    assert "meshinit casts within a kind (floats to floats, ints to ints)" in problem.message


def test_a_survey_takes_a_plan():
    with pytest.raises(TypeError, match="what takes a Plan"):
        survey.survey({"a": 1}, "x.safetensors", None, "what")


def test_a_tensor_in_two_files_is_named(tmp_path):
    save_file({"a": np.ones(4, np.float32)}, str(tmp_path / "x.safetensors"))
    save_file({"a": np.zeros(4, np.float32)}, str(tmp_path / "y.safetensors"))
    load_refused(plan_for({"a": (4,)}), tmp_path, "'a' is also in")


def test_a_cast_across_kinds_is_refused_before_reading(tmp_path):
    save_file(
        {"a": np.ones(4, np.float32), "b": np.ones(4, np.int32)}, str(tmp_path / "m.safetensors")
    )
    plan = meshinit.plan(
        {
            "a": meshinit.param((4,), jax.nn.initializers.zeros, dtype=np.int32, mesh=mesh8()),
            "b": meshinit.param((4,), jax.nn.initializers.zeros, dtype=np.float32, mesh=mesh8()),
        }
    )
    error = load_refused(plan, tmp_path, "casts within a kind")
    assert [p.path for p in error.problems] == ["a", "b"]


def test_an_absent_tensor_gets_no_guess_that_names_a_weight_of_another_kind(tmp_path):
    # difflib's ratio (0.72) named the MLP weight for the attention one: following that
    # advice (names=) would load the one into the other, with no error at equal shapes
    path = stored(tmp_path, {"model.layers.0.mlp.gate_proj.weight": np.ones(4, np.float32)})
    plan = plan_for({"model.layers.0.self_attn.q_proj.weight": (4,)})
    (problem,) = survey.survey(plan, path, None, "what").absent
    assert "is not in the files" in problem.message
    assert "did you mean" not in problem.message, problem.message
    plan = plan_for({"model.layers.0.mlp.gate_proj.wieght": (4,)})
    (problem,) = survey.survey(plan, path, None, "what").absent
    assert "did you mean 'model.layers.0.mlp.gate_proj.weight'?" in problem.message
