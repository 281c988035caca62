import jax
import pytest
from helpers import lecun, submesh

import meshinit
from meshinit._run import strategies as _strategies


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
