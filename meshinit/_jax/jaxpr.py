"""A traced constructor as a flat program: nested calls inlined, values numbered.

The constructor engine (:mod:`meshinit._engine.run`) cuts a constructor's jaxpr per
variable. It needs every equation at one level, so that a value made inside a nested
``jit`` (jax's initializers are jitted), a ``custom_jvp``/``custom_vjp`` (truncated
normal, gelu, relu) or a ``checkpoint`` can be cut like any other. :func:`flatten`
inlines those calls. Control flow (``scan``, ``while``, ``cond``: what ``nnx.scan`` and
``nn.scan`` produce for stacked layers) stays one :class:`Node`, evaluated as a unit.
``vmap`` needs nothing: it leaves batched primitives in the jaxpr. The same inner
jaxpr may be inlined many times (one per layer), so values are renumbered: a
:class:`Program`'s values are ints, not jax's ``Var`` objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, cast, final

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .. import _caches
from . import compat as _compat
from .compat import PRNGImpl

# Calls whose body is the whole of their forward meaning, inlined: the parameter that
# holds the body, by primitive (jax.checkpoint's prints as ``remat2``).
_INLINE_PARAMS = {
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat": "jaxpr",
}


@_caches.memo(maxsize=1)
def _inline() -> dict[Any, str]:
    return {p: k for n, k in _INLINE_PARAMS.items() if (p := _compat.prim(n)) is not None}


def is_identity(node: Node) -> bool:
    """Whether ``node`` only constrains or moves a value (:func:`_compat.placement_only`):
    the same value, placed by whoever places the output. Inside a group's program it
    would pin values to the meshes of other groups (or to a context mesh), so it is
    evaluated as the identity."""
    return _compat.placement_only(node.primitive)


@final  # never subclassed: lets mypy narrow ``type(x) is Lit`` checks both ways
@dataclasses.dataclass(frozen=True, slots=True)
class Lit:
    """A literal operand: its value and abstract value."""

    value: Any
    aval: Any


class Node:
    """One equation: ``outs = primitive.bind(*ins, **params)``.

    ``ins`` are value numbers or :class:`Lit`; ``outs`` are value numbers (-1 for an
    output nobody reads). ``source`` is the jaxpr equation it came from (one per
    inlined copy of it); ``control``: a parameter holds a jaxpr (scan, while, cond).
    Not to be modified once made. A plain class with slots: a flat program makes one
    per equation, and a frozen dataclass's ``__init__`` took a third of
    :func:`flatten`.
    """

    __slots__ = ("primitive", "params", "ins", "outs", "effects", "source", "control")

    def __init__(
        self,
        primitive: Any,
        params: dict[str, Any],
        ins: tuple[int | Lit, ...],
        outs: tuple[int, ...],
        effects: Any,
        source: Any = None,
        control: bool = False,
    ):
        self.primitive = primitive
        self.params = params
        self.ins = ins
        self.outs = outs
        self.effects = effects
        self.source = source
        self.control = control

    def __repr__(self) -> str:
        return f"Node({self.primitive.name}, ins={self.ins}, outs={self.outs})"


@dataclasses.dataclass
class Program:
    """A flat program over numbered values.

    Attributes:
      avals: the abstract value of every value number.
      inputs: the numbers of the traced function's arguments, in order.
      consts: value number -> the constant the jaxpr captured there.
      nodes: the equations in order; a value is made before it is read.
      outputs: one operand per output of the traced function.
      producer: value number -> index of the node that makes it.
    """

    avals: list[Any]
    inputs: list[int]
    consts: dict[int, Any]
    nodes: list[Node]
    outputs: list[int | Lit]
    producer: dict[int, int]


def flatten(closed: Any) -> Program:
    """The program of ``closed``, with every call of :data:`_INLINE` inlined."""
    prog = Program([], [], {}, [], [], {})
    # Per equation and per literal of ``closed`` (alive throughout, so ids are unique),
    # what every inlined copy shares: (inlined body or None, holds control flow), and
    # the Lit.
    kinds: dict[int, tuple[Any, bool]] = {}
    lits: dict[int, Lit] = {}
    avals, nodes, producer, consts_of = prog.avals, prog.nodes, prog.producer, prog.consts
    Literal, DropVar = _compat.Literal, _compat.DropVar
    inline = _inline()

    def kind(eqn: Any) -> tuple[Any, bool]:
        inner = inline.get(eqn.primitive)
        body = eqn.params.get(inner) if inner else None
        if body is not None:
            return body, False
        return None, any(_holds_jaxpr(p) for p in eqn.params.values())

    def lit(v: Any) -> Lit:
        hit = lits.get(id(v))
        if hit is None:
            hit = lits[id(v)] = Lit(v.val, v.aval)
        return hit

    def walk(jaxpr: Any, consts: Sequence[Any], args: Sequence[int | Lit]) -> list:
        env: dict[Any, int | Lit] = {}
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = n = len(avals)
            avals.append(var.aval)
            consts_of[n] = value
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            ins = tuple([lit(v) if type(v) is Literal else env[v] for v in eqn.invars])
            known = kinds.get(id(eqn))
            if known is None:
                known = kinds[id(eqn)] = kind(eqn)
            body, control = known
            if body is not None:
                outs = walk(*_compat.open_and_consts(body), ins)
                for v, out in zip(eqn.outvars, outs, strict=True):
                    if type(v) is not DropVar:
                        env[v] = out
                continue
            index = len(nodes)
            numbers = []
            for v in eqn.outvars:
                n = len(avals)
                avals.append(v.aval)
                if type(v) is DropVar:
                    numbers.append(-1)
                else:
                    numbers.append(n)
                    env[v] = n
                    producer[n] = index
            nodes.append(
                Node(eqn.primitive, eqn.params, ins, tuple(numbers), eqn.effects, eqn, control)
            )
        return [lit(v) if type(v) is Literal else env[v] for v in jaxpr.outvars]

    top, top_consts = _compat.open_and_consts(closed)
    prog.inputs = list(range(len(top.invars)))
    avals.extend(v.aval for v in top.invars)
    prog.outputs = walk(top, top_consts, prog.inputs)
    walk = cast(Any, None)  # noqa: F841  (a recursive closure is a cycle: break it, so that
    # the program is freed by reference counting, not by the next collection)
    return prog


def _holds_jaxpr(p: Any) -> bool:
    if _compat.is_jaxpr(p):
        return True
    return isinstance(p, tuple | list) and any(_holds_jaxpr(q) for q in p)


def run_nodes(
    prog: Program,
    nodes: Sequence[int],
    env: dict[int, Any],
    bind: Callable[[Node, list[Any]], Sequence[Any]] | None = None,
) -> dict[int, Any]:
    """Evaluates ``prog.nodes[i]`` for ``i`` in ``nodes``, in order, reading ``env``.

    ``env`` must hold every value the nodes read that they do not make; it is updated
    in place and returned. ``bind(node, ins)`` evaluates one node (default: bind its
    primitive), so that callers can substitute primitives.
    """
    bind = bind or bind_node

    def read(x: int | Lit) -> Any:
        return x.value if isinstance(x, Lit) else env[x]

    for i in nodes:
        node = prog.nodes[i]
        outs = bind(node, [read(x) for x in node.ins])
        for n, out in zip(node.outs, outs, strict=True):
            if n >= 0:
                env[n] = out
    return env


def bind_node(node: Node, ins: list[Any]) -> Sequence[Any]:
    """``node``'s primitive bound to ``ins``; the identity for :func:`is_identity`."""
    if len(ins) == len(node.outs) and is_identity(node):
        return ins
    return bind_as_traced(node, ins)


