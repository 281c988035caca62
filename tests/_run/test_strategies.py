import jax
import numpy as np
import pytest
from helpers import LAYERED_RULES, assert_exact, flat_values, layered_specs, submesh

import meshinit
from meshinit._run import strategies as _strategies
from meshinit._run.loop import run_plan


def test_compiles_do_not_grow_with_depth(count_compiles):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    counts = []
    for layers in (2, 16):
        meshinit.clear_cache()
        plan = meshinit.plan(layered_specs(mesh, layers, LAYERED_RULES))
        signatures = {e.signature for e in plan.entries}
        assert len(signatures) == 5  # embed, q, up, n, u: the same at any depth
        with count_compiles() as cold:
            meshinit.materialize(plan, 0)
        with count_compiles() as warm:
            meshinit.materialize(plan, 1)
        # at most one compile per distinct signature per mesh group; none when warm
        assert 1 <= cold.count <= len(signatures)
        assert warm.count == 0
        counts.append(cold.count)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("strategy", sorted(_strategies.STRATEGIES))
def test_every_strategy_compiles_at_most_once_per_signature(strategy, count_compiles):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    plan = meshinit.plan(layered_specs(mesh, 3, LAYERED_RULES))
    meshinit.clear_cache()
    key_data, impl = meshinit._paths.host_key(0)
    s = _strategies.STRATEGIES[strategy]
    with count_compiles() as cold:  # builds: compiled in parallel first, as materialize does
        run_plan(plan, _strategies.Specs(s, key_data, impl))
    with count_compiles() as warm:
        run_plan(plan, _strategies.Specs(s, key_data, impl))
    assert 1 <= cold.count <= len({e.signature for e in plan.entries})
    assert warm.count == 0


@pytest.mark.parametrize("explicit", [False, True])
def test_strategies_give_identical_values_and_exact_shardings(explicit):
    mesh = submesh(range(8), (2, 4), ("fsdp", "tensor"), explicit)
    plan = meshinit.plan(layered_specs(mesh, 2, LAYERED_RULES))
    key_data, impl = meshinit._paths.host_key(3)
    results = {
        name: run_plan(plan, _strategies.Specs(strategy, key_data, impl))
        for name, strategy in _strategies.STRATEGIES.items()
    }
    base = flat_values(results.pop("rounds"))
    for tree in results.values():
        assert_exact(plan, tree)
        got = flat_values(tree)
        for path, value in base.items():
            assert np.array_equal(got[path], value), path
