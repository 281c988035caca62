"""The one module that holds every jax internal the engine uses (meshinit/_jax/compat.py)."""

import pathlib
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry_prng_impl
from jax.sharding import PartitionSpec as P

from meshinit._engine import host_eval as _host
from meshinit._engine import trace as _trace
from meshinit._jax import compat as _compat
from meshinit._jax import jaxpr as _jaxpr

PACKAGE = pathlib.Path(_compat.__file__).parents[1]  # meshinit/


def test_every_primitive_the_engine_knows_exists_in_the_installed_jax():
    # A jax that renamed or dropped one fails here, loudly, instead of the engine
    # silently missing a rule (slower, or keeping a constraint it must drop).
    assert _compat.missing() == []


def _probe(k, x, i, f16):
    """A constructor that binds every primitive the engine knows (one call each)."""
    k2 = jax.random.fold_in(jax.random.split(k, 2)[1], 3)
    w = jax.random.normal(k2, (4, 4))  # random_bits, threefry2x32, iota_2x32_shape
    seed = jax.random.key_data(jax.random.key(7))  # random_seed, random_unwrap
    bits = jax.random.wrap_key_data(seed)  # random_wrap
    raw = threefry_prng_impl.random_bits(seed, 32, (2,))  # threefry2x32, iota_2x32_shape
    i2 = (i + 1) - 2 * i // 3 % 5  # add, sub, mul, div, rem
    i3 = jnp.maximum(jnp.minimum(-i2, i), jnp.abs(i)) * jnp.sign(i)  # neg, min, max, abs, sign
    i4 = (((i3 & 7) | 2) ^ i) << 1 >> 1  # and, or, xor, shift_left, shift_right_arithmetic
    u = jax.lax.shift_right_logical(~i4, 2)  # not, shift_right_logical
    cmp = (u == i) | (u != i) | (u < i) | (u <= i) | (u > i) | (u >= i)  # comparisons
    chosen = jnp.where(cmp, u, i).astype(jnp.float32)  # select_n, convert_element_type
    as_int = jax.lax.bitcast_convert_type(chosen, jnp.int32)  # bitcast_convert_type
    y = jnp.broadcast_to(x, (2, 4)).reshape(4, 2).T  # broadcast_in_dim, reshape, transpose
    y = jnp.squeeze(y[:1], 0)  # slice, squeeze
    y = jnp.concatenate([y, jnp.stack([y, y])[0]])  # concatenate, stack
    a, b = jax.lax.split(y, (4, 4))  # split
    parts = jnp.unstack(jnp.arange(2.0))  # iota, unstack
    c = jnp.copy(a)  # copy
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("one",))
    c = jax.lax.with_sharding_constraint(c, jax.sharding.NamedSharding(one, P()))
    c = jax.device_put(c)  # device_put
    s = jax.lax.scan(lambda t, v: (t + v, v), 0.0, b)[0]  # scan
    s = jax.lax.while_loop(lambda t: t < 0, lambda t: t + 1, s)  # while
    s = jax.lax.cond(s > 0, lambda: s, lambda: -s)  # cond
    s = jax.checkpoint(lambda t: t * 2)(s)  # remat
    s = jax.nn.relu(s) + jax.nn.initializers.truncated_normal()(k, ())  # custom_jvp_call
    g = jax.custom_vjp(lambda t: t)
    g.defvjp(lambda t: (t, None), lambda _, d: (d,))
    s = g(s)  # custom_vjp_call
    s = jax.jit(lambda t: t + 1)(s)  # jit
    return w, bits, raw, as_int, c, s, parts[0], f16


def test_a_probe_constructor_binds_every_primitive_the_engine_knows():
    structs = (
        jax.ShapeDtypeStruct((), jax.random.key(0).dtype),
        jax.ShapeDtypeStruct((4,), np.float32),
        jax.ShapeDtypeStruct((), np.int32),
        jax.ShapeDtypeStruct((), np.float16),
    )
    seen: dict = {}
    _compat._walk(jax.make_jaxpr(_probe)(*structs), seen)
    bound = set(seen.values())
    # placement primitives that the probe cannot bind outside a mesh: their own probes
    elsewhere = {"reshard", "pvary", "core_call", "closed_call"}
    lacking = [n for n in _compat.KNOWN if n not in elsewhere and _compat.prim(n) not in bound]
    assert lacking == [], f"the probe binds no {lacking}: the engine's table and jax disagree"


def test_every_host_rule_names_a_primitive_the_compat_table_knows():
    # A rule under a name _compat does not resolve would never match an equation.
    unknown = sorted(set(_host._RULES) - set(_compat.KNOWN))
    assert unknown == []