def bind_as_traced(node: Node, ins: list[Any]) -> Sequence[Any]:
    """``node``'s primitive bound to ``ins``, whatever it is."""
    return _compat.bind(node.primitive, ins, node.params)


def bind_rehomed(node: Node, ins: list[Any]) -> Sequence[Any]:
    """:func:`bind_node`, in a program lowered for a mesh other than the one the
    constructor was traced under.

    A loop's or a branch's body records the trace's mesh in every aval (and a
    sharding constraint in it names that mesh), and lowering it for a mesh of another
    shape or other devices fails ("use_abstract_mesh cannot change the size of the
    mesh"). Each body is traced anew under the current mesh, its placement-only
    equations the identity, as they are outside it: the same values. A node with a
    mesh of its own (``shard_map``) is bound as it is.
    """
    if len(ins) == len(node.outs) and is_identity(node):
        return ins
    ins = [_unplaced(x) for x in ins]
    if any(isinstance(p, Mesh | AbstractMesh) for p in node.params.values()):
        return bind_as_traced(node, ins)
    params = {k: _rehome(p) for k, p in node.params.items()}
    return _compat.bind(node.primitive, ins, params)


def _run_rehomed(closed: Any, args: Sequence[Any]) -> list[Any]:
    prog = flatten(closed)
    env = {n: _unplaced(c) for n, c in prog.consts.items()}
    env.update(zip(prog.inputs, args, strict=True))
    run_nodes(prog, range(len(prog.nodes)), env, bind_rehomed)
    return [_unplaced(x.value if isinstance(x, Lit) else env[x]) for x in prog.outputs]


