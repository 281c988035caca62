"""The host rules of :mod:`meshinit._engine.host_eval` against jax's own evaluation, bit for bit.

Each test traces jax ops with ``jax.make_jaxpr``, evaluates the flat program with
``_host.evaluate`` and compares every output with ``jax.jit`` of the same function:
same dtype, same shape, same bits (compared as unsigned integers, so NaN payloads and
-0.0 count). A rule may refuse (``NotHost``: the value is then computed in the
compiled program); it may never give other bits. Inputs that a rule is there to
evaluate (integers, moves, finite normal floats, threefry keys) must not be refused,
so a rule that refuses everything fails here.

Where jax itself has no one answer, the rule must refuse, and the test says so:
subnormal floats (XLA's compiled CPU code treats them as zero; its constant folder
and numpy do not), conversions of NaN (XLA quiets signalling NaNs and gives float8
types their one NaN; numpy and ml_dtypes keep sign and payload), and what jax leaves
undefined (integer division by zero, ``select_n`` out of range).

Compiles cost about 80 ms each on two shared cores, so a test traces one program of
many ops, and hypothesis draws values for a fixed shape (one compile per dtype).
Eager jax dispatches the same primitive to XLA on its own; one test checks that it
gives the bits of ``jit`` for the cases the rules were fixed for.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.extend.random import threefry2x32_p, threefry_prng_impl
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshinit._engine import host_eval as _host
from meshinit._jax import jaxpr as _jaxpr

# ------------------------------------------------------------ the coverage table

COVERED: dict[str, frozenset[str]] = {}  # test name -> the host rules it compares


def covers(*rules: str):
    """Records in COVERED which host rules (primitive names) a test compares with jax."""

    def record(test):
        COVERED[test.__name__] = frozenset(rules)
        return test

    return record


# ------------------------------------------------------------------ the harness


class Refused(str):
    """An output the host did not evaluate: the NotHost reason."""


def _host_input(x, aval):
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return _host.HostKey(np.asarray(jax.random.key_data(x)))
    # jax canonicalizes an argument to its aval's dtype; the host gets the same values
    return np.asarray(x, dtype=aval.dtype)


def on_host(fn, args):
    """The primitives of ``fn``'s flat program, and each of its outputs on the host
    (a numpy array, a HostKey, or Refused). Nodes are evaluated one at a time, so that
    one refusal leaves the other outputs to compare."""
    prog = _jaxpr.flatten(jax.make_jaxpr(fn)(*args))
    env = {}
    for n, c in prog.consts.items():
        try:
            env[n] = _host.as_host(c, prog.avals[n])
        except _host.NotHost:
            pass
    for n, a in zip(prog.inputs, args, strict=True):
        env[n] = _host_input(a, prog.avals[n])
    refused: dict[int, Refused] = {}
    for i, node in enumerate(prog.nodes):
        if all(isinstance(x, _jaxpr.Lit) or x in env for x in node.ins):
            try:
                _host.run_on_host(prog, [i], env)
                continue
            except _host.NotHost as e:
                reason = Refused(f"{node.primitive.name}: {e}")
        else:
            reason = Refused(f"{node.primitive.name} reads a refused value")
        refused.update((n, reason) for n in node.outs)
    outs = []
    for o in prog.outputs:
        if isinstance(o, _jaxpr.Lit):
            outs.append(_host.as_host(o.value, o.aval))
        else:
            outs.append(env[o] if o in env else refused[o])
    return {node.primitive.name for node in prog.nodes}, outs


@functools.cache
def jitted(fn):
    return jax.jit(fn)


def _tagged(x):
    if isinstance(x, _host.HostKey):
        return "key", np.asarray(x.data)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return "key", np.asarray(jax.random.key_data(x))
    return "array", np.asarray(x)


def raw(x: np.ndarray) -> np.ndarray:
    """The bits of ``x``, flat, as unsigned integers of its width (bool and int4 too)."""
    x = np.ascontiguousarray(x)
    return x.reshape(-1).view(f"u{x.dtype.itemsize}")


def assert_bits(what, got, want, args=()):
    gkind, g = _tagged(got)
    wkind, w = _tagged(want)
    assert gkind == wkind, f"{what}: the host gives a {gkind}, jax a {wkind}"
    assert (g.dtype, g.shape) == (w.dtype, w.shape), (
        f"{what}: the host gives {g.dtype}{list(g.shape)}, jax {w.dtype}{list(w.shape)}"
    )
    gb, wb = raw(g), raw(w)
    bad = np.flatnonzero(gb != wb)
    if bad.size:
        i = bad[0]
        ins = [repr(np.asarray(a).reshape(-1)[i]) for a in args if np.shape(a) == g.shape]
        pytest.fail(
            f"{what}: {bad.size} of {gb.size} elements differ from jax; the first, at {i}"
            f" (inputs {', '.join(ins) or 'n/a'}): host {g.reshape(-1)[i]!r} ({gb[i]:#x}),"
            f" jax {w.reshape(-1)[i]!r} ({wb[i]:#x})"
        )


def check(fn, args, names, must=True, expect=None):
    """``fn(*args)`` returns one output per entry of ``names`` (the rule that makes it).

    Every output the host evaluates has jax's bits; an output with ``must`` (a bool,
    or one per output) is evaluated. The program must hold every primitive of
    ``expect`` (default: ``names``), or the test would not exercise them. Returns the
    names of the refused outputs.
    """
    prims, got = on_host(fn, args)
    absent = set(names if expect is None else expect) - prims
    assert not absent, f"the traced program has no {sorted(absent)}; it has {sorted(prims)}"
    want = jitted(fn)(*args)
    musts = list(must) if isinstance(must, list | tuple) else [must] * len(names)
    assert len(got) == len(want) == len(names) == len(musts)
    refused = []
    for name, g, w, m in zip(names, got, want, musts, strict=True):
        if isinstance(g, Refused):
            assert not m, f"{name} refused inputs it is there to evaluate: {g}"
            refused.append(name)
        else:
            assert_bits(name, g, w, args)
    return refused


def quiet_cast(values, dtype):
    with np.errstate(all="ignore"):
        return np.asarray(values).astype(dtype)


def floats_from_bits(words, dtype):
    dtype = np.dtype(dtype)
    return np.asarray(words, np.uint64).astype(f"u{dtype.itemsize}").view(dtype)


# ------------------------------------------------------------------- integers

INT32_TYPES = [np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32]
INT64_TYPES = [np.int64, np.uint64]  # only under jax.enable_x64(True)
BINARY = {
    "add": lax.add,
    "sub": lax.sub,
    "mul": lax.mul,
    "div": lax.div,
    "rem": lax.rem,
    "max": lax.max,
    "min": lax.min,
    "and": lax.bitwise_and,
    "or": lax.bitwise_or,
    "xor": lax.bitwise_xor,
    "shift_left": lax.shift_left,
    "shift_right_arithmetic": lax.shift_right_arithmetic,
    "shift_right_logical": lax.shift_right_logical,
    "eq": lax.eq,
    "ne": lax.ne,
    "lt": lax.lt,
    "le": lax.le,
    "gt": lax.gt,
    "ge": lax.ge,
}
UNARY = {"neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "not": lax.bitwise_not}
INT_LENGTH = 640  # every integer test of one dtype shares one compile


def int_op_names(dtype) -> tuple[str, ...]:
    signed = np.issubdtype(dtype, np.signedinteger)
    return (*BINARY, *(u for u in UNARY if signed or u != "abs"))  # lax: no abs of uint


@functools.cache
def int_program(names: tuple[str, ...]):
    def ops(a, b):
        return [BINARY[n](a, b) if n in BINARY else UNARY[n](a) for n in names]

    return ops


def int_edges(dtype) -> np.ndarray:
    """Values where integer rules go wrong: 0, +-1, the extremes, and shift amounts
    around the width (negative ones included)."""
    info = np.iinfo(dtype)
    b = info.bits
    values = {0, 1, 2, 3, 7, b - 1, b, b + 1, 2 * b, 255, 256, info.max, info.max - 1}
    values |= {info.max // 2 + 1, info.min, info.min + 1, info.min // 2}
    values |= {-1, -2, -3, -7, -b, -b - 1, -2 * b}
    return np.array(sorted(v for v in values if info.min <= v <= info.max), dtype)


def check_integers(dtype, a, b):
    """All integer rules on ``a`` and ``b``: division by zero may be refused (jax gives
    -1 and the dividend there); everything else must be evaluated."""
    names = int_op_names(dtype)
    a, b = np.resize(a, INT_LENGTH).astype(dtype), np.resize(b, INT_LENGTH).astype(dtype)
    zero = b == 0
    by_zero = [n in ("div", "rem") and bool(zero.any()) for n in names]
    check(int_program(names), (a, b), names, must=[not z for z in by_zero])
    if zero.any():
        check(int_program(names), (a, np.where(zero, np.ones_like(b), b)), names)


INT_RULES = (*BINARY, *UNARY)


@covers(*INT_RULES)
@pytest.mark.parametrize("dtype", INT32_TYPES, ids=lambda d: np.dtype(d).name)
def test_integer_rules_on_every_pair_of_edge_values_are_jaxs_bits(dtype):
    # INT_MIN / -1, INT_MIN % -1, abs(INT_MIN), overflowing add/sub/mul, shifts by
    # amounts past the width and negative amounts, arithmetic shifts of unsigned words
    edges = int_edges(dtype)
    a, b = (np.array(v, dtype) for v in zip(*itertools.product(edges, edges), strict=True))
    check_integers(dtype, a, b)


@covers(*INT_RULES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_integer_rules_on_random_values_are_jaxs_bits(data):
    dtype = data.draw(st.sampled_from(INT32_TYPES), label="dtype")
    info = np.iinfo(dtype)
    near = st.sampled_from(list(int_edges(dtype)))
    value = st.one_of(st.integers(int(info.min), int(info.max)), near)
    a = data.draw(st.lists(value, min_size=32, max_size=32), label="a")
    b = data.draw(st.lists(value, min_size=32, max_size=32), label="b")
    check_integers(dtype, np.array(a, dtype), np.array(b, dtype))


@covers(*INT_RULES)
@pytest.mark.parametrize("dtype", INT64_TYPES, ids=lambda d: np.dtype(d).name)
def test_64_bit_integer_rules_under_enable_x64_are_jaxs_bits(dtype):
    # jax.experimental.enable_x64 is gone from both supported jax versions; the
    # configuration option itself is the context manager
    with jax.enable_x64(True):
        edges = int_edges(dtype)
        a, b = (np.array(v, dtype) for v in zip(*itertools.product(edges, edges), strict=True))
        check_integers(dtype, a, b)


def test_without_x64_64_bit_inputs_are_computed_as_jax_does_in_32_bits():
    # jax_enable_x64 is off by default: an int64 argument is traced as int32, and the
    # host computes on the traced dtype, not the argument's
    with jax.enable_x64(False):
        x = np.array([2**32 + 5, -(2**40) - 3, 7], np.int64)
        names = ("shift_right_logical", "mul")
        fn = int_program(names)
        assert check(fn, (x, np.full(3, 1, np.int64)), names) == []


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4], ids=lambda d: np.dtype(d).name)
@covers("add", "sub", "mul", "max", "min", "and", "or", "xor", "not", "eq", "lt")
def test_four_bit_integers_are_jaxs_bits_or_refused(dtype):
    # int4 lives in a byte (ml_dtypes, numpy kind "V"): shifts and division refuse
    info = jnp.iinfo(dtype)
    edges = np.arange(int(info.min), int(info.max) + 1)
    a, b = (np.array(v).astype(dtype) for v in zip(*itertools.product(edges, edges), strict=True))
    names = int_op_names(np.int8 if info.min < 0 else np.uint8)
    names = tuple(n for n in names if n != "abs")  # lax has no abs of int4
    sure = {"add", "sub", "mul", "max", "min", "and", "or", "xor", "not", "eq", "lt"}
    check(int_program(names), (a, b), names, must=[n in sure for n in names])


ARITHMETIC = ("add", "sub", "mul", "div", "rem", "max", "min")
SIGNS = ("neg", "abs", "sign")


def logic_and_arithmetic(p, q, *floats):
    """bool logic (evaluated), then float and complex arithmetic on pairs of inputs."""
    out = [lax.bitwise_and(p, q), lax.bitwise_or(p, q), lax.bitwise_xor(p, q)]
    out += [lax.bitwise_not(p), lax.max(p, q), lax.min(p, q), lax.eq(p, q), lax.lt(p, q)]
    for a, b in zip(floats[::2], floats[1::2], strict=True):
        complex_ = jnp.issubdtype(a.dtype, jnp.complexfloating)
        out += [
            BINARY[n](a, b) for n in ARITHMETIC if not (complex_ and n in ("rem", "max", "min"))
        ]
        out += [UNARY[n](a) for n in SIGNS]
    return out


@covers("and", "or", "xor", "not", "max", "min", "eq", "lt", *ARITHMETIC, *SIGNS)
def test_bool_logic_is_jaxs_and_float_arithmetic_is_left_to_the_program():
    # XLA contracts a multiply and an add into one fused multiply-add and rounds bf16
    # and float8 ops its own way: float arithmetic may be refused (it is), but never
    # computed another way (bf16 and float8 are numpy kind "V", complex "c", not "f")
    p, q = (np.array(v) for v in zip(*itertools.product([False, True], repeat=2), strict=True))
    floats = []
    for dtype in (np.float32, jnp.bfloat16, np.float16, jnp.float8_e4m3fn, np.complex64):
        a = quiet_cast(np.array([1.5, -2.25, 0.1, 3.0]), dtype)
        b = quiet_cast(np.array([0.3, 7.0, -0.7, 1e-3]), dtype)
        if dtype == np.complex64:
            a, b = a + 1j * b, b - 2j * a
        floats += [a, b]
    names = ["and", "or", "xor", "not", "max", "min", "eq", "lt"]
    for a in floats[::2]:
        complex_ = jnp.issubdtype(a.dtype, jnp.complexfloating)
        names += [n for n in ARITHMETIC if not (complex_ and n in ("rem", "max", "min"))]
        names += list(SIGNS)
    must = [i < 8 for i in range(len(names))]
    check(logic_and_arithmetic, (p, q, *floats), names, must=must)


# ------------------------------------------------------------- floats: compares


def _optional(*names):
    return [getattr(jnp, n) for n in names if hasattr(jnp, n)]


# the float8 types with different NaN, infinity and zero conventions (float8_e4m3,
# e3m4 and e4m3b11fnuz repeat them; each type costs compiles)
FLOAT8 = _optional(
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"
)
FLOAT8 += _optional("float4_e2m1fn")
FLOAT_TYPES = [np.float32, jnp.bfloat16, np.float16, *FLOAT8]
NAN_WORDS = {  # quiet and signalling NaNs with payloads, both signs
    4: [0x7FC00001, 0xFFC12345, 0x7F800001, 0xFF800001, 0x7FFFFFFF],
    2: [0x7E01, 0xFE01, 0x7C01, 0x7F81, 0xFFC1],
}


def float_edges(dtype, subnormals=False) -> np.ndarray:
    """Signed zeros, infinities, NaNs with payloads, the extremes, the smallest normal
    number and, with ``subnormals``, the largest and smallest subnormal."""
    info = jnp.finfo(dtype)
    big, tiny = float(info.max), float(info.smallest_normal)
    values = [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, -2.5, 3.0, big, -big, tiny, -tiny, 2 * tiny]
    values += [np.inf, -np.inf, np.nan, -np.nan]
    if subnormals:
        sub = float(info.smallest_subnormal)
        values += [sub, -sub, tiny - sub, -(tiny - sub)]
    x = quiet_cast(np.array(values, np.float64), dtype)
    if not subnormals:
        x = x[~_subnormal(x)]  # float4_e2m1fn's 0.5
    words = NAN_WORDS.get(np.dtype(dtype).itemsize, [])
    if words and np.dtype(dtype) != np.float64:
        x = np.concatenate([x, floats_from_bits(words, dtype)])
    return x


def _subnormal(x: np.ndarray) -> np.ndarray:
    m = np.abs(quiet_cast(x, np.float64))
    return (m != 0) & (m < float(jnp.finfo(x.dtype).smallest_normal))


COMPARES = ("eq", "ne", "lt", "le", "gt", "ge")
COMPARE_TYPES = [
    t for t in FLOAT_TYPES if np.dtype(t).name not in ("float8_e5m2fnuz", "float8_e8m0fnu")
]


@covers(*COMPARES)
@pytest.mark.parametrize("dtype", COMPARE_TYPES, ids=lambda d: np.dtype(d).name)
def test_float_comparisons_with_nan_inf_and_signed_zeros_are_jaxs(dtype):
    edges = float_edges(dtype)
    a, b = (np.array(v, dtype) for v in zip(*itertools.product(edges, edges), strict=True))
    check(int_program(COMPARES), (a, b), COMPARES)
    # With a subnormal operand jax itself has two answers (1e-45 > 0 is false in the
    # compiled CPU code, true when XLA folds constants): the rules refuse them, and
    # whatever they do evaluate must agree with jit
    edges = float_edges(dtype, subnormals=True)
    a, b = (np.array(v, dtype) for v in zip(*itertools.product(edges, edges), strict=True))
    check(int_program(COMPARES), (a, b), COMPARES, must=False)


# ----------------------------------------------------------- floats: conversions

INT_TARGETS = [np.int8, np.int32, np.uint8, np.uint32, jnp.int4, np.bool_]
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


@functools.cache
def converter(targets: tuple):
    def convert(x):
        return [lax.convert_element_type(x, t) for t in targets]

    return convert


def _names(targets):
    return ["convert_element_type"] * len(targets)


def float_conversion_inputs(src) -> np.ndarray:
    """Edge values of ``src`` and, from f32, values at and next to the rounding ties
    of the narrower types (1 + 2**-8 is a bf16 tie), and values past their ranges."""
    x = float_edges(src, subnormals=True)
    if np.dtype(src) == _F32:
        ties = [1 + 2.0**-8, 1 + 2.0**-8 + 2.0**-20, 1 + 3 * 2.0**-8, 1 + 2.0**-11]
        ties += [1 + 2.0**-11 + 2.0**-20, 1 + 2.0**-4, 1 + 2.0**-3 + 2.0**-10, 1 + 2.0**-2]
        ranges = [65504.0, 65520.0, 65519.99, 448.0, 464.0, 480.0, 57344.0, 61440.0, 1e10]
        ranges += [2.0**-14, 2.0**-24, 2.0**-25, 2.0**-6, 2.0**-9, 2.0**-126, 1e-30, 0.3]
        more = np.array(ties + ranges, np.float32)
        x = np.concatenate([x, more, -more])
    return x


FLOAT_LENGTH = 96


def _clean(x, targets):
    """``x`` with what the rules may refuse replaced by 1: NaN, subnormal values and
    values whose conversion to a float target is subnormal."""
    bad = np.isnan(quiet_cast(x, np.float64)) | _subnormal(x)
    for t in targets:
        if jax.dtypes.issubdtype(t, np.floating):
            bad |= _subnormal(quiet_cast(x, t))
    return np.where(bad, np.ones_like(x), x)


def check_float_conversions(src, x):
    targets = tuple(t for t in FLOAT_TYPES + INT_TARGETS if np.dtype(t) != np.dtype(src))
    x = np.resize(x, FLOAT_LENGTH).astype(src)
    # float to integer or bool: numpy and XLA saturate differently, so it may refuse
    # (it does); float to float of finite normal numbers and infinities must be exact
    must = [jax.dtypes.issubdtype(t, np.floating) for t in targets]
    check(converter(targets), (x,), _names(targets), must=False)
    check(converter(targets), (_clean(x, targets),), _names(targets), must=must)


@covers("convert_element_type")
@pytest.mark.parametrize("src", FLOAT_TYPES, ids=lambda d: np.dtype(d).name)
def test_float_conversions_of_nan_inf_zeros_ties_and_extremes_are_jaxs(src):
    check_float_conversions(src, float_conversion_inputs(src))


@covers("convert_element_type")
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_float_conversions_of_random_bit_patterns_are_jaxs(data):
    src = np.dtype(data.draw(st.sampled_from(FLOAT_TYPES), label="src"))
    top = 2 ** (8 * src.itemsize) - 1
    if src.name == "float4_e2m1fn":
        top = 15
    words = data.draw(st.lists(st.integers(0, top), min_size=24, max_size=24), label="bits")
    check_float_conversions(src, floats_from_bits(words, src))


INT_SOURCES = [np.int32, np.uint8, np.uint32, jnp.int4, jnp.uint4, np.bool_]


def integer_conversion_inputs(src) -> np.ndarray:
    if np.dtype(src) == np.bool_:
        return np.array([True, False])
    info = jnp.iinfo(src)
    values = [0, 1, -1, 2, 3, 7, 8, 15, 16, 127, 128, 255, 256, 257, 263, 300, 449, 460]
    values += [2049, 65519, 65520, 65535, 2**24 - 1, 2**24, 2**24 + 1, 2**24 + 2**16 + 1]
    values += [2**25 + 2**17 + 1, 2**30 + 2**22 + 1, 2**31 - 1, -(2**31), 2**32 - 1]
    return np.array([v for v in values if int(info.min) <= v <= int(info.max)]).astype(src)


@covers("convert_element_type")
@pytest.mark.parametrize("src", INT_SOURCES, ids=lambda d: np.dtype(d).name)
def test_integer_and_bool_conversions_wrap_and_round_as_jax_does(src):
    targets = tuple(t for t in FLOAT_TYPES + INT_TARGETS if np.dtype(t) != np.dtype(src))
    x = np.resize(integer_conversion_inputs(src), 64).astype(src)
    # XLA converts an integer to bf16 through f32, rounding twice (int32 2**24 + 2**16
    # + 1 is bf16 16777216 in XLA, 16908288 in ml_dtypes): past 2**24 a narrow float
    # target may be refused; integer, bool and f32 targets may not
    exact = [not jax.dtypes.issubdtype(t, np.floating) or np.dtype(t) == _F32 for t in targets]
    check(converter(targets), (x,), _names(targets), must=exact)
    small = np.where(np.abs(x.astype(np.float64)) > 2**24, np.ones_like(x), x)
    check(converter(targets), (small,), _names(targets))


@covers("convert_element_type")
def test_64_bit_conversions_under_enable_x64_are_jaxs():
    with jax.enable_x64(True):
        # f64 to bf16/f16 rounds through f32 in XLA (1 + 2**-8 + 2**-30 becomes bf16 1,
        # not 1.0078125), so it may be refused; f64 <-> f32 must be exact
        wide = float_edges(np.float64, subnormals=True)
        ties = np.array([1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-40, 1 + 2**-24 + 2**-50, 1e300])
        x = np.resize(np.concatenate([wide, ties, -ties, [1e-300, 1e-40, 1e-45]]), 64)
        targets = (np.float32, jnp.bfloat16, np.float16, jnp.float8_e4m3fn, np.int64, np.bool_)
        clean = _clean(x, targets[:1])
        check(converter(targets), (x,), _names(targets), must=False)
        check(converter(targets), (clean,), _names(targets), must=[True] + [False] * 5)
        # to f64: from f32 (subnormals may refuse: XLA's CPU code flushes f32 1e-45 to
        # 0), from 64-bit integers (2**53 + 1 rounds), from bf16
        f32 = np.resize(float_conversion_inputs(np.float32), 64)
        check(converter((np.float64,)), (f32,), _names((np.float64,)), must=False)
        check(converter((np.float64,)), (_clean(f32, [np.float64]),), _names((np.float64,)))
        bf16 = np.resize(float_edges(jnp.bfloat16), 64)
        check(converter((np.float64,)), (_clean(bf16, [np.float64]),), _names((np.float64,)))
        big = [0, 1, -1, 2**53 + 1, 2**63 - 1, -(2**63), 2**62 + 2**38 + 1, 2**24 + 1]
        ints = (np.float64, np.float32, jnp.bfloat16, np.int32, np.uint64, np.bool_)
        i64 = np.resize(np.array(big, np.int64), 64)
        check(converter(ints), (i64,), _names(ints), must=[True, True, False, True, True, True])
        u64 = np.resize(np.array([0, 1, 2**64 - 1, 2**63 + 2**39 + 1], np.uint64), 64)
        ints = (np.float64, np.float32, np.int64, np.bool_)
        check(converter(ints), (u64,), _names(ints))


@covers("bitcast_convert_type")
def test_bitcasts_keep_every_bit_and_other_widths_may_refuse():
    f32 = np.resize(float_edges(np.float32, subnormals=True), 32)
    bf16 = np.resize(float_edges(jnp.bfloat16, subnormals=True), 32)
    e4 = np.resize(float_edges(jnp.float8_e4m3fn, subnormals=True), 32)
    i4 = np.resize(np.arange(-8, 8), 32).astype(jnp.int4)

    def casts(f32, bf16, e4, i4):
        same = [
            lax.bitcast_convert_type(f32, np.int32),
            lax.bitcast_convert_type(f32, np.uint32),
            lax.bitcast_convert_type(lax.bitcast_convert_type(f32, np.int32), np.float32),
            lax.bitcast_convert_type(bf16, np.float16),
            lax.bitcast_convert_type(bf16, np.uint16),
            lax.bitcast_convert_type(lax.bitcast_convert_type(bf16, np.int16), jnp.bfloat16),
            lax.bitcast_convert_type(e4, np.uint8),
            lax.bitcast_convert_type(e4, jnp.float8_e5m2),
            lax.bitcast_convert_type(i4, jnp.uint4),
        ]
        other = [lax.bitcast_convert_type(f32, np.uint8), lax.bitcast_convert_type(bf16, np.uint8)]
        return same + other

    names = ["bitcast_convert_type"] * 11
    check(casts, (f32, bf16, e4, i4), names, must=[True] * 9 + [False] * 2)


# -------------------------------------------------------------------- moves


def payload_floats(n: int) -> np.ndarray:
    """f32 values whose moves must keep every bit: NaN payloads, -0.0, subnormals."""
    return np.resize(float_edges(np.float32, subnormals=True), n)


@covers("select_n")
def test_select_n_picks_bits_of_any_dtype_and_refuses_cases_out_of_range():
    x = payload_floats(12)
    y = -payload_floats(12)[::-1].copy()
    z = np.arange(12, dtype=np.float32)
    pick = np.array([True, False] * 6)
    index = np.resize(np.array([0, 2, 1], np.int32), 12)
    ints = np.arange(12, dtype=np.int8)
    halves = np.resize(float_edges(jnp.bfloat16, subnormals=True), 12)
    halves = np.where(np.isnan(halves), np.ones_like(halves), halves)  # see test_moves_...

    def selects(pick, index, x, y, z, ints, halves, reversed_halves):
        return [
            lax.select_n(pick, x, y),
            lax.select_n(index, x, y, z),
            lax.select_n(np.bool_(True), x, y),
            lax.select_n(np.int32(2), x, y, z),
            lax.select_n(pick, ints, -ints),
            lax.select_n(pick, halves, reversed_halves),
        ]

    args = (pick, index, x, y, z, ints, halves, halves[::-1].copy())
    check(selects, args, ["select_n"] * 6)
    # jax leaves an index out of range undefined (XLA clamps today): refused or equal
    wild = np.resize(np.array([-1, 3, 7, 0], np.int32), 12)
    must = [True, False, True, True, True, True]
    check(selects, (pick, wild, *args[2:]), ["select_n"] * 6, must=must)


MOVES = (
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "transpose",
    "slice",
    "concatenate",
    "split",
    "stack",
    "unstack",
    "copy",
)


def moves(x, y):
    return [
        lax.broadcast_in_dim(x, (2, 3, 1, 4), (1, 2, 3)),
        lax.broadcast_in_dim(x[0, 0, 0], (3, 2), ()),
        lax.expand_dims(x, (0, 3)),  # jax has no expand_dims primitive: a broadcast
        lax.reshape(x, (4, 3)),
        lax.reshape(x, (12,)),
        lax.reshape(x, (3, 4), dimensions=(2, 1, 0)),  # a transpose, then a reshape
        lax.squeeze(x, (1,)),
        lax.transpose(x, (2, 0, 1)),
        lax.slice(x, (1, 0, 1), (3, 1, 4), (2, 1, 2)),
        lax.slice(x, (0, 0, 2), (3, 1, 4)),
        lax.concatenate([x, y], 2),
        lax.concatenate([x, y, x], 0),
        *lax.split(x, (1, 3), axis=2),
        lax.stack([x, y], 1),
        *jnp.unstack(x, axis=2),
        jnp.copy(x),
    ]


MOVE_NAMES = (
    ["broadcast_in_dim"] * 3
    + ["reshape"] * 3
    + ["squeeze", "transpose", "slice", "slice", "concatenate", "concatenate"]
    + ["split"] * 2
    + ["stack"]
    + ["unstack"] * 4
    + ["copy"]
)
MOVE_MUST = [True for _ in MOVE_NAMES]  # every move is evaluated, unstack included


@covers(*MOVES)
@pytest.mark.parametrize(
    "dtype",
    [np.float32, jnp.bfloat16, jnp.float8_e5m2, np.int32, np.bool_, jnp.int4],
    ids=lambda d: np.dtype(d).name,
)
def test_moves_keep_every_bit(dtype):
    # f32 NaN payloads, -0.0 and subnormals move bit for bit in jax, so on the host
    words = np.resize(np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 1, 2]), 12)
    x = floats_from_bits(words, np.float32)
    if np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float8_e5m2)):
        x = np.resize(float_edges(dtype, subnormals=True), 12)
    elif np.dtype(dtype) != _F32:
        x = np.resize(np.array([1, 0, 7, 5, 3, 2]), 12).astype(dtype)
    x = x.reshape(3, 1, 4)
    y = x[::-1].copy()
    if np.isnan(x.astype(np.float32)).any() and np.dtype(dtype) != _F32:
        # XLA makes bf16 NaNs canonical in some moves on jax 0.10.2 (concatenate,
        # select_n) and float8_e5m2 NaNs on 0.12 (slice too): they may refuse
        check(moves, (x, y), MOVE_NAMES, must=False, expect=MOVES)
        x = np.where(np.isnan(x), np.ones_like(x), x)
        y = x[::-1].copy()
    check(moves, (x, y), MOVE_NAMES, must=MOVE_MUST, expect=MOVES)


@covers(*MOVES)
@settings(max_examples=25, deadline=None)
@given(words=st.lists(st.integers(0, 2**32 - 1), min_size=12, max_size=12))
def test_moves_of_random_f32_bit_patterns_keep_every_bit(words):
    x = floats_from_bits(words, np.float32).reshape(3, 1, 4)
    check(moves, (x, x[::-1].copy()), MOVE_NAMES, must=MOVE_MUST, expect=MOVES)


IOTA_TYPES = [np.int8, np.uint8, np.int32, np.uint32, np.float32, jnp.bfloat16, np.float16]
IOTA_TYPES += [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int4]


@covers("iota")
def test_iota_counts_as_jax_does_in_every_dtype():
    # past what a type holds (int8 300, bf16 257, f16 4097, float8 17) XLA's iota
    # wraps or rounds, and so must the host
    def iotas():
        out = [lax.iota(t, n) for t in IOTA_TYPES for n in (7, 300)]
        out += [lax.iota(np.float16, 5000), lax.iota(np.int16, 40000)]
        return out + [
            lax.broadcasted_iota(np.int32, (3, 5), 1),
            lax.broadcasted_iota(np.uint8, (4, 2, 3), 0),
        ]

    check(iotas, (), ["iota"] * (2 * len(IOTA_TYPES) + 4))


PLACEMENT = ("sharding_constraint", "device_put", "reshard", "pvary")


@covers(*PLACEMENT)
def test_placement_ops_are_the_identity_on_the_host():
    auto = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    explicit = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    x = payload_floats(8)

    def placed(x):
        return [
            lax.with_sharding_constraint(x, NamedSharding(auto, P("a"))),
            jax.device_put(x, jax.devices()[1]),
            jax.sharding.reshard(x, NamedSharding(explicit, P("a"))),
        ]

    check(placed, (x,), ["sharding_constraint", "device_put", "reshard"])
    # pvary lives inside shard_map, which the host does not enter: its body on its own
    shard = jax.shard_map(
        lambda v: lax.pcast(v, "a", to="varying"), mesh=auto, in_specs=P(), out_specs=P("a")
    )
    (eqn,) = jax.make_jaxpr(shard)(x).eqns
    prog = _jaxpr.flatten(eqn.params["jaxpr"])
    assert [n.primitive.name for n in prog.nodes] == ["pvary"]
    env = _host.run_on_host(prog, range(len(prog.nodes)), {prog.inputs[0]: x})
    assert_bits("pvary", env[prog.outputs[0]], np.asarray(jax.jit(shard)(x))[:8])


# ---------------------------------------------------------------------- keys

u32 = st.integers(0, 2**32 - 1)
RANDOM = ("random_seed", "random_split", "random_fold_in", "random_bits")
RANDOM += ("random_wrap", "random_unwrap")


def draws(seed, msgs, raw):
    key = jax.random.key(seed)
    keys = jax.random.split(key, 4)
    folded = jax.vmap(jax.random.fold_in)(keys, msgs)
    wrapped = jax.random.wrap_key_data(raw)
    return [
        key,
        keys,
        jax.random.split(wrapped, (2, 3)),
        folded,
        jax.random.fold_in(key, msgs[0]),  # one key, a uint32 count: the fast path
        jax.random.fold_in(wrapped, msgs[1].astype(np.int32)),  # an int32 count
        jax.vmap(jax.random.fold_in, (0, None))(keys, msgs[2]),
        jax.random.bits(key, (3, 5), jnp.uint8),
        jax.random.bits(folded[0], (7,), jnp.uint16),
        jax.random.bits(wrapped, (), jnp.uint32),
        jax.vmap(lambda k: jax.random.bits(k, (2, 3), jnp.uint32))(folded),
        wrapped,
        jax.random.key_data(folded),
    ]


DRAW_NAMES = ["random_seed", "random_split", "random_split"] + ["random_fold_in"] * 4
DRAW_NAMES += ["random_bits"] * 4 + ["random_wrap", "random_unwrap"]


@covers(*RANDOM)
@pytest.mark.parametrize("partitionable", [True, False], ids=["partitionable", "classic"])
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(-(2**31), 2**31 - 1),
    msgs=st.lists(u32, min_size=4, max_size=4),
    raw=st.lists(u32, min_size=2, max_size=2),
)
def test_threefry_keys_on_the_host_are_jaxs(partitionable, seed, msgs, raw):
    # jax_threefry_partitionable changes split, fold_in and bits: both settings
    with jax.threefry_partitionable(partitionable):
        args = (np.int32(seed), np.array(msgs, np.uint32), np.array(raw, np.uint32))
        check(draws, args, DRAW_NAMES)


@covers(*RANDOM)
def test_64_bit_seeds_and_bits_under_enable_x64_are_jaxs():
    with jax.enable_x64(True):

        def wide(seeds, key_data):
            key = jax.random.wrap_key_data(key_data)
            return [
                jax.vmap(jax.random.key)(seeds),
                jax.random.bits(key, (3,), jnp.uint64),
                jax.random.fold_in(key, seeds[0]),
                jax.random.key_data(jax.random.split(key, 2)),
            ]

        seeds = np.array([0, -1, 2**40 + 3, -(2**63), 2**63 - 1], np.int64)
        names = ["random_seed", "random_bits", "random_fold_in", "random_unwrap"]
        check(wide, (seeds, np.array([5, 2**32 - 1], np.uint32)), names, expect=RANDOM[:4])


def hashes(k1, k2, x1, x2, key_data):
    bits = threefry_prng_impl.random_bits(key_data, 32, (2, 3))
    return [*threefry2x32_p.bind(k1, k2, x1, x2), bits]


@covers("threefry2x32", "iota_2x32_shape")
@settings(max_examples=20, deadline=None)
@given(
    k=st.lists(u32, min_size=2, max_size=2),
    x=st.lists(u32, min_size=6, max_size=6),
)
def test_threefry2x32_and_its_counters_are_jaxs(k, x):
    # a function of the module, not of the test: one compile for all examples
    k1, k2 = (np.uint32(w) for w in k)
    x1 = np.array(x[:3], np.uint32)
    x2 = np.array(x[3:], np.uint32)
    names = ["threefry2x32", "threefry2x32", "iota_2x32_shape"]
    with jax.threefry_partitionable(True):  # its counters are iota_2x32_shape
        check(hashes, (k1, k2, x1, x2, np.array(k, np.uint32)), names)


KEY_MOVES = ("slice", "squeeze", "reshape", "broadcast_in_dim", "transpose", "select_n")
KEY_MOVES += ("concatenate", "copy", "sharding_constraint")


@covers(*KEY_MOVES)
def test_moves_of_key_arrays_move_their_data():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    const = jax.random.split(jax.random.key(11), 6)  # a captured constant key array

    def on_keys(keys, other, pick):
        return [
            keys[1:5:2],
            keys[2],
            keys.reshape(2, 3),
            jnp.broadcast_to(keys, (4, 6)),
            keys.reshape(2, 3).T,
            lax.select_n(pick, keys, other),
            lax.select_n(np.bool_(True), keys, other),
            jnp.concatenate([keys, other[:2]]),
            lax.squeeze(keys[None], (0,)),
            jnp.expand_dims(keys, -1),
            jnp.copy(keys),
            lax.with_sharding_constraint(keys, NamedSharding(mesh, P())),
            lax.select_n(pick, keys, const),
            jnp.stack([keys, other]),  # may refuse
            *jnp.split(keys, [2]),  # may refuse
        ]

    keys = jax.random.split(jax.random.key(3), 6)
    other = jax.random.split(jax.random.key(4), 6)
    pick = np.array([True, False, False, True, True, False])
    names = ["slice", "slice", "reshape", "broadcast_in_dim", "transpose", "select_n"]
    names += ["select_n", "concatenate", "squeeze", "broadcast_in_dim", "copy"]
    names += ["sharding_constraint", "select_n", "stack", "split", "split"]
    check(on_keys, (keys, other, pick), names, must=[True] * 13 + [False] * 3, expect=KEY_MOVES)


# --------------------------------------------------------------- jax's own bits


def test_eager_jax_gives_the_bits_of_jit_that_the_host_is_compared_with():
    # The reference above is jax.jit; eager jax compiles each primitive on its own.
    # For the cases whose rules were fixed they agree, so either is the reference.
    edges = int_edges(np.int32)
    a, b = (np.array(v, np.int32) for v in zip(*itertools.product(edges, edges), strict=True))
    b = np.where(b == 0, np.int32(1), b)
    u = a.view(np.uint32)
    f = float_conversion_inputs(np.float32)
    f = f[~np.isnan(f) & ~_subnormal(f)]
    pairs = [
        (lax.div, (a, b)),
        (lax.rem, (a, b)),
        (lax.shift_right_arithmetic, (u, b.view(np.uint32))),
        (lambda x: lax.convert_element_type(x, jnp.bfloat16), (f,)),
        (lambda x: lax.convert_element_type(x, jnp.float8_e5m2), (f,)),
        (lax.lt, (f, f[::-1].copy())),
    ]
    for op, args in pairs:
        assert_bits(f"eager {op}", op(*args), jax.jit(op)(*args), args)


@covers("convert_element_type", "gt", "concatenate")
def test_where_jax_has_two_answers_the_host_refuses():
    cases = [
        # int32 2**24 + 2**16 + 1 to bf16: jit rounds through f32 (0x4b80), eager jax
        # 0.12 rounds once (0x4b81), as ml_dtypes does
        (
            lambda x: lax.convert_element_type(x, jnp.bfloat16),
            (np.array([2**24 + 2**16 + 1], np.int32),),
            "large integer to a narrow float",
        ),
        # 1e-45 > 0 is false in XLA's compiled CPU code, true when XLA folds constants
        (lax.gt, (np.array([1e-45], np.float32), np.zeros(1, np.float32)), "subnormal"),
        # a signalling NaN: XLA quiets it in a conversion (f16 0x7e00), numpy does not
        (
            lambda x: lax.convert_element_type(x, np.float16),
            (floats_from_bits([0x7F800001], np.float32),),
            "NaN conversion",
        ),
        # bf16 0x7f81 concatenated: 0x7fc0 on jax 0.10.2, 0x7f81 on jax 0.12
        (
            lambda x: lax.concatenate([x, x], 0),
            (floats_from_bits([0x7F81], jnp.bfloat16),),
            "a move of bfloat16 NaNs",
        ),
    ]
    for fn, args, reason in cases:
        prog = _jaxpr.flatten(jax.make_jaxpr(fn)(*args))
        env = dict(zip(prog.inputs, args, strict=True))
        with pytest.raises(_host.NotHost, match=reason):
            _host.run_on_host(prog, range(len(prog.nodes)), env)


# -------------------------------------------------------------- completeness


def test_every_host_rule_is_compared_with_jax_in_this_file():
    rules = {getattr(k, "name", k) for k in _host._RULES}
    covered = set().union(*COVERED.values())
    missing = sorted(rules - covered)
    assert not missing, (
        f"host rules without a test in tests/_engine/test_host_eval.py: {missing}; compare "
        "each with jax in a test and name it in that test's @covers(...)"
    )
