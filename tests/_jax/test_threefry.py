import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.extend.random import threefry2x32_p
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit._jax import threefry as _threefry
from meshinit._run import compile as _compile
from meshinit._run import strategies as _strategies
from meshinit._run.loop import run_plan

u32 = st.integers(0, 2**32 - 1)


def jax_hash(k1, k2, x1, x2):
    return [np.asarray(a) for a in jax.jit(threefry2x32_p.bind)(k1, k2, x1, x2)]


@settings(max_examples=examples(30, 8), deadline=None)
@given(
    k1=u32,
    k2=u32,
    counters=hnp.arrays(np.uint32, hnp.array_shapes(min_dims=0, max_dims=3), elements=u32),
)
def test_straight_line_hash_is_jaxs_threefry_bit_for_bit(k1, k2, counters):
    k1, k2 = np.uint32(k1), np.uint32(k2)
    x2 = counters[::-1].copy() if counters.ndim else counters ^ np.uint32(0x9E3779B9)
    got = [np.asarray(a) for a in jax.jit(_threefry.threefry2x32)(k1, k2, counters, x2)]
    want = jax_hash(k1, k2, counters, x2)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_straight_line_hash_at_the_extremes_of_uint32():
    top = np.uint32(2**32 - 1)
    counters = np.array([0, 1, 2**31, 2**32 - 1], np.uint32)
    for k1, k2 in [(0, 0), (top, top), (0, top), (12345, 67890)]:
        k1, k2 = np.uint32(k1), np.uint32(k2)
        got = jax.jit(_threefry.threefry2x32)(k1, k2, counters, counters[::-1].copy())
        want = jax_hash(k1, k2, counters, counters[::-1].copy())
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), w)


init = jax.nn.initializers
USES = {
    "normal": lambda k: jax.random.normal(k, (64, 48)),
    "uniform": lambda k: jax.random.uniform(k, (64, 48), minval=-2.0, maxval=3.0),
    "lecun_normal": lambda k: init.lecun_normal()(k, (64, 48)),
    "orthogonal": lambda k: init.orthogonal()(k, (48, 48)),
    "bernoulli": lambda k: jax.random.bernoulli(k, 0.3, (64, 48)),
    "bits8": lambda k: jax.random.bits(k, (64, 48), jnp.uint8),
    "bits16": lambda k: jax.random.bits(k, (64, 48), jnp.uint16),
    "permutation": lambda k: jax.random.permutation(k, 100),
    "split": lambda k: jax.random.key_data(jax.random.split(k, (3, 5))),
    "fold_in": lambda k: jax.random.key_data(jax.random.fold_in(k, 2**31 + 7)),
    "split_then_normal": lambda k: jax.random.normal(jax.random.split(k)[1], (8, 16)),
}


UNSHARDED = ("permutation", "split", "fold_in")  # sharded=True leaves these whole too
FAST_SHARDED = set(USES) - set(UNSHARDED) - {"bits8"}  # bits16's lowering stands for it


@pytest.mark.parametrize(
    "sharded, use",  # MESHINIT_TESTS=all: every use both ways
    [(False, use) for use in sorted(USES)]
    + [
        (True, use) if use in FAST_SHARDED else pytest.param(True, use, marks=pytest.mark.slow)
        for use in sorted(USES)
    ],
)
def test_straight_line_keys_give_jax_threefry_values(use, sharded):
    fn = USES[use]
    data = np.array([2024, 11], np.uint32)
    out = None
    if sharded and use not in UNSHARDED:
        mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        out = NamedSharding(mesh, P("a", "b"))

    def value(impl):
        f = jax.jit(lambda d: fn(jax.random.wrap_key_data(d, impl=impl)), out_shardings=out)
        return np.asarray(f(data))

    # PROGRAM_KEY_IMPL, what meshinit's CPU programs use: the straight-line hash with its
    # words apart from the float math, as jax's rolled hash leaves them (STRAIGHT_LINE
    # alone, fused, rounds a sharded uniform 1 ulp off in 265 of 3072 elements on
    # jaxlib 0.12.1; its bits are checked above and by the integer uses here)
    np.testing.assert_array_equal(value(_threefry.PROGRAM_KEY_IMPL), value("threefry2x32"))


def test_meshinit_cpu_programs_hash_without_a_loop_and_jax_would_loop():
    # jax's CPU lowering of threefry is a while loop; meshinit's programs have none.
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    plan = meshinit.plan(
        {"w": meshinit.param((64, 128), init.lecun_normal(), axes=("a", "b"), mesh=mesh)}
    )
    group = plan.groups[0]
    strategy = _strategies.Rounds()

    def lowered_text(impl):
        ((_, build),) = strategy.builds(group, impl)
        return _compile.lower(group.mesh, *build()).as_text()

    ours = _strategies.program_key_impl(group, "threefry2x32")
    assert ours is _threefry.PROGRAM_KEY_IMPL
    assert "while" not in lowered_text(ours)
    assert "while" in lowered_text("threefry2x32")


@pytest.mark.parametrize("strategy", sorted(_strategies.STRATEGIES))
def test_every_strategy_makes_the_values_of_jaxs_own_threefry(strategy):
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    inits = [
        init.lecun_normal(),
        init.truncated_normal(0.02),
        init.uniform(),
        init.normal(1.0),
        init.variance_scaling(2.0, "fan_avg", "uniform"),
        init.orthogonal(),
    ]
    tree = {
        f"p{i}": [meshinit.param((64, 128), f, axes=("a", "b"), mesh=mesh) for _ in range(3)]
        for i, f in enumerate(inits)
    }
    plan = meshinit.plan(tree)
    key_data, name = meshinit._paths.host_key(5)
    assert _strategies.program_key_impl(plan.groups[0], name) is _threefry.PROGRAM_KEY_IMPL
    s = _strategies.STRATEGIES[strategy]

    class JaxsOwnImpl(_strategies.Specs):
        def key_impl(self, group):
            return self.impl  # jax's threefry, not meshinit's straight-line twin

    def values(maker):
        made = run_plan(plan, maker(s, key_data, name))
        flat, _ = jax.tree_util.tree_flatten_with_path(made)
        return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}

    ours = values(_strategies.Specs)
    jaxs = values(JaxsOwnImpl)
    assert ours.keys() == jaxs.keys() and len(ours) == 3 * len(inits)
    for path, value in jaxs.items():
        np.testing.assert_array_equal(ours[path], value, err_msg=path)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=4))
def test_the_host_hash_on_ints_is_the_numpy_hash(words):
    k1, k2, x1, x2 = words
    with np.errstate(over="ignore"):  # uint32 wrap-around is the hash
        want = _threefry.threefry_rounds(*(np.uint32(w) for w in words))
    assert _threefry.threefry_ints(k1, k2, x1, x2) == tuple(int(w) for w in want)