def _unplaced(x: Any) -> Any:
    """A constant or a literal of the trace (made under its mesh) as a host value of
    no mesh; a traced value as it is."""
    if isinstance(x, np.ndarray):
        return _compat.unmeshed_literal(x)
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        # a key constant (one made outside the factory, of an implementation the host
        # part cannot pass in) read inside a program's trace: its data stays concrete
        with jax.ensure_compile_time_eval():
            data = np.asarray(jax.random.key_data(x))
        # jax accepts a numpy array here; its annotation says Array
        return jax.random.wrap_key_data(cast(jax.Array, data), impl=jax.random.key_impl(x))
    return np.asarray(x)


def _rehome(p: Any) -> Any:
    """A parameter, for the current mesh: a body traced anew; an output sharding of
    another mesh (``broadcast_in_dim``'s, ``iota``'s, ``dot_general``'s: where the
    output is placed, never what it is) left to the partitioner, as None."""
    if isinstance(p, NamedSharding):
        here = jax.sharding.get_abstract_mesh()
        mesh = p.mesh if isinstance(p.mesh, AbstractMesh) else p.mesh.abstract_mesh
        return p if mesh == here else None
    if _compat.is_jaxpr(p) and _compat.is_closed(p):
        return _compat.retrace(p, lambda *a: _run_rehomed(p, a))
    if isinstance(p, tuple | list) and _holds_jaxpr(p):
        return type(p)(_rehome(q) for q in p)
    return p


def run(closed: Any, args: Sequence[Any], bind: Callable[..., Any]) -> list[Any]:
    """``closed`` evaluated on ``args``, each equation (calls inlined) by ``bind``."""
    prog = flatten(closed)
    env = dict(prog.consts)
    env.update(zip(prog.inputs, args, strict=True))
    run_nodes(prog, range(len(prog.nodes)), env, bind)
    return [x.value if isinstance(x, Lit) else env[x] for x in prog.outputs]


def reads(closed: Any) -> list[frozenset[int]]:
    """For each output of ``closed``, the positions of the inputs its value reads.

    An equation's outputs read everything its inputs read, so the answer may say too
    much, never too little. Calls (``jit``, ``custom_jvp``) are inlined, so a jitted
    helper over a whole tree does not make every output read every input.
    """
    prog = flatten(closed)
    none: frozenset[int] = frozenset()
    deps: dict[int, frozenset[int]] = {n: frozenset({i}) for i, n in enumerate(prog.inputs)}
    for node in prog.nodes:
        found = none.union(*(deps.get(x, none) for x in node.ins if not isinstance(x, Lit)))
        for n in node.outs:
            deps[n] = found
    return [none if isinstance(x, Lit) else deps.get(x, none) for x in prog.outputs]


class Unfingerprintable(Exception):
    """A parameter that a structural fingerprint cannot describe; ``callable`` says
    whether it is a Python callable (else an unhashable value or an odd constant)."""

    def __init__(self, message: str, callable: bool):
        super().__init__(message)
        self.callable = callable


