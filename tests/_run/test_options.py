"""meshinit.options(host_eval_bytes=...): the constructor engine's host bound, as data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import LAYERED_RULES, flat_values, layered_specs
from jax.sharding import Mesh

import meshinit
from meshinit._engine import trace as _trace
from meshinit._run import strategies as _strategies


@pytest.mark.parametrize(
    "bound, error, says",
    [
        ("16k", TypeError, "host_eval_bytes must be a number of bytes .* got str '16k'"),
        (1.5, TypeError, "host_eval_bytes must be a number of bytes .* got float 1.5"),
        (True, TypeError, "host_eval_bytes must be a number of bytes .* got bool True"),
        (-1, ValueError, "host_eval_bytes must be 0 or more .* got -1"),
    ],
)
def test_a_host_bound_that_is_not_a_count_of_bytes_is_refused(bound, error, says):
    with pytest.raises(error, match=says):
        with meshinit.options(host_eval_bytes=bound):
            pass


def test_the_host_bound_nests_and_is_restored():
    assert _trace.host_bound() == _trace.SMALL_BYTES
    with meshinit.options(host_eval_bytes=8):
        assert _trace.host_bound() == 8
        with meshinit.options(strategy="per_signature"):  # sets only the strategy
            assert _trace.host_bound() == 8
        with meshinit.options(host_eval_bytes=0):
            assert _trace.host_bound() == 0
        assert _trace.host_bound() == 8
    assert _trace.host_bound() == _trace.SMALL_BYTES


def test_values_and_placement_do_not_depend_on_the_host_bound():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    class M(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(
                jax.random.normal(rngs.params(), (16, 8)), out_sharding=("a", "b"), mesh=mesh
            )
            self.s = nnx.Param(jax.random.uniform(rngs.params(), (8,)) * 1.37)
            key = rngs.params()
            self.c = nnx.Param(
                jax.lax.fori_loop(
                    0,
                    3,
                    lambda i, x: x * 0.5 + jax.random.normal(jax.random.fold_in(key, i), x.shape),
                    jnp.zeros((4, 3)),
                )
            )

    def factory():
        return M(nnx.Rngs(0))

    with nnx.use_eager_sharding(False):
        want = nnx.to_flat_state(nnx.state(factory()))
    for bound in (None, 0, 8, 64):
        with meshinit.options(host_eval_bytes=bound):
            got = nnx.to_flat_state(nnx.state(meshinit.nnx.init(factory)))
        for (path, g), (_, w) in zip(got, want, strict=True):
            assert np.asarray(g.get_value()).tobytes() == np.asarray(w.get_value()).tobytes(), (
                f"host_eval_bytes={bound}: {path} differs from eager construction"
            )
        assert got[-1][1].get_value().sharding.spec == jax.sharding.PartitionSpec("a", "b")


def test_the_strategy_is_chosen_per_block_and_nests(count_compiles):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    plan = meshinit.plan(layered_specs(mesh, 3, LAYERED_RULES))
    base = flat_values(meshinit.materialize(plan, 4))
    meshinit.clear_cache()
    with meshinit.options(strategy="per_signature"):
        assert _strategies.chosen() is _strategies.STRATEGIES["per_signature"]
        with meshinit.options(compiler_options={}):  # the strategy stays
            assert _strategies.chosen() is _strategies.STRATEGIES["per_signature"]
        with count_compiles() as compiles:
            got = flat_values(meshinit.materialize(plan, 4))
    assert compiles.count == len({e.signature for e in plan.entries})  # one per signature
    assert _strategies.chosen() is _strategies.STRATEGIES["rounds"]
    for path, value in base.items():
        assert np.array_equal(got[path], value), path


def test_bad_options_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="'rounds', 'per_signature'"):
        with meshinit.options(strategy="fused_group"):
            pass
    with pytest.raises(TypeError, match="has no builds, work"):
        with meshinit.options(strategy=object()):
            pass
    with pytest.raises(TypeError, match="compiler_options must be a mapping"):
        with meshinit.options(compiler_options=[("a", 1)]):
            pass
    with pytest.raises(TypeError, match=r"'xla_x': \[1\]"):
        with meshinit.options(compiler_options={"xla_x": [1]}):
            pass