def test_no_module_but_compat_recognizes_a_primitive_by_its_name():
    pattern = re.compile(r"primitive\.name\s*(==|!=|in\b|not in\b)|\.name\s*==\s*\"")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() == "_jax/compat.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize("closed", [True, False])
def test_open_and_consts_tells_closed_from_open_jaxprs_on_every_jax(closed):
    const = np.arange(3.0, dtype=np.float32)
    jaxpr = jax.make_jaxpr(lambda x: x * const)(np.zeros(3, np.float32))
    x = jaxpr if closed else _compat.open_and_consts(jaxpr)[0]
    body, consts = _compat.open_and_consts(x)
    assert hasattr(body, "eqns") and len(body.invars) == 1
    if closed:
        assert [np.asarray(c).tolist() for c in consts] == [[0.0, 1.0, 2.0]]


def test_value_config_changes_with_each_flag_that_changes_bits():
    before = _compat.value_config()
    old = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", not old)
    try:
        assert _compat.value_config() != before
    finally:
        jax.config.update("jax_threefry_partitionable", old)
    assert _compat.value_config() == before


def test_impl_name_reads_every_spelling_of_a_key_implementation():
    assert _compat.impl_name(threefry_prng_impl) == "threefry2x32"
    assert _compat.impl_name(jax.random.key_impl(jax.random.key(0))) == "threefry2x32"


def test_tracer_origin_messages_are_empty_only_inside_the_engine():
    # The one patch of a private jax attribute (the reason is in _compat): inside
    # meshinit's trace, a tracer's origin message is empty; everywhere else it is
    # jax's own.
    messages = {}

    def probe(x):
        y = x + 1
        if hasattr(type(y), "_origin_msg"):
            messages["inside" if _compat._TRACING.get() else "outside"] = y._origin_msg()
        return [y]

    _trace.trace(probe, np.float32(0))
    jax.make_jaxpr(lambda x: probe(x))(np.float32(0))  # a new function: traced anew
    if not messages:
        pytest.skip("this jax's tracers have no _origin_msg: nothing is patched")
    assert messages["inside"] == ""
    assert messages["outside"] != ""


def test_a_retraced_body_keeps_its_literals_weak_types_and_drops_the_trace_mesh():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    with jax.set_mesh(mesh):
        closed = jax.make_jaxpr(lambda x: x * 2.0 + 1)(jnp.ones((4,), jnp.bfloat16))
    body, _ = _compat.open_and_consts(closed)
    lits = [v.val for e in body.eqns for v in e.invars if isinstance(v, _compat.Literal)]
    assert lits and all(v.aval.sharding.mesh.shape == mesh.shape for v in lits)
    for v in lits:
        fresh = _compat.unmeshed_literal(v)
        assert type(fresh) is type(v) and fresh.dtype == v.dtype
        assert fresh.aval.weak_type == v.aval.weak_type
        assert fresh.aval.sharding.mesh.empty
        assert np.array_equal(np.asarray(fresh), np.asarray(v))
    again = _compat.retrace(closed, lambda x: _jaxpr.run(closed, [x], _jaxpr.bind_rehomed))
    assert again.out_avals[0].dtype == jnp.bfloat16
    assert again.out_avals[0].sharding.mesh.empty
    got = _jaxpr.run(again, [jnp.ones((4,), jnp.bfloat16)], _jaxpr.bind_node)[0]
    assert np.array_equal(np.asarray(got, np.float32), np.full(4, 3.0, np.float32))


def test_persist_every_compile_lowers_jax_s_thresholds_in_its_own_thread_only():
    assert _compat.PERSIST_EVERY_COMPILE, (
        f"jax {jax.__version__} has no thread-local persistent-cache thresholds: meshinit's "
        "programs are no longer written to the persistent cache whatever their compile time"
    )
    times = jax.config.jax_persistent_cache_min_compile_time_secs
    sizes = jax.config.jax_persistent_cache_min_entry_size_bytes
    inside, elsewhere = threading.Event(), {}

    def other_thread():  # the user's own jits, compiling while meshinit compiles
        inside.wait(10)
        elsewhere["time"] = jax.config.jax_persistent_cache_min_compile_time_secs
        elsewhere["size"] = jax.config.jax_persistent_cache_min_entry_size_bytes

    thread = threading.Thread(target=other_thread)
    thread.start()
    with _compat.persist_every_compile():
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
        inside.set()
        thread.join(10)
    assert elsewhere == {"time": times, "size": sizes}, "the override reached another thread"
    assert jax.config.jax_persistent_cache_min_compile_time_secs == times
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == sizes
