"""The constructor engine: unchanged model code, compiled once per signature.

``meshinit.nnx.init``, ``meshinit.linen.init`` and ``meshinit.eqx.init`` hand their
framework's constructor here as a function of host values (key data, example inputs)
that returns one array per variable. The engine:

1. **traces it once** to a jaxpr (:func:`meshinit._engine.trace.trace`), abstractly;
2. **flattens** nested calls (:func:`meshinit._jax.jaxpr.flatten`): jitted initializers,
   ``custom_jvp``/``custom_vjp``, ``checkpoint``; control flow stays one unit;
3. **evaluates the small part on the host** (:func:`meshinit._engine.trace.evaluate_host_part`, with
   :mod:`meshinit._engine.host_eval`): keys, RNG counters, scalars and arrays of at most
   ``meshinit._engine.trace.SMALL_BYTES``, with numpy, exactly, for just the variables it makes;
4. **cuts one slice per remaining variable** (:func:`meshinit._engine.trace.cut`): the
   equations between its small inputs and its value, fingerprinted structurally
   (:func:`meshinit._jax.jaxpr.slice_fingerprint`);
5. **compiles once per (mesh, fingerprint, sharding)**, with exact out_shardings,
   through the spec path's rounds (:func:`meshinit._run.strategies.bucket_batches`): a bucket's
   executable makes one variable of each of its signatures per call, so a 32-layer
   model compiles what an 8-layer one does, and runs each slice with its own inputs.

Small variables the host made (a norm's ones, an RNG counter) are recomputed in their
bucket's program from their exact equations, riding in its launches; captured
constants (a pretrained embedding as a numpy array) are placed shard by shard from the
host, never as a full copy on one device. A slice the engine cannot
fingerprint or must not run as a unit (a Python callback, a side effect) falls back
to the whole-constructor program for just those variables, with a
:class:`meshinit.FallbackWarning` per cause (:func:`meshinit._run.progress.fell_back`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .._caches import LRUCache
from .._jax import compat as _compat
from .._jax import explicit as _explicit
from .._jax import jaxpr as _jaxpr
from .._jax import threefry as _threefry
from .._jax import tiles as _tiles
from .._jax.jaxpr import Lit
from .._plan.plan import MeshGroup, Plan, PlanEntry
from .._run import agree as _agree
from .._run import checks as _checks
from .._run import compile as _compile
from .._run import progress as _progress
from .._run import strategies as _strategies
from .._run.loop import run_plan
from .._run.maker import Needs, Runner
from .._run.place import place
from . import host_eval as _host
from . import trace as _trace
from .trace import Traced


def _input_value(traced: Traced, n: int, sharding: NamedSharding | None) -> Any:
    """The argument for value ``n``: host data, or a large constant placed shard by shard."""
    if n in traced.host:
        v = traced.host[n]
        return v.data if isinstance(v, _host.HostKey) else v
    const = traced.program.consts[n]
    if sharding is None:
        return np.asarray(const)
    return place(const, sharding)


def _input_struct(traced: Traced, n: int, sharding: NamedSharding | None) -> Any:
    aval = traced.program.avals[n]
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return jax.ShapeDtypeStruct((*aval.shape, 2), np.uint32)
    if n in traced.host:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


def _const_sharding(traced: Traced, n: int, entry: PlanEntry) -> NamedSharding | None:
    """How a large captured constant enters ``entry``'s program: on the entry's sharding
    when it has the entry's shape (no full copy anywhere), else replicated (None)."""
    if n in traced.host:
        return None
    if tuple(traced.program.avals[n].shape) == entry.spec.shape:
        # on the all-Auto twin that the program is traced under: the same devices
        mesh = cast(Mesh, entry.mesh)  # materialize refuses abstract meshes first
        return NamedSharding(_compile.auto_twin(mesh), entry.sharding.spec)
    return None