def _canon(x: Any, memo: dict[Any, Any]) -> Any:
    """A structural, hashable, repr-stable description of a primitive's parameter."""
    if x is None or isinstance(x, bool | int | float | complex | str | bytes):
        return (type(x).__name__, x)
    if isinstance(x, PRNGImpl):
        return ("prng", x.name, x.tag, tuple(x.key_shape))
    if _compat.is_jaxpr(x):
        hit = memo.get(id(x))
        if hit is None:  # x kept in the memo: its id stays unique
            body, consts = _compat.open_and_consts(x)
            described = (_canon_jaxpr(body, memo), tuple(_canon_const(c) for c in consts))
            hit = memo[id(x)] = (x, ("jaxpr", *described))
        return hit[1]
    if isinstance(x, Mesh | AbstractMesh):
        return _canon_mesh(x)
    if isinstance(x, NamedSharding):
        return ("named", _canon_mesh(x.mesh), repr(x.spec), x.memory_kind)
    if isinstance(x, tuple | list):
        return (type(x).__name__, tuple(_canon(y, memo) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((str(k), _canon(v, memo)) for k, v in x.items())))
    if isinstance(x, np.dtype) or _is_dtype(x):
        return ("dtype", str(x))
    if isinstance(x, np.ndarray | np.generic):
        return _canon_const(x)
    if callable(x) and not isinstance(x, type):
        name = getattr(x, "__qualname__", None)
        what = type(x).__name__ if name is None else f"{type(x).__name__} {name}"
        raise Unfingerprintable(f"parameter is a Python callable ({what})", True)
    try:
        h = hash(x)
    except TypeError:
        raise Unfingerprintable(f"parameter is an unhashable {type(x).__name__}", False) from None
    # repr alone may say less than equality does; equal objects hash alike, so the hash
    # never splits what is equal (this process's caches only: str hashes are salted)
    return (type(x).__qualname__, repr(x), h)


def _canon_mesh(mesh: Any) -> Any:
    """A mesh by its structure: axes, sizes, types and (for a concrete mesh) devices."""
    if mesh.empty:  # its device array is one None: no devices
        return ("mesh", "empty")
    devices = None
    if isinstance(mesh, Mesh):
        devices = tuple(int(d.id) for d in mesh.devices.flat)
    types = tuple(str(t) for t in getattr(mesh, "axis_types", ()) or ())
    return ("mesh", tuple(mesh.axis_names), tuple(mesh.axis_sizes), types, devices)


def _is_dtype(x: Any) -> bool:
    try:
        return isinstance(x, type) and np.dtype(x) is not None
    except TypeError:
        return False


