"""The group maker protocol: what run_plan asks of the spec path, the engine and optax."""

import jax
import numpy as np
import pytest
from helpers import lecun, mesh8

import meshinit
from meshinit._run import strategies as _strategies
from meshinit._run.loop import run_plan
from meshinit._run.maker import GroupMaker
from meshinit._run.place import place


class Ones:
    """A maker with no executables: each entry placed from the host as ones."""

    def builds(self, group):
        return []

    def work(self, group):
        return [(None, 1)]

    def prepare(self, group):
        def run():
            for pos, e in enumerate(group.entries):
                yield pos, place(np.ones(e.spec.shape, e.spec.dtype), e.sharding)

        return run


def test_the_spec_path_and_a_hand_made_maker_implement_the_protocol():
    key_data, impl = meshinit._paths.host_key(0)
    assert isinstance(_strategies.Specs(_strategies.Rounds(), key_data, impl), GroupMaker)
    assert isinstance(Ones(), GroupMaker)


def test_run_plan_fills_the_plan_with_what_the_runners_yield():
    mesh = mesh8()
    plan = meshinit.plan(
        {
            "w": meshinit.param((8, 4), lecun(), axes=("fsdp", "tensor"), mesh=mesh),
            "b": meshinit.param((4,), lecun(in_axis=0, out_axis=0), axes=("tensor",), mesh=mesh),
        }
    )
    got = run_plan(plan, Ones(), what="ones")
    for path, array in got.items():
        assert array.sharding == plan.entries[[e.path for e in plan.entries].index(path)].sharding
        np.testing.assert_array_equal(np.asarray(array), 1.0)


def test_a_runner_that_fails_leaves_nothing_behind():
    plan = meshinit.plan({"w": meshinit.param((8, 4), lecun(), mesh=mesh8())})

    class Failing(Ones):
        def prepare(self, group):
            made = super().prepare(group)

            def run():
                yield from made()
                raise RuntimeError("device lost")

            return run

    before = {id(a) for a in jax.live_arrays()}
    with pytest.raises(RuntimeError, match="device lost") as info:
        run_plan(plan, Failing(), what="ones")
    assert any("deleted the 1 arrays" in n for n in info.value.__notes__)
    alive = [a for a in jax.live_arrays() if id(a) not in before and not a.is_deleted()]
    assert not any(a.shape == (8, 4) for a in alive)
