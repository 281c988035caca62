"""The small part of a constructor, evaluated on the host with numpy, exactly.

What a constructor computes besides its large arrays is keys, RNG counters, scalars
and small arrays: ``nnx.Rngs`` folding a counter into its key for every parameter, a
norm's ones. The engine evaluates that part once, here, with numpy: no compile, no
dispatch, and the same bits on every process of a multi-host run.

Only primitives whose numpy twin gives jax's bits are evaluated here: integer and
bitwise arithmetic, moves, casts and broadcasts, and jax's threefry2x32 keys (the hash
is :func:`meshinit._jax.threefry.threefry_rounds`). Float arithmetic is not: XLA contracts a
multiply and an add inside a jitted initializer into one fused multiply-add, which
numpy's two roundings miss. That, and anything else (``erf``, ``exp``, a float to int
conversion, another key implementation), raises :class:`NotHost`, and the value is
computed inside the compiled program of each variable that needs it instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import _caches
from .._jax import compat as _compat
from .._jax import jaxpr as _jaxpr
from .._jax.threefry import SHARDING_INVARIANT_IMPL, threefry_ints, threefry_rounds
from .host_numeric import FLOATS, NotHost, convert, int_div, int_rem, moved, shift, subnormal


class HostKey:
    """A batch of threefry keys on the host: ``data`` is uint32[*shape, 2]."""

    __slots__ = ("data",)

    def __init__(self, data: np.ndarray):
        self.data = data


def _exact_float(dtype: Any) -> None:
    # bf16 and the float8 types are numpy kind "V", complex "c": not kind "f"
    if jax.dtypes.issubdtype(dtype, np.inexact) and np.dtype(dtype) not in FLOATS:
        raise NotHost(f"{dtype} arithmetic")  # numpy rounds bf16/f16 ops differently


def _elementwise(fn: Callable[..., Any], floats: bool = True) -> Callable[..., Any]:
    def rule(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
        if node.params.get("out_dtype") is not None or node.params.get("accuracy") is not None:
            raise NotHost(f"{node.primitive.name} with out_dtype or accuracy")
        dtype = np.dtype(_out_aval(node).dtype)
        if jax.dtypes.issubdtype(dtype, np.inexact):  # bf16, float8 (kind "V"), complex
            if not floats:
                raise NotHost(node.primitive.name)
            _exact_float(dtype)
        return [fn(*ins)]

    rule.reads_aval = True  # type: ignore[attr-defined]
    return rule


def _out_aval(node: _jaxpr.Node) -> Any:
    return node.params["_aval"]


def _integer(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Float arithmetic stays in the compiled programs: XLA contracts a multiply and an
    # add into one fused multiply-add inside a jitted initializer (jax.random.uniform),
    # and numpy's two roundings would differ from it, by thousands of ulp near zero.
    return _elementwise(fn, floats=False)


def _compare(fn: Callable[..., Any]) -> Callable[..., Any]:
    def rule(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
        for x in ins:
            if jax.dtypes.issubdtype(x.dtype, np.complexfloating) or subnormal(x):
                raise NotHost(f"{node.primitive.name} of a subnormal or complex number")
        return [fn(*ins)]

    return rule


_RULES: dict[str, Callable[[_jaxpr.Node, list[Any]], list[Any]]] = {
    "add": _integer(np.add),
    "sub": _integer(np.subtract),
    "mul": _integer(np.multiply),
    "div": _integer(int_div),
    "rem": _elementwise(int_rem),
    "neg": _integer(np.negative),
    "max": _integer(np.maximum),
    "min": _integer(np.minimum),
    "abs": _integer(np.abs),
    "sign": _integer(np.sign),
    "and": _elementwise(np.bitwise_and, floats=False),
    "or": _elementwise(np.bitwise_or, floats=False),
    "xor": _elementwise(np.bitwise_xor, floats=False),
    "not": _elementwise(np.invert, floats=False),
    "shift_left": _elementwise(shift("left"), floats=False),
    "shift_right_arithmetic": _elementwise(shift("arithmetic"), floats=False),
    "shift_right_logical": _elementwise(shift("logical"), floats=False),
    "eq": _compare(np.equal),
    "ne": _compare(np.not_equal),
    "lt": _compare(np.less),
    "le": _compare(np.less_equal),
    "gt": _compare(np.greater),
    "ge": _compare(np.greater_equal),
}


def _rule(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _RULES[name] = fn
        return fn

    return register


@_rule("convert_element_type")
def _convert(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    return [convert(ins[0], node.params["new_dtype"])]


@_rule("bitcast_convert_type")
def _bitcast(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    (x,) = ins
    new = np.dtype(node.params["new_dtype"])
    if new.itemsize != x.dtype.itemsize:
        raise NotHost("bitcast to another width")
    return [x.view(new)]


@_rule("broadcast_in_dim")
def _broadcast(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    x = ins[0]
    shape, dims = node.params["shape"], node.params["broadcast_dimensions"]
    expanded = [1] * len(shape)
    for d, size in zip(dims, x.shape, strict=True):
        expanded[d] = size
    return [np.broadcast_to(x.reshape(expanded), shape).copy()]


@_rule("reshape")
def _reshape(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    x, dims = ins[0], node.params.get("dimensions")
    if dims is not None:
        if len(dims) != x.ndim:
            raise NotHost("reshape with dimensions of another rank")  # keys: _on_key_data
        x = np.transpose(x, dims)  # lax.reshape's dimensions: transpose first
    return [x.reshape(node.params["new_sizes"])]


@_rule("squeeze")
def _squeeze(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    return [np.squeeze(ins[0], axis=tuple(node.params["dimensions"]))]


@_rule("transpose")
def _transpose(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    return [np.transpose(ins[0], node.params["permutation"]).copy()]


@_rule("slice")
def _slice(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    p = node.params
    strides = p["strides"] or (1,) * len(p["start_indices"])
    index = tuple(
        slice(a, b, s)
        for a, b, s in zip(p["start_indices"], p["limit_indices"], strides, strict=True)
    )
    return [ins[0][index].copy()]


@_rule("concatenate")
def _concatenate(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    return [np.concatenate(ins, axis=node.params["dimension"])]


@_rule("stack")
def _stack(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    return [np.stack(ins, axis=node.params["axis"])]


@_rule("split")
def _split(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    sizes, axis = node.params["sizes"], node.params["axis"]
    return list(np.split(ins[0], np.cumsum(sizes)[:-1], axis=axis))


@_rule("unstack")
def _unstack(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    parts = np.moveaxis(ins[0], node.params["axis"], 0)
    return [part.copy() for part in parts]


@_rule("iota")
def _iota(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    p = node.params
    shape, dim = p["shape"], p["dimension"]
    line = np.arange(shape[dim], dtype=np.dtype(p["dtype"]))
    return [
        np.broadcast_to(
            line.reshape([-1 if d == dim else 1 for d in range(len(shape))]), shape
        ).copy()
    ]


@_rule("select_n")
def _select_n(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    which, *cases = ins
    moved(cases)
    index = np.asarray(which).astype(np.int32)
    if len(cases) > 32 or np.any(index < 0) or np.any(index >= len(cases)):
        # jax leaves an out-of-range case undefined (np.choose would raise ValueError)
        raise NotHost("select_n with an out-of-range case")
    return [np.choose(index, cases)]


@_rule("copy")
def _copy(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    moved(ins)
    return [ins[0]]


_PLACEMENT = ("sharding_constraint", "device_put", "reshard", "pvary")  # _jaxpr.identity()
for _name in _PLACEMENT:
    _RULES[_name] = lambda node, ins: list(ins)


@_rule("iota_2x32_shape")
def _iota_2x32(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    shape = node.params["shape"]
    flat = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64).reshape(shape)
    return [(flat >> np.uint64(32)).astype(np.uint32), flat.astype(np.uint32)]


@_rule("threefry2x32")
def _threefry(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    shape = np.broadcast_shapes(*(np.shape(a) for a in ins))
    k1, k2, x1, x2 = (np.broadcast_to(np.asarray(a, np.uint32), shape) for a in ins)
    return list(threefry_rounds(k1, k2, x1, x2))


def _threefry_impl(impl: Any) -> None:
    if _compat.impl_name(impl) != SHARDING_INVARIANT_IMPL:
        raise NotHost(f"key implementation {_compat.impl_name(impl)!r}")


@_rule("random_wrap")
def _random_wrap(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    _threefry_impl(node.params["impl"])
    return [HostKey(np.asarray(ins[0], np.uint32))]


@_rule("random_unwrap")
def _random_unwrap(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    return [_key(ins[0]).data]


def _key(x: Any) -> HostKey:
    if not isinstance(x, HostKey):
        raise NotHost("not a host key")
    return x


@_caches.memo(maxsize=256)
def _impl_program(
    op: str, batch: tuple[int, ...], arg_shapes: tuple[Any, ...], static: Any, config: Any
):
    """jax's threefry function ``op``, vmapped over ``batch``, as a flat program."""
    impl = _compat.THREEFRY_IMPL
    fns: dict[str, Callable[..., Any]] = {
        "seed": lambda s: impl.seed(s),
        "fold_in": lambda k, m: impl.fold_in(k, m),
        "split": lambda k: impl.split(k, static),
        "random_bits": lambda k: impl.random_bits(k, *static),
    }
    fn = fns[op]
    for _ in batch:
        fn = jax.vmap(fn)
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in arg_shapes]
    return _jaxpr.flatten(jax.make_jaxpr(fn)(*structs))


