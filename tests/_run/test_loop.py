"""The run loop (run_plan): a plan made into arrays group by group by a group maker,
everything deleted on failure, the caller's arrays placed and kept, and the caller's
say over the note, the log and the bar."""

import logging

import jax
import numpy as np
import pytest
from helpers import OnesMaker, lecun, mesh8, submesh

import meshinit
from meshinit._errors import PlanError
from meshinit._run import checks as _checks
from meshinit._run import strategies as _strategies
from meshinit._run.loop import run_plan


def two_group_plan():
    stages = [submesh(range(0, 4), (4,), ("x",)), submesh(range(4, 8), (4,), ("x",))]
    return meshinit.plan(
        {
            f"s{i}": meshinit.param((8, 4), lecun(), axes=("x", None), mesh=m)
            for i, m in enumerate(stages)
        }
    )


def test_failure_in_a_later_group_frees_earlier_arrays():
    stages = [submesh(range(0, 4), (4,), ("x",)), submesh(range(4, 8), (4,), ("x",))]
    plan = meshinit.plan(
        [meshinit.param((64, 64), lecun(), axes=("x", None), mesh=m) for m in stages]
    )
    meshinit.materialize(plan, 0)  # compile and cache both groups
    real = _strategies.chosen()

    class FailsInSecondGroup:
        builds, work = real.builds, real.work

        def prepare(self, group, impl):
            run = real.prepare(group, impl)
            if group is not plan.groups[1]:
                return run

            def failing(key_data):
                yield from run(key_data)  # the group's first array is made ...
                raise RuntimeError("device out of memory")  # ... then it fails

            return failing

    before = {id(a) for a in jax.live_arrays()}
    with (
        meshinit.options(strategy=FailsInSecondGroup()),
        pytest.raises(RuntimeError, match="device out of memory"),
    ):
        meshinit.materialize(plan, 1)
    leaked = [a for a in jax.live_arrays() if id(a) not in before]
    assert leaked == []


def test_run_plan_fills_the_plan_with_what_the_runners_yield():
    mesh = mesh8()
    plan = meshinit.plan(
        {
            "w": meshinit.param((8, 4), lecun(), axes=("fsdp", "tensor"), mesh=mesh),
            "b": meshinit.param((4,), lecun(in_axis=0, out_axis=0), axes=("tensor",), mesh=mesh),
        }
    )
    got = run_plan(plan, OnesMaker(), what="ones")
    for path, array in got.items():
        assert array.sharding == plan.entries[[e.path for e in plan.entries].index(path)].sharding
        np.testing.assert_array_equal(np.asarray(array), 1.0)


def test_every_group_is_prepared_in_order_before_any_runner_runs():
    plan = two_group_plan()
    maker = OnesMaker(plan)
    run_plan(plan, maker, what="ones")
    assert maker.events == [("prepare", 0), ("prepare", 1), ("run", 0), ("run", 1)]


class FailsInGroup(OnesMaker):
    """Ones, but group ``failing``'s runner raises after making its arrays (None: a
    group not in the plan given, such as a subplan's)."""

    def __init__(self, plan, failing):
        super().__init__(plan)
        self.failing = failing

    def prepare(self, group):
        made = super().prepare(group)
        if self.index.get(id(group)) != self.failing:
            return made

        def run():
            yield from made()
            raise RuntimeError("device lost")

        return run


def test_a_runner_that_fails_leaves_nothing_behind_and_says_what_it_deleted():
    plan = two_group_plan()
    before = {id(a) for a in jax.live_arrays()}
    with pytest.raises(RuntimeError, match="device lost") as info:
        run_plan(plan, FailsInGroup(plan, 1), what="ones")
    (note,) = info.value.__notes__
    assert note.startswith("meshinit: ones failed while mesh group 1, "), note
    assert note.endswith("making s1; deleted the 2 arrays it had made, and returned nothing")
    alive = [a for a in jax.live_arrays() if id(a) not in before and not a.is_deleted()]
    assert alive == []


def test_the_caller_says_the_failure_note():
    plan = two_group_plan()
    with pytest.raises(RuntimeError, match="device lost") as info:
        run_plan(plan, FailsInGroup(plan, 0), note=lambda n, where: f"mine: {n} gone")
    assert info.value.__notes__ == ["mine: 1 gone"]


def test_given_arrays_are_placed_not_made_and_survive_a_failure():
    plan = two_group_plan()
    mine = jax.device_put(np.full((8, 4), 7, np.float32), plan.entries[0].sharding)
    maker = OnesMaker(plan)
    got = run_plan(plan, maker, given={id(plan.entries[0]): mine})
    assert got["s0"] is mine, "an array already where it belongs is used as it is"
    np.testing.assert_array_equal(np.asarray(got["s1"]), 1.0)
    assert [e for e, _ in maker.events] == ["prepare", "run"], "only the other group is made"

    failing = FailsInGroup(plan, None)  # the group left to make (a subplan's) fails
    with pytest.raises(RuntimeError, match="device lost") as info:
        run_plan(plan, failing, given={id(plan.entries[0]): mine})
    assert not mine.is_deleted(), "the caller's array is the caller's"
    assert "deleted the 1 arrays" in info.value.__notes__[0]


def test_a_plan_that_does_not_fit_is_refused_before_anything_is_made(monkeypatch):
    plan = two_group_plan()
    monkeypatch.setattr(_checks, "memory_stats", lambda d: {"bytes_limit": 16, "bytes_in_use": 0})
    maker = OnesMaker(plan)
    with pytest.raises(PlanError, match="do not fit in the memory planned for them"):
        run_plan(plan, maker)
    assert maker.events == [], "refused before any group is prepared"


def test_the_caller_says_whether_the_call_logs(caplog):
    plan = two_group_plan()
    with caplog.at_level(logging.DEBUG, logger="meshinit"):
        run_plan(plan, OnesMaker(), what="ones", log=False)
    assert caplog.records == []
    with caplog.at_level(logging.INFO, logger="meshinit"):
        run_plan(plan, OnesMaker(), what="ones")
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "ones: 2 params, 2 mesh groups, 0 executables (0 compiled, 0 cached), 2 calls, 256 B"
    )


def test_progress_false_draws_nothing(capfd):
    plan = two_group_plan()
    run_plan(plan, OnesMaker(), what="ones", progress=False)
    assert capfd.readouterr().err == ""
    run_plan(plan, OnesMaker(), what="ones", progress=True)
    assert "meshinit: generating" in capfd.readouterr().err
