"""The constructor traced once (meshinit._engine.trace): its flat program, the small
part the host evaluates (keys, counters, exact moves of small values), and the cut of
one variable's slice with its fingerprint; the cycle collector paused meanwhile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import mesh8

import meshinit
from meshinit._engine import host_eval as _host
from meshinit._engine import trace as _trace
from meshinit._jax import jaxpr as _jaxpr


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1, -5])
def test_host_part_computes_keys_and_counters_bit_for_bit(seed):
    def fn():
        key = jax.random.key(seed)
        keys = jax.random.split(jax.random.fold_in(key, 7), 3)
        counter = jnp.uint32(5) + jnp.uint32(1)
        bits = jax.random.bits(keys[1], (4,))
        shifted = jnp.right_shift(jnp.int32(-8), jnp.int32(40))  # XLA: out of range
        return [jax.random.key_data(keys), counter, bits, shifted, jnp.int32(-7) // jnp.int32(2)]

    traced = _trace.trace(lambda: fn())
    outs = traced.program.outputs
    traced = _trace.evaluate_host_part(traced, outs)
    assert all(o in traced.host for o in outs)  # all of it on the host
    for o, want in zip(outs, jax.jit(fn)(), strict=True):
        got = traced.host[o]
        np.testing.assert_array_equal(np.asarray(getattr(got, "data", got)), np.asarray(want))


def test_host_part_leaves_float_arithmetic_to_the_program():
    # XLA contracts multiply-adds inside jitted initializers; numpy rounds twice. So
    # float arithmetic runs in the compiled programs, and only exact moves of floats
    # (broadcasts, casts) run on the host.
    def fn():
        scale = jnp.float32(2.0) / 3
        return [jnp.exp(jnp.float32(1.5)), scale, jnp.ones((8,), jnp.bfloat16), scale * 3 + 1]

    traced = _trace.trace(fn)
    traced = _trace.evaluate_host_part(traced, traced.program.outputs)
    exp, div, ones, fma = traced.program.outputs
    assert exp not in traced.host and div not in traced.host and fma not in traced.host
    np.testing.assert_array_equal(traced.host[ones], np.ones(8, jnp.bfloat16))


def test_fingerprints_are_structural_not_by_identity():
    def weight(scale):
        return lambda key: jax.random.normal(key, (64, 64)) * scale

    def digests(fn):
        traced = _trace.trace(lambda d: [fn(jax.random.wrap_key_data(d))], np.zeros(2, np.uint32))
        traced = _trace.evaluate_host_part(traced, traced.program.outputs)
        s = _trace.cut(traced, traced.program.outputs[0], {})
        return s.digest

    a, b, c = digests(weight(2.0)), digests(weight(2.0)), digests(weight(3.0))
    assert a == b  # two closures computing the same thing
    assert a != c  # a different literal
    with pytest.raises(_jaxpr.Unfingerprintable):
        _jaxpr._canon(lambda: 0, {})
    assert isinstance(_host.HostKey(np.zeros(2, np.uint32)), _host.HostKey)


def test_the_cycle_collector_is_paused_during_init_and_restored_after():
    import gc

    seen = []

    def factory():
        seen.append(gc.isenabled())
        return nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    assert gc.isenabled()
    meshinit.nnx.init(factory)
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that disabled it keeps it disabled
    try:
        with _trace.paused_gc(), _trace.paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="must build its own"), _trace.paused_gc():
        raise ValueError("must build its own")
    assert gc.isenabled()  # restored after a failure too


def _host_made(bound):
    """Which of a key (8 bytes), its 256 bytes of random bits and a 4-byte count the
    host part makes under ``bound``."""

    def fn(data):
        key = jax.random.wrap_key_data(data)
        bits = jax.random.bits(key, (8, 8))
        count = jax.lax.slice(data, (0,), (1,)) * jnp.uint32(3)
        return [jax.random.key_data(jax.random.fold_in(key, 3)), bits, count]

    traced = _trace.trace(fn, np.array([0, 7], np.uint32))
    outs = traced.program.outputs
    with meshinit.options(host_eval_bytes=bound):
        traced = _trace.evaluate_host_part(traced, outs)
    return [
        name for name, o in zip(("key", "bits", "count"), outs, strict=True) if o in traced.host
    ]


@pytest.mark.parametrize(
    "bound, made",
    [(None, ["key", "bits", "count"]), (256, ["key", "bits", "count"]), (255, ["key", "count"])]
    + [(8, ["key", "count"]), (4, ["count"]), (0, [])],
)
def test_the_host_bound_decides_what_the_host_part_makes(bound, made):
    assert _host_made(bound) == made


# ------------------------------------------------------------------- the trace


def test_a_constructor_that_asks_for_a_computed_value_is_told_what_to_do_instead():
    def fn(x):
        return [x * 2] if float(x.sum()) > 0 else [x]

    with pytest.raises(_trace.NeedsConcreteValue, match="traces the constructor once") as e:
        _trace.trace(fn, np.ones(2))
    text = str(e.value)
    assert "it asked for one (ConcretizationTypeError: " in text
    assert "compute them from shapes and Python numbers, or with jax operations" in text
    assert isinstance(e.value, TypeError)  # as jax's own ConcretizationTypeError is


def test_the_trace_takes_host_arguments_as_jit_does_and_records_each_output_aval():
    traced = _trace.trace(
        lambda x: [x + 1, jnp.zeros((3, 4), jnp.bfloat16), jnp.float32(1)], np.ones(2)
    )
    assert traced.args[0].dtype == np.float32  # float64 is float32 unless x64 is on
    assert [(a.shape, a.dtype) for a in traced.out_avals] == [
        ((2,), np.float32),
        ((3, 4), jnp.bfloat16),
        ((), np.float32),
    ]
    assert traced.host == {} and traced.dynamic == frozenset()  # nothing evaluated yet
    assert traced.mesh is None  # no context mesh


def test_under_an_explicit_context_mesh_the_trace_runs_under_its_all_auto_twin():
    mesh = mesh8(("a", "b"), explicit=True)
    with jax.set_mesh(mesh):
        traced = _trace.trace(lambda x: [x * 2], np.ones((8, 8), np.float32))
    assert traced.mesh is not None and traced.mesh.axis_names == ("a", "b")
    assert traced.mesh.devices.tolist() == mesh.devices.tolist()
    assert set(traced.mesh.axis_types) == {jax.sharding.AxisType.Auto}


def test_the_host_part_evaluates_only_what_the_outputs_made_read():
    def fn(data):
        first, second = jax.random.split(jax.random.wrap_key_data(data))
        return [jax.random.key_data(first), jax.random.key_data(jax.random.fold_in(second, 3))]

    traced = _trace.trace(fn, np.array([0, 7], np.uint32))
    a, b = traced.program.outputs
    only_a = _trace.evaluate_host_part(traced, [a])
    assert a in only_a.host and b not in only_a.host
    both = _trace.evaluate_host_part(traced, [a, b])
    np.testing.assert_array_equal(only_a.host[a].data, both.host[a].data)  # the same bits
    read = _trace.nodes_read(traced.program, [a])
    assert read == sorted(read) and set(read) < set(_trace.nodes_read(traced.program, [a, b]))
    assert {a, b} <= both.dynamic  # both depend on the argument


# --------------------------------------------------------------------- the cut


def layers(data):
    """Two layers' weights of one signature and a third of another shape, from one key."""
    first, second = jax.random.split(jax.random.wrap_key_data(data))
    return [
        jax.random.normal(first, (8, 8)),
        jax.random.normal(second, (8, 8)),
        jax.random.normal(second, (4, 8)),
    ]