def _evaluator(
    traced: Traced,
    s: _trace.Slice,
    key_impl: Any,
    straight: bool,
    mesh: Mesh,
    sharding: NamedSharding,
) -> Callable[..., Any]:
    """``s`` as a traceable function of its inputs' values (keys as their data), in
    a program for ``mesh`` that places it on ``sharding``: a large value made in tiles
    (:mod:`meshinit._jax.tiles`) where its equations allow, with the same bits."""
    prog = traced.program
    straight = straight and not s.folded  # a folded scalar: jax's own bits, as jit's
    hash_p, wrap_p, seed_p = (
        _compat.prim(n) for n in ("threefry2x32", "random_wrap", "random_seed")
    )

    def straight_bind(node: _jaxpr.Node, ins: list[Any]) -> Sequence[Any]:
        prim = node.primitive
        if straight and prim is hash_p:  # its words apart, as _threefry.PROGRAM_KEY_IMPL
            return jax.lax.optimization_barrier(_threefry.threefry2x32(*ins))
        if straight and prim is wrap_p and _threefry.is_threefry(node.params["impl"]):
            return [jax.random.wrap_key_data(ins[0], impl=key_impl)]
        if straight and prim is seed_p and _threefry.is_threefry(node.params["impl"]):
            return [jax.random.key(ins[0], impl=key_impl)]
        return other(node, ins)

    other = _jaxpr.bind_rehomed if _rehomes(traced, mesh) else _jaxpr.bind_node
    bind: _explicit.Bind = straight_bind
    explicit = traced.explicit and not isinstance(s.out, Lit)
    if explicit and not isinstance(s.out, Lit):  # jit's constraints there
        shape = tuple(prog.avals[s.out].shape)
        bind = _explicit.explicit_bind(bind, _compile.auto_twin(mesh), shape, sharding.spec)
    keys = [jax.dtypes.issubdtype(prog.avals[n].dtype, jax.dtypes.extended) for n in s.inputs]

    fixed = {n: np.asarray(prog.consts[n]) for n in s.consts}  # constants, as jit has them
    # host values jit holds as constants (_trace.folded_scalar); keys wrapped in run
    fixed.update({n: _trace.host_constant(traced.host[n]) for n in s.folded})
    folded_keys = [n for n in s.folded if isinstance(traced.host[n], _host.HostKey)]
    twin = NamedSharding(_compile.auto_twin(mesh), sharding.spec, memory_kind=sharding.memory_kind)
    tiled = _tiles.tiling(prog, s.nodes, s.out, twin, _strategies.tiles(mesh))

    def run(*values: Any) -> Any:
        env: dict[int, Any] = dict(fixed)
        for n in folded_keys:  # a constant of the program, as jit's key
            env[n] = jax.random.wrap_key_data(env[n], impl=_threefry.SHARDING_INVARIANT_IMPL)
        for n, v, is_key in zip(s.inputs, values, keys, strict=True):
            env[n] = jax.random.wrap_key_data(v, impl=key_impl) if is_key else v
        if tiled is not None:
            # each hash's words apart, as bind makes them in the whole slice's program
            return _tiles.evaluate(
                prog, tiled, env, bind, straight=straight, barrier=straight, explicit=explicit
            )
        _jaxpr.run_nodes(prog, s.nodes, env, bind)
        return s.out.value if isinstance(s.out, Lit) else env[s.out]

    return run


def _ids(group: MeshGroup) -> tuple[int, ...]:
    return tuple(map(id, group.entries))  # the same for every subplan of these entries


def _rehomes(traced: Traced, mesh: Mesh) -> bool:
    """Whether a program for ``mesh`` must trace loop bodies anew
    (:func:`_jaxpr.bind_rehomed`): the constructor was traced under another mesh."""
    return traced.mesh is not None and traced.mesh != _compile.auto_twin(mesh)


# ------------------------------------------------------------------------ running


@dataclasses.dataclass(frozen=True)
class _Work:
    """One group's share: how each of its entries is made."""

    host: tuple[tuple[int, Any], ...]  # (position, host value)
    consts: tuple[tuple[int, Any], ...]  # (position, captured constant)
    group: MeshGroup  # the sliced entries, with slice signatures
    positions: tuple[int, ...]  # position in the plan group of each sliced entry
    slices: tuple[_trace.Slice, ...]
    fallback: tuple[tuple[int, int], ...]  # (position, output index)

    # Asked only after run_plan's checks: an abstract mesh has no platform.
    @functools.cached_property
    def on_cpu(self) -> bool:
        mesh = cast(Mesh, self.group.mesh)  # run_plan refuses abstract meshes first
        return bool(self.group.entries) and _compile.on_cpu(mesh)

    @functools.cached_property
    def buckets(self) -> list[tuple[int, ...]]:
        """Indices into ``group.batches``, bucketed as the spec path's rounds do."""
        return _strategies.bucket_batches(self.group, None) if self.group.entries else []