def _canon_const(c: Any) -> Any:
    """A constant by its dtype, shape and bytes; a key array by its implementation and
    its key data."""
    if isinstance(c, jax.Array) and jax.dtypes.issubdtype(c.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(c)
        return ("key", _canon(impl, {}), _canon_const(jax.random.key_data(c)))
    if jax.dtypes.issubdtype(np.result_type(c), jax.dtypes.extended):
        raise Unfingerprintable("operand is an extended-dtype constant", False)
    a = np.asarray(c)
    return ("const", str(a.dtype), a.shape, hashlib.blake2b(a.tobytes(), digest_size=16).digest())


def _canon_aval(aval: Any) -> Any:
    return (str(aval.dtype), tuple(aval.shape), bool(getattr(aval, "weak_type", False)))


def _canon_jaxpr(jaxpr: Any, memo: dict[Any, Any]) -> Any:
    names: dict[Any, int] = {}

    def ref(v: Any) -> Any:
        if isinstance(v, _compat.Literal):
            return ("lit", _canon_aval(v.aval), _canon_const(v.val))
        return names.setdefault(v, len(names))

    header = (tuple(ref(v) for v in jaxpr.constvars), tuple(ref(v) for v in jaxpr.invars))
    eqns = []
    for e in jaxpr.eqns:
        ins = tuple(ref(v) for v in e.invars)
        outs = tuple(_canon_aval(v.aval) for v in e.outvars)
        for v in e.outvars:
            ref(v)
        prim = e.primitive
        eqns.append((prim.name, id(prim), _canon_params(prim, e.params, memo), ins, outs))
    return ("body", header, tuple(eqns), tuple(ref(v) for v in jaxpr.outvars))


def _canon_params(primitive: Any, params: dict[str, Any], memo: dict[Any, Any]) -> Any:
    """An equation's parameters, described. A call that :func:`flatten` inlines is
    described by its body alone: its other parameters are its derivative rules
    (``custom_jvp``'s ``jvp_jaxpr_fun``, Python callables), which a forward evaluation
    never runs."""
    body = _inline().get(primitive)
    if body is not None and body in params:
        return (("body", _canon(params[body], memo)),)
    return tuple(sorted((k, _canon(p, memo)) for k, p in params.items()))


def slice_fingerprint(
    prog: Program, nodes: Sequence[int], inputs: Sequence[int], out: Any, memo: dict, consts=()
) -> str:
    """A digest of the computation ``nodes`` make of ``inputs`` up to ``out`` (a value
    or a Lit), with the captured constants ``consts`` in it by value.

    Structural: primitives, parameters (nested jaxprs included), shapes, dtypes and
    every literal operand's value, never Python identity; two slices with equal digests
    compute the same function of their inputs. Literals are described where they are
    read, per equation copy: the inlined copies of one jitted helper share their
    equations but not the scalars their callers pass in.

    Raises:
      Unfingerprintable: a parameter is a Python callable.
    """
    names: dict[int, Any] = {n: k for k, n in enumerate(inputs)}
    for n in consts:  # a constant read in the slice is described by its value
        names[n] = ("const", _canon_aval(prog.avals[n]), _canon_const(prog.consts[n]))
    parts: list[Any] = [tuple([_aval_key(prog.avals[n], memo) for n in inputs])]
    all_nodes = prog.nodes
    for i in nodes:
        node = all_nodes[i]
        try:
            ins = tuple([_lit_key(x, memo) if type(x) is Lit else names[x] for x in node.ins])
            key = _node_key(node, prog, memo)
        except Unfingerprintable as e:  # say which equation: the cut's reason names it
            raise Unfingerprintable(f"{node.primitive.name}'s {e}", e.callable) from None
        for n in node.outs:
            if n >= 0:
                names[n] = len(names) - len(consts)
        parts.append((key, ins))
    parts.append(_lit_key(out, memo) if isinstance(out, Lit) else names[out])
    whole = ("slice", tuple(parts))  # equal tuples, equal digests: one repr per structure
    digest = memo.get(whole)
    if digest is None:
        digest = memo[whole] = hashlib.blake2b(repr(whole[1]).encode(), digest_size=16).hexdigest()
    return digest


def _lit_key(x: Lit, memo: dict[Any, Any]) -> Any:
    """A literal operand's value and abstract value (memoized per Lit, kept alive)."""
    hit = memo.get(id(x))
    if hit is None:
        hit = memo[id(x)] = (x, ("lit", _canon_aval(x.aval), _canon_const(x.value)))
    return hit[1]


def _aval_key(aval: Any, memo: dict[Any, Any]) -> Any:
    hit = memo.get(id(aval))
    if hit is None:
        hit = memo[id(aval)] = (aval, _canon_aval(aval))  # aval kept: its id stays unique
    return hit[1]


def _node_key(node: Node, prog: Program, memo: dict[Any, Any]) -> str:
    """What one equation computes, apart from its operands: its primitive, parameters
    and output avals. Memoized per source equation, which every inlined copy of one
    jitted initializer shares; operands, literals included, are the caller's part."""
    source = node.source if node.source is not None else node
    hit = memo.get(id(source))
    if hit is None:
        outs = tuple(_aval_key(prog.avals[n], memo) if n >= 0 else None for n in node.outs)
        params = _canon_params(node.primitive, node.params, memo)
        # the primitive by name and object: two primitives may share a name
        described = ("node", node.primitive.name, id(node.primitive), params, outs)
        key = memo.get(described)  # the same equation elsewhere (another layer's copy)
        if key is None:
            text = repr(described[1:]).encode()
            key = memo[described] = hashlib.blake2b(text, digest_size=16).hexdigest()
        hit = memo[id(source)] = (source, key)
    return hit[1]