def test_layers_of_one_signature_cut_to_one_fingerprint_with_their_own_inputs():
    traced = _trace.trace(layers, np.zeros(2, np.uint32))
    traced = _trace.evaluate_host_part(traced, traced.program.outputs)
    one, two, other = [_trace.cut(traced, o, {}) for o in traced.program.outputs]
    assert isinstance(one, _trace.Slice) and one.nodes and not one.has_control_flow
    assert one.digest == two.digest  # one program serves both layers
    assert one.inputs != two.inputs  # each reads its own key, made by the host
    assert all(n in traced.host and n in traced.dynamic for n in one.inputs + two.inputs)
    assert other.digest != one.digest  # another shape is another program


def test_random_bits_the_host_made_are_made_again_in_the_program_from_their_key():
    """A small weight's random bits are computed on the host (they fit the host bound),
    yet its slice computes them from its key, as ``jax.jit`` does: fed in as an
    argument, they changed how XLA's CPU code split the float loop, and its rounding."""

    def fn(d):
        key = jax.random.wrap_key_data(d)
        bits = jax.random.bits(key, (64, 4))  # 1 KiB: within the host bound
        return [jax.random.normal(key, (64, 4)), bits]

    traced = _trace.trace(fn, np.zeros(2, np.uint32))
    traced = _trace.evaluate_host_part(traced, traced.program.outputs)
    weight, bits = traced.program.outputs
    assert bits in traced.host  # the host made the bits
    s = _trace.cut(traced, weight, {})
    prog = traced.program
    assert s.inputs and all(_trace.enters(prog, n) for n in s.inputs)
    assert all(prog.avals[n].shape == () for n in s.inputs)  # the key alone, no array
    assert not _trace.enters(prog, bits)  # an array the host computed
    assert _trace.enters(prog, prog.inputs[0])  # an argument of the constructor