def make_arrays(
    plan: Plan,
    traced: Traced,
    outputs: Sequence[int],
    *,
    what: str,
    progress: bool | None = None,
    existing: Any = None,
) -> Any:
    """Places every output of ``traced`` on its planned sharding.

    Args:
      plan: the plan of the variables; entry ``i`` is output ``outputs[i]``.
      traced: from :func:`meshinit._engine.trace.trace`.
      outputs: one output index per plan entry, in entry order.
      what: the name the progress bar and the log use.
      existing: dot-joined path -> array, placed instead of made: nothing is cut,
        compiled or run for those entries (``meshinit._run.checks.split_given``).

    Returns:
      The planned tree with a ready array in place of each spec.
    """
    given, todo = _checks.split_given(plan, existing, what)
    prog = traced.program
    index = {id(e): outputs[i] for i, e in enumerate(plan.entries)}
    # the host part of just what is made: a given variable's keys are never computed
    traced = _trace.evaluate_host_part(traced, [prog.outputs[index[id(e)]] for e in todo.entries])
    memo: dict[Any, Any] = {}
    works: dict[tuple[int, ...], _Work] = {}  # by the ids of a group's entries
    made_on_host = hashlib.sha256()  # what the host part hands the programs, in order
    fallen: list[tuple[str, _trace.Fallback]] = []
    for group in todo.groups:
        host, consts, sliced, positions, slices, fallback = [], [], [], [], [], []
        for pos, entry in enumerate(group.entries):
            j = index[id(entry)]
            out = prog.outputs[j]
            if isinstance(out, Lit) or isinstance(traced.host.get(out), _host.HostKey):
                value = out.value if isinstance(out, Lit) else traced.host[out].data
                # in the variable's own dtype: a Python int literal is not an int64
                value = np.asarray(value, dtype=entry.spec.dtype)
                made_on_host.update(f"{entry.path}:{value.dtype}{value.shape}".encode())
                made_on_host.update(value.tobytes())
                host.append((pos, np.broadcast_to(value, entry.spec.shape)))
                continue
            if out in prog.consts:
                consts.append((pos, prog.consts[out]))
                continue
            s = _trace.cut(traced, out, memo)
            assert s is not None  # None only for literals and constants, handled above
            if isinstance(s, _trace.Fallback):
                fallback.append((pos, j))
                fallen.append((entry.path, s))
                continue
            signature = (
                s.digest,
                entry.spec.shape,
                entry.spec.dtype,
                tuple(entry.sharding.spec),
                entry.sharding.memory_kind,  # where it is made: part of the program
            )
            sliced.append(dataclasses.replace(entry, signature=signature))
            positions.append(pos)
            slices.append(s)
        works[_ids(group)] = _Work(
            tuple(host),
            tuple(consts),
            MeshGroup(group.mesh, tuple(sliced)),
            tuple(positions),
            tuple(slices),
            tuple(fallback),
        )
    _progress.fell_back(what, fallen)
    if jax.process_count() > 1:  # every process makes its own shards: from the same values
        _agree.checkpoint(what, "inputs", _facts(plan, given, traced, made_on_host))
    maker = _Constructor(traced, works, LRUCache(max(1, len(plan.groups))))
    return run_plan(plan, maker, given=given, what=what, progress=progress)


def _facts(plan: Plan, given: Mapping[int, Any], traced: Traced, hosted: Any) -> dict[str, str]:
    """What every process must have alike, as each makes its own shards: another seed
    (``nnx.Rngs``), plan or ``existing=`` on one process would make replicas differ.
    Keys and host-made values count by their bytes; example inputs do not (a process's
    own batch may differ; an init that reads its values is not compared), nor the
    programs (their digests hold objects that differ between processes)."""
    keys = hashlib.sha256()
    for n in sorted(k for k, v in traced.host.items() if isinstance(v, _host.HostKey)):
        keys.update(np.ascontiguousarray(traced.host[n].data).tobytes())
    return {
        "the variables": _agree.digest(
            [(e.path, e.spec.shape, str(e.spec.dtype), e.sharding) for e in plan.entries]
        ),
        "existing": _agree.digest(sorted(e.path for e in plan.entries if id(e) in given)),
        "the constructor's keys": f"sha256 {keys.hexdigest()[:16]}",
        "the values its host part made": f"sha256 {hosted.hexdigest()[:16]}",
    }