def _run_impl(op: str, batch: tuple[int, ...], args: list[np.ndarray], static: Any = None):
    shapes = tuple((a.shape, a.dtype) for a in args)
    # traced anew when the configuration changes jax's threefry (partitionable counters)
    prog = _impl_program(op, batch, shapes, static, _compat.value_config())
    env = dict(zip(prog.inputs, args, strict=True))
    env.update(prog.consts)
    run_on_host(prog, range(len(prog.nodes)), env)
    (out,) = [o.value if isinstance(o, _jaxpr.Lit) else env[o] for o in prog.outputs]
    return np.asarray(out)


@_rule("random_seed")
def _random_seed(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    _threefry_impl(node.params["impl"])
    seeds = np.asarray(ins[0])
    return [HostKey(_run_impl("seed", seeds.shape, [seeds]))]


@_rule("random_fold_in")
def _random_fold_in(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    key, msgs = _key(ins[0]), np.asarray(ins[1])
    batch = np.broadcast_shapes(key.data.shape[:-1], msgs.shape)
    data = np.broadcast_to(key.data, (*batch, 2))
    if msgs.dtype == np.uint32 and batch == ():
        # one key (nnx.Rngs folds once per draw): the hash on Python ints, 20x faster
        # than numpy's scalar arithmetic
        h1, h2 = threefry_ints(int(data[0]), int(data[1]), 0, int(msgs))
        return [HostKey(np.array([h1, h2], np.uint32))]
    if msgs.dtype == np.uint32:
        # jax's threefry fold_in hashes the count (0, msg) with the key: the hash
        # directly, without running its program.
        zero = np.zeros(batch, np.uint32)
        k1, k2 = data[..., 0], data[..., 1]
        h1, h2 = threefry_rounds(k1, k2, zero, np.broadcast_to(msgs, batch))
        return [HostKey(np.stack([np.asarray(h1), np.asarray(h2)], axis=-1).astype(np.uint32))]
    msgs = np.broadcast_to(msgs, batch).copy()
    return [HostKey(_run_impl("fold_in", batch, [np.ascontiguousarray(data), msgs]))]


@_rule("random_split")
def _random_split(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    key = _key(ins[0])
    shape = tuple(node.params["shape"])
    return [HostKey(_run_impl("split", key.data.shape[:-1], [key.data], shape))]


@_rule("random_bits")
def _random_bits(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    key = _key(ins[0])
    static = (node.params["bit_width"], tuple(node.params["shape"]))
    return [_run_impl("random_bits", key.data.shape[:-1], [key.data], static)]


def _on_key_data(node: _jaxpr.Node, ins: list[Any], name: str) -> list[Any]:
    """A structural equation on keys: the same equation on their data, whose trailing
    dimension (the key's two words) comes along untouched."""
    p = dict(node.params)
    data = [x.data if isinstance(x, HostKey) else x for x in ins]
    ndim = data[0].ndim - 1
    if name == "slice":
        p["start_indices"] = (*p["start_indices"], 0)
        p["limit_indices"] = (*p["limit_indices"], 2)
        p["strides"] = None if p["strides"] is None else (*p["strides"], 1)
    elif name == "reshape":
        p["new_sizes"] = (*p["new_sizes"], 2)
    elif name == "broadcast_in_dim":
        p["shape"] = (*p["shape"], 2)
        p["broadcast_dimensions"] = (*p["broadcast_dimensions"], len(p["shape"]) - 1)
    elif name == "transpose":
        p["permutation"] = (*p["permutation"], ndim)
    elif name == "select_n":
        data[0] = np.asarray(data[0])[..., None]
    elif name not in ("squeeze", "concatenate", "copy", "unstack", *_PLACEMENT):
        raise NotHost(f"{name} on keys")
    moved = _jaxpr.Node(node.primitive, p, node.ins, node.outs, node.effects)
    return [HostKey(np.asarray(out, np.uint32)) for out in _RULES[name](moved, data)]


@_caches.memo(maxsize=1)
def _by_primitive() -> dict[Any, tuple[str, Callable[..., Any]]]:
    """The rules by the installed jax's primitive objects (:mod:`meshinit._jax.compat`)."""
    table = {}
    for name, rule in _RULES.items():
        primitive = _compat.prim(name)
        if primitive is not None:
            table[primitive] = (name, rule)
    return table


def _bind(node: _jaxpr.Node, ins: list[Any]) -> list[Any]:
    hit = _by_primitive().get(node.primitive)
    if hit is None or node.effects:
        raise NotHost(node.primitive.name)
    name, rule = hit
    if name not in _KEY_RULES and any(isinstance(x, HostKey) for x in ins):
        return _on_key_data(node, ins, name)
    return rule(node, ins)


_KEY_RULES = frozenset({"random_fold_in", "random_split", "random_bits", "random_unwrap"})


def run_on_host(prog: _jaxpr.Program, nodes: Any, env: dict[int, Any]) -> dict[int, Any]:
    """Every node of ``nodes`` on the host; raises :class:`NotHost` at the first miss."""
    with quiet():
        for i in nodes:
            env.update(_results(prog, prog.nodes[i], env))
    return env


def _results(prog: _jaxpr.Program, node: _jaxpr.Node, env: dict[int, Any]) -> list:
    """``(value number, host value)`` of each output of ``node``; raises NotHost."""
    outs = _bind(_with_aval(node, prog), [_operand(x, env) for x in node.ins])
    pairs = zip(node.outs, outs, strict=True)
    return [(n, _cast(out, prog.avals[n])) for n, out in pairs if n >= 0]


def _operand(x: Any, env: dict[int, Any]) -> Any:
    if isinstance(x, _jaxpr.Lit):
        return as_host(x.value, x.aval)
    return env[x]


def _with_aval(node: _jaxpr.Node, prog: _jaxpr.Program) -> _jaxpr.Node:
    hit = _by_primitive().get(node.primitive)
    reads = hit is not None and getattr(hit[1], "reads_aval", False)
    if not reads or not node.outs or node.outs[0] < 0:
        return node
    params = {**node.params, "_aval": prog.avals[node.outs[0]]}
    return _jaxpr.Node(node.primitive, params, node.ins, node.outs, node.effects)


def _cast(out: Any, aval: Any) -> Any:
    if isinstance(out, HostKey):
        if out.data.shape != (*aval.shape, 2):
            raise NotHost("key shape mismatch")
        return out
    out = np.asarray(out)
    if out.shape != tuple(aval.shape):
        raise NotHost("shape mismatch")  # a rule that disagrees with jax: never guess
    return out if out.dtype == aval.dtype else out.astype(aval.dtype)


def as_host(value: Any, aval: Any) -> Any:
    """A literal or captured constant as a host value (a numpy array or a HostKey)."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        if not isinstance(value, jax.Array):
            raise NotHost("an extended-dtype constant")
        _threefry_impl(jax.random.key_impl(value))
        return HostKey(np.asarray(jax.random.key_data(value)))
    if isinstance(value, jax.core.Tracer):
        raise NotHost("a tracer")
    return np.asarray(value, dtype=aval.dtype)


def is_host(node: _jaxpr.Node) -> bool:
    """Whether ``node``'s primitive has a host rule at all (it may still refuse)."""
    return node.primitive in _by_primitive() and not node.effects


def quiet() -> Any:
    """numpy's wrap-around (uint32 hashing), x / 0 and 0 / 0 without warnings: what
    :func:`evaluate_one` expects around it, entered once for many nodes."""
    return np.errstate(over="ignore", divide="ignore", invalid="ignore")


def evaluate_one(prog: _jaxpr.Program, i: int, env: dict[int, Any]) -> bool:
    """Evaluates node ``i`` on the host into ``env``; False (env unchanged) if it can't.

    Call it inside :func:`quiet`.
    """
    try:
        results = _results(prog, prog.nodes[i], env)
    except NotHost:
        return False
    env.update(results)
    return True
