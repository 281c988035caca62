"""The group maker protocol: what run_plan asks of the spec path, the constructor
engine and optax's state init, and that each of them hands run_plan one."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import OnesMaker, lecun, mesh8

import meshinit
import meshinit.nnx
import meshinit.optax
from meshinit._engine import run as _engine_run
from meshinit._run import loop as _loop
from meshinit._run import materialize as _materialize
from meshinit._run import strategies as _strategies
from meshinit._run.maker import GroupMaker


def test_the_spec_path_and_a_hand_made_maker_implement_the_protocol():
    key_data, impl = meshinit._paths.host_key(0)
    assert isinstance(_strategies.Specs(_strategies.Rounds(), key_data, impl), GroupMaker)
    assert isinstance(OnesMaker(), GroupMaker)


def test_an_object_missing_a_member_is_no_maker():
    class NoWork:
        def builds(self, group):
            return []

        def prepare(self, group):
            return lambda: iter(())

    assert not isinstance(NoWork(), GroupMaker)


@pytest.fixture
def makers(monkeypatch):
    """The makers the three paths hand run_plan, by path."""
    seen = {}

    def spy(name, module):
        def run_plan(plan, maker, **kwargs):
            seen[name] = maker
            return _loop.run_plan(plan, maker, **kwargs)

        monkeypatch.setattr(module, "run_plan", run_plan)

    spy("specs", _materialize)
    spy("engine", _engine_run)
    spy("optax", meshinit.optax)
    return seen


def test_specs_the_engine_and_optax_all_run_through_run_plan_with_a_maker(makers):
    mesh = mesh8()
    params = meshinit.init(
        {"w": meshinit.param((8, 4), lecun(), axes=("fsdp", "tensor"), mesh=mesh)}, 0
    )
    state = meshinit.optax.init(optax.adam(1e-3), params)

    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.numpy.ones((8, 8)), out_sharding=("fsdp", None), mesh=mesh)

    meshinit.nnx.init(M)
    assert set(makers) == {"specs", "engine", "optax"}
    for name, maker in makers.items():
        assert isinstance(maker, GroupMaker), name
    assert state[0].mu["w"].sharding == params["w"].sharding
    np.testing.assert_array_equal(np.asarray(state[0].mu["w"]), 0.0)