class _Constructor:
    """The engine's group maker (:class:`meshinit._run.maker.GroupMaker`).

    A group's host values and captured constants are placed; its slices are made in
    the spec path's rounds: signatures (slice digest, shape, dtype, PartitionSpec)
    with equally many entries share one executable, and call ``r`` makes the
    ``r``-th entry of each; its fallback variables come from the whole-constructor
    program, cached in ``local`` (this call's only).
    """

    def __init__(self, traced: Traced, works: dict[tuple[int, ...], _Work], local: LRUCache):
        self.traced, self.works, self.local = traced, works, local

    def builds(self, group: MeshGroup) -> list[tuple[Hashable, _compile.Build]]:
        w = self.works[_ids(group)]
        return [(self._key(w, b), self._build(w, b)) for b in w.buckets]

    def work(self, group: MeshGroup) -> Needs:
        w = self.works[_ids(group)]
        needs = [(self._key(w, b), len(w.group.batches[b[0]])) for b in w.buckets]
        return [*needs, (None, 1)] if w.fallback else needs

    def prepare(self, group: MeshGroup) -> Runner:
        w = self.works[_ids(group)]
        exes = [_compile.compiled(key, w.group, build) for key, build in self.builds(group)]
        fallback_exe = _fallback_exe(self.traced, group, w, self.local) if w.fallback else None

        def run() -> Iterator[tuple[int, jax.Array]]:
            for pos, value in w.host:
                yield pos, place(value, group.entries[pos].sharding)
            for pos, value in w.consts:
                yield pos, place(value, group.entries[pos].sharding)
            for k, array in self._sliced(w, exes):
                yield w.positions[k], array
            if fallback_exe is not None:
                args = self.traced.args
                for (pos, _), array in zip(w.fallback, fallback_exe(*args), strict=True):
                    yield pos, array

        return run

    def _sliced(self, w: _Work, exes: list[Any]) -> Iterator[tuple[int, jax.Array]]:
        """The sliced entries, as ``(position in w.group.entries, array)``."""
        batches = w.group.batches
        for bucket, exe in zip(w.buckets, exes, strict=True):
            rounds = [[batches[i][r] for i in bucket] for r in range(len(batches[bucket[0]]))]
            buffers = self._host_buffers(w, bucket, rounds)
            for r, ks in enumerate(rounds):
                args = [  # float host values; large captured constants, placed
                    _input_value(self.traced, n, sh)  # one call at a time
                    for k in ks
                    for n, sh in self._inputs(w, k)
                    if not _packed(self.traced, n)
                ]
                inputs = [*(b[r] for b in buffers), *args]
                outs = _strategies.call(exe, inputs, w.group, ks)
                yield from zip(ks, outs, strict=True)

    @staticmethod
    def _entries(w: _Work, bucket: tuple[int, ...]) -> list[int]:
        """The first sliced entry of each signature of ``bucket``."""
        return [w.group.batches[i][0] for i in bucket]

    def _shardings(self, w: _Work, k: int) -> list[NamedSharding | None]:
        s, entry = w.slices[k], w.group.entries[k]
        return [_const_sharding(self.traced, n, entry) for n in s.inputs]

    def _inputs(self, w: _Work, k: int) -> list[tuple[int, NamedSharding | None]]:
        """Each input of entry ``k``'s slice, with how it enters (:meth:`_shardings`)."""
        return list(zip(w.slices[k].inputs, self._shardings(w, k), strict=True))

    def _key(self, w: _Work, bucket: tuple[int, ...]) -> Hashable:
        signatures = []
        for k in self._entries(w, bucket):
            shardings = tuple(None if s is None else s.spec for s in self._shardings(w, k))
            signatures.append((w.group.entries[k].signature, shardings))
        return ("constructor", w.group.mesh, tuple(signatures), w.on_cpu, self.traced.explicit)

    def _layout(self, w: _Work, bucket: tuple[int, ...]) -> tuple[list[np.dtype], list[list[Any]]]:
        """How one call's inputs travel: integer host values (keys, counters, token ids)
        packed into one flat buffer per dtype (a launch with 7 signatures then takes 2
        arguments, not 40); float host values (example inputs, small captured
        constants) and captured constants as arguments of their own (:func:`_packed`).

        Returns:
          The buffers' dtypes, and per signature of the bucket, per input of its slice,
          ``("host", dtype, start, shape)``, ``("own", position)`` (a host value in its
          own shape) or ``("arg", position)`` (a captured constant, already placed).
        """
        sizes: dict[np.dtype, int] = {}
        layout, args = [], 0
        for k in self._entries(w, bucket):
            items: list[Any] = []
            for n in w.slices[k].inputs:
                struct = _input_struct(self.traced, n, None)
                if _packed(self.traced, n):
                    dtype = np.dtype(struct.dtype)
                    start = sizes.get(dtype, 0)
                    sizes[dtype] = start + math.prod(struct.shape)
                    items.append(("host", dtype, start, tuple(struct.shape)))
                else:
                    items.append(("own" if n in self.traced.host else "arg", args))
                    args += 1
            layout.append(items)
        return sorted(sizes, key=str), layout

    def _build(self, w: _Work, bucket: tuple[int, ...]) -> _compile.Build:
        firsts = self._entries(w, bucket)

        def build():
            dtypes, layout = self._layout(w, bucket)
            fns, structs = [], []
            totals = dict.fromkeys(dtypes, 0)
            for k, items in zip(firsts, layout, strict=True):
                s = w.slices[k]
                straight = w.on_cpu and not s.has_control_flow
                impl = _threefry.PROGRAM_KEY_IMPL if straight else _threefry.SHARDING_INVARIANT_IMPL
                sharding = w.group.entries[k].sharding
                fns.append(_evaluator(self.traced, s, impl, straight, w.group.mesh, sharding))
                for item, n, sh in zip(items, s.inputs, self._shardings(w, k), strict=True):
                    if item[0] == "host":
                        totals[item[1]] = max(totals[item[1]], item[2] + math.prod(item[3]))
                    else:
                        structs.append(_input_struct(self.traced, n, sh))
            buffers = [jax.ShapeDtypeStruct((totals[d],), d) for d in dtypes]

            def program(*values):
                packed = dict(zip(dtypes, values[: len(dtypes)], strict=True))
                rest = values[len(dtypes) :]
                outs = []
                for fn, items in zip(fns, layout, strict=True):
                    ins = []
                    for item in items:
                        if item[0] == "host":
                            _, dtype, start, shape = item
                            flat = packed[dtype][start : start + math.prod(shape)]
                            # Replicated, as it arrived: else the partitioner may shard
                            # the buffer and move pieces between devices to cut it.
                            ins.append(_replicated(flat.reshape(shape), w.group.mesh))
                        elif item[0] == "own":
                            ins.append(_replicated(rest[item[1]], w.group.mesh))
                        else:
                            ins.append(rest[item[1]])
                    outs.append(fn(*ins))
                return outs

            return program, [w.group.entries[k].sharding for k in firsts], [*buffers, *structs]

        return build

    def _host_buffers(
        self, w: _Work, bucket: tuple[int, ...], rounds: list[list[int]]
    ) -> list[np.ndarray]:
        """Every call's packed host inputs at once: per dtype of :meth:`_layout`, one
        row per call (a call's inputs all have the same layout)."""
        dtypes, _ = self._layout(w, bucket)
        parts: dict[np.dtype, list[np.ndarray]] = {d: [] for d in dtypes}
        for ks in rounds:
            for k in ks:
                for n in w.slices[k].inputs:
                    if _packed(self.traced, n):
                        value = _input_value(self.traced, n, None)
                        parts[np.dtype(value.dtype)].append(np.ravel(value))
        flat = [np.concatenate(parts[d]) for d in dtypes]
        return [f.reshape(len(rounds), f.size // len(rounds)) for f in flat]


def _packed(traced: Traced, n: int) -> bool:
    """Whether host value ``n`` travels in its dtype's flat buffer: integers and keys,
    whose arithmetic is exact in any order. A float goes in its own shape, as
    ``jax.jit`` has an argument: XLA simplifies a reduction over a slice of the flat
    buffer, reshaped, into one reduction over the flat elements, whose order rounds
    otherwise (a linen parameter scaled by its example input's mean was off
    ``jax.jit(module.init)`` in every element near a cancellation)."""
    if n not in traced.host:
        return False
    dtype = traced.program.avals[n].dtype
    return bool(
        jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
        or jax.dtypes.issubdtype(dtype, np.integer)
        or jax.dtypes.issubdtype(dtype, np.bool_)
    )


def _replicated(x: Any, mesh: Any) -> Any:
    if mesh.size == 1:
        return x
    twin = NamedSharding(_compile.auto_twin(mesh), jax.sharding.PartitionSpec())
    return jax.lax.with_sharding_constraint(x, twin)


def _fallback_exe(traced: Traced, group: MeshGroup, work: _Work, cache: LRUCache) -> Any:
    """Today's whole-constructor program, returning just the fallback variables."""
    prog = traced.program
    outs = [prog.outputs[j] for _, j in work.fallback]
    order = _trace.nodes_read(prog, outs)
    entries = [group.entries[pos] for pos, _ in work.fallback]
    mesh = cast(Mesh, group.mesh)  # materialize refuses abstract meshes first
    bind = _jaxpr.bind_rehomed if _rehomes(traced, mesh) else None

    def build():
        def program(*args):
            env = dict(zip(prog.inputs, args, strict=True))
            env.update(prog.consts)
            _jaxpr.run_nodes(prog, order, env, bind)
            return [o.value if isinstance(o, Lit) else env[o] for o in outs]

        structs = [jax.ShapeDtypeStruct(np.shape(a), np.result_type(a)) for a in traced.args]
        return program, [e.sharding for e in entries], structs

    return _compile.compiled(("constructor_fallback", id(work)), group, build, cache)