def test_an_argument_returned_as_is_is_a_slice_of_no_equations():
    traced = _trace.trace(lambda d: [d], np.zeros(2, np.uint32))
    traced = _trace.evaluate_host_part(traced, traced.program.outputs)
    (out,) = traced.program.outputs
    cut = _trace.cut(traced, out, {})
    assert isinstance(cut, _trace.Slice)
    assert (cut.nodes, cut.inputs, cut.out) == ((), (out,), out)


def test_literals_and_captured_constants_have_no_slice():
    constant = np.arange(100, dtype=np.float32)
    for fn in (lambda: [jnp.float32(1)], lambda: [jnp.asarray(constant)]):
        traced = _trace.trace(fn)
        traced = _trace.evaluate_host_part(traced, traced.program.outputs)
        assert _trace.cut(traced, traced.program.outputs[0], {}) is None


def test_a_key_made_outside_the_factory_and_left_off_the_host_falls_back_saying_why():
    key = jax.random.key(0)
    traced = _trace.trace(lambda: [jax.random.normal(key, (4,))])
    with meshinit.options(host_eval_bytes=0):  # the key's data stays off the host
        traced = _trace.evaluate_host_part(traced, traced.program.outputs)
    cut = _trace.cut(traced, traced.program.outputs[0], {})
    assert isinstance(cut, _trace.Fallback)
    assert "key made outside the factory" in cut.reason
    assert "make the key inside the factory" in cut.fix


def test_a_scalar_from_a_literal_seed_holds_its_key_as_a_constant_as_jit_does():
    """Issue 67: a float32 ``normal(0.02)`` scalar was 8 ulp off ``nnx.jit`` on a TPU v5e
    (exact on CPU). Not the host: its float math ran in its program on the TPU, from
    its key passed in as an argument. ``nnx.jit``'s key comes from the literal seed, so
    every value of its computation is a constant, and XLA folds it at compile time on
    the compiling host (libtpu 0.0.42.1: ``constant(0.0200802851)`` is its whole
    optimized program). So the slice of such a scalar holds its key as a constant, as
    jit does; a parameter with elements, or a key the constructor is passed, stays an
    argument (jit leaves those to run time too)."""
    normal = nnx.initializers.normal(0.02)

    def literal():
        one, two = jax.random.split(jax.random.key(3))
        bits = jax.random.bits(two, (), jnp.uint32) + 1  # an integer: exact anywhere
        vector = normal(jax.random.fold_in(two, 1), (1,), jnp.float32)  # folded by jit too
        return [normal(one, (), jnp.float32), normal(two, (8, 4), jnp.float32), bits, vector]

    def passed(d):
        key = jax.random.wrap_key_data(d)
        return [normal(key, (), jnp.float32)]

    traced = _trace.trace(literal)
    traced = _trace.evaluate_host_part(traced, traced.program.outputs)
    scalar, matrix, bits, vector = (_trace.cut(traced, o, {}) for o in traced.program.outputs)
    assert bits is None or not bits.folded  # made by the host, or one program for all
    assert vector.folded and not vector.inputs  # one element: jit folds a (1,) too
    assert scalar.inputs == (), "the scalar's key is an argument of its program"
    assert scalar.folded and all(n in traced.host for n in scalar.folded)
    assert matrix.inputs and not matrix.folded  # elements: jit computes them at run time
    traced = _trace.trace(passed, np.zeros(2, np.uint32))
    traced = _trace.evaluate_host_part(traced, traced.program.outputs)
    (given,) = (_trace.cut(traced, o, {}) for o in traced.program.outputs)
    assert given.inputs and not given.folded  # the constructor's argument: run time
    # two scalars of other keys are two programs: each holds its own key
    other = _trace.trace(lambda: [normal(jax.random.key(4), (), jnp.float32)])
    other = _trace.evaluate_host_part(other, other.program.outputs)
    assert _trace.cut(other, other.program.outputs[0], {}).digest != scalar.digest
