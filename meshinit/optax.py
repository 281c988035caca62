"""optax adapter: optimizer state made directly with its parameters' exact shardings.

``init(tx, params)`` builds ``tx.init(params)`` without ever gathering a parameter or
a state leaf onto one device, for parameters on one mesh or on several, disjoint ones
included. Every state leaf that *mirrors* a parameter (Adam's ``mu`` and ``nu``,
momentum, a copy of the parameters) gets exactly that parameter's sharding; the rest
(step counts, scalars) are replicated on one mesh, ``scalars_on``.

A leaf mirrors a parameter when its dot-joined path ends with the parameter's path
and their shapes match; the longest such path wins. So ``mu.layers.0.w`` mirrors
``layers.0.w``, and ``inner_states.a.inner_state.0.nu.w`` mirrors ``w``. Failing a
whole-path match, the parameter of that shape sharing the most trailing path
components wins (the first in tree order on ties): lookahead's ``fast_state.0.mu.w``
mirrors ``fast.w``.

One computation per mesh group of parameters makes the leaves on that group's mesh.
It takes only that group's arrays as inputs, and stands zeros in for the other
groups' parameters inside the traced function, so no computation mixes meshes.
Executables are cached per computation and parameter structure: a second ``init``
with the same shapes, dtypes and shardings, and a ``tx`` that computes the same
(the same one, or a fresh ``optax.adamw(1e-3)``), compiles nothing. What ``tx.init``
computes is told as the spec path tells it for initializers
(:mod:`meshinit._spec.fingerprints`): by its code and closure, dicts and small arrays by their
contents, your own functions with the module globals they read. A ``tx.init`` whose
closure has no such fingerprint (an object hashed by identity, a deep chain) is told
by its traced computation instead (:func:`meshinit._jax.jaxpr.slice_fingerprint`), and one
that neither describes is compiled afresh on every call. So a ``tx.init`` that reads a
dict changed since the last call never gets the last call's state.

Importing meshinit does not import optax; this module loads on first use of
``meshinit.optax``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, cast

try:
    import optax as _optax
except ImportError as e:  # pragma: no cover - exercised only without optax
    raise ImportError("meshinit.optax needs optax: pip install 'meshinit[optax]'") from e

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from . import _paths
from ._errors import PlanError, Problem
from ._format import describe_mesh
from ._jax import jaxpr as _jaxpr
from ._plan import state as _state
from ._plan.entries import MeshGroup, PlanEntry
from ._plan.plan import Plan
from ._run import agree as _agree
from ._run import compile as _compile
from ._run import progress as _progress
from ._run.loop import run_plan
from ._spec import fingerprints as _signature
from ._spec.spec import ParamSpec

__all__ = ["abstract", "init"]


def _flat_params(params: Any) -> tuple[list[str], list[Any], Any]:
    """Paths, leaves and treedef of ``params``; every leaf must carry a NamedSharding."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [_paths.path_str(p) for p, _ in flat]
    leaves = [leaf for _, leaf in flat]
    bad = [
        f"{path or '<root>'}: {type(leaf).__name__} with sharding "
        f"{getattr(leaf, 'sharding', None)!r}"
        for path, leaf in zip(paths, leaves, strict=True)
        if not isinstance(getattr(leaf, "sharding", None), NamedSharding)
    ]
    if bad:
        raise TypeError(
            "meshinit.optax needs every parameter placed with a NamedSharding (a mesh); "
            "place them with meshinit.materialize or jax.device_put first:\n  " + "\n  ".join(bad)
        )
    if not leaves:
        raise PlanError(
            [Problem("", "params has no array leaves: there is no mesh to put the state on")],
            header="meshinit.optax needs placed parameters; pass the tree of arrays:",
        )
    return paths, leaves, treedef


def _abstract_params(tree: Any) -> Any:
    if isinstance(tree, Plan):
        tree = tree.abstract()
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


def _check_tx(tx: Any, what: str) -> None:
    if not callable(getattr(tx, "init", None)):
        raise TypeError(
            f"meshinit.optax.{what} takes an optax GradientTransformation as tx, such as "
            f"optax.adam(1e-3), got {type(tx).__name__} {tx!r:.60}"
        )


def abstract(
    tx: Any,
    params: Any,
    *,
    scalars_on: Mesh | None = None,
    shard_over: str | tuple[str, ...] | None = None,
    memory_kind: str | None = None,
) -> Any:
    """The state :func:`init` would make, as ``jax.ShapeDtypeStruct``s; allocates nothing.

    Each struct carries the sharding :func:`init` gives that leaf, so the result is an
    Orbax restore target for the optimizer state.

    Args:
      tx: an ``optax.GradientTransformation``.
      params: a :class:`meshinit.Plan` (its :meth:`~meshinit.Plan.abstract` tree is
        used), or a tree of ``jax.ShapeDtypeStruct``s with shardings, or of placed
        arrays.
      scalars_on: the mesh for leaves that mirror no parameter, as in :func:`init`.
      shard_over: mesh axes to shard the mirroring leaves further over, as in
        :func:`init`.
      memory_kind: the memory of the mirroring leaves, as in :func:`init`.

    Returns:
      ``tx.init``'s state tree with a ``jax.ShapeDtypeStruct(shape, dtype,
      sharding=...)`` for each leaf: exactly the shardings :func:`init` gives.

    Raises:
      TypeError: a parameter has no ``NamedSharding``.
      PlanError: as for :func:`init`.

    Examples:
      >>> target = meshinit.optax.abstract(optax.adamw(1e-3), meshinit.plan(specs))
      >>> opt_state = checkpointer.restore(path, target)  # doctest: +SKIP

      (The restore needs a checkpoint on disk: not run in the tests.)
    """
    _check_tx(tx, "abstract")
    params = _abstract_params(params)
    paths, leaves, _ = _flat_params(params)
    axes = _state.shard_over_axes(shard_over)
    _state.check_placement(leaves, axes, memory_kind)
    state = jax.eval_shape(tx.init, params)
    shardings, _ = _state.assign(paths, leaves, state, scalars_on, axes, memory_kind)
    flat, treedef = jax.tree_util.tree_flatten(state)
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(flat, shardings, strict=True)
        ],
    )


def _trace_init(tx: Any, params_def: Any, specs: list[Any]) -> tuple[Any, Any]:
    """``tx.init`` traced on abstract parameters: its closed jaxpr and abstract state."""
    return jax.make_jaxpr(
        lambda *xs: tx.init(jax.tree_util.tree_unflatten(params_def, xs)), return_shape=True
    )(*specs)


def _structure_key(
    treedef: Any, leaves: list[Any], scalars_on: Mesh, placement: tuple[Any, ...]
) -> Hashable:
    return (
        treedef,
        tuple((x.shape, x.dtype, x.sharding) for x in leaves),
        scalars_on,
        placement,
    )


def _reads(traced: tuple[Any, Any]) -> tuple[Any, list[frozenset[int]]]:
    """The abstract state, and for each of its leaves the parameters its value reads.

    Read off ``tx.init``'s jaxpr (from :func:`_trace_init`): an equation's outputs
    read everything its inputs read, so the answer may say too much, never too
    little. Calls (``jit``, ``custom_jvp``) are followed inside, so a jitted helper
    over the whole tree does not make every leaf read every parameter.
    """
    closed, state = traced
    return state, _jaxpr.reads(closed)


def _layout(
    tx: Any,
    params_def: Any,
    paths: list[str],
    leaves: list[Any],
    scalars_on: Mesh | None,
    shard_over: tuple[str, ...],
    memory_kind: str | None,
    traced: tuple[Any, Any] | None = None,
) -> tuple[Plan, tuple[tuple[int, ...], ...]]:
    """The state's plan, one mesh group per mesh that holds state leaves, and for each
    group the positions of the parameters its step reads.

    ``traced`` is :func:`_trace_init`'s result, if the caller has traced already.
    Allocates and compiles nothing.
    """
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    if traced is None:
        traced = _trace_init(tx, params_def, specs)
    state, reads = _reads(traced)
    shardings, _ = _state.assign(paths, leaves, state, scalars_on, shard_over, memory_kind)
    flat, state_def = jax.tree_util.tree_flatten_with_path(state)
    state_paths = [_paths.path_str(p) for p, _ in flat]
    # A leaf is made on its own mesh, from that mesh's parameters only; one that reads
    # a parameter on another mesh would see the zeros standing in for it.
    problems = [
        Problem(
            state_paths[j],
            f"placed on {describe_mesh(s.mesh)} but reads "
            + ", ".join(
                paths[i] or "<root>" for i in sorted(reads[j]) if leaves[i].sharding.mesh != s.mesh
            ),
        )
        for j, s in enumerate(shardings)
        if any(leaves[i].sharding.mesh != s.mesh for i in reads[j])
    ]
    if problems:
        raise PlanError(
            problems,
            header="meshinit.optax cannot make these state leaves: each is made on one mesh "
            "from that mesh's parameters, and these read parameters on another mesh. "
            "Place the parameters they combine on one mesh, or pass scalars_on= the "
            "mesh they live on:",
        )
    entries = [
        _entry(path, x, s, j)
        for j, (path, (_, x), s) in enumerate(zip(state_paths, flat, shardings, strict=True))
    ]
    meshes: list[Mesh] = []
    for m in [x.sharding.mesh for x in leaves] + [s.mesh for s in shardings]:
        if m not in meshes:
            meshes.append(m)
    groups, inputs = [], []
    for mesh in meshes:
        on_it = tuple(e for e in entries if e.mesh == mesh)
        if on_it:
            groups.append(MeshGroup(mesh, on_it))
            inputs.append(tuple(i for i, x in enumerate(leaves) if x.sharding.mesh == mesh))
    plan = Plan(tuple(entries), tuple(groups), state_def, tuple(x for _, x in flat))
    return plan, tuple(inputs)


def _made_by_tx_init(key: Any, shape: Any, dtype: Any) -> Any:
    raise TypeError("an optimizer state leaf is made by tx.init, not by an initializer")


def _entry(path: str, leaf: Any, sharding: NamedSharding, j: int) -> PlanEntry:
    """State leaf ``j`` as a plan entry; a key (Adam's noise, say) is counted as its
    key data, which is what its bytes are."""
    shape, dtype = leaf.shape, leaf.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        data = jax.eval_shape(jax.random.key_data, leaf)
        shape, dtype = data.shape, data.dtype
    spec = ParamSpec(
        shape, _made_by_tx_init, None, sharding.mesh, None, dtype,
        memory_kind=sharding.memory_kind,
    )  # fmt: skip
    return PlanEntry(path, spec, sharding, ("optax state", shape, dtype, sharding), j)


class _Steps:
    """optax's group maker (:class:`meshinit._run.maker.GroupMaker`): one step per mesh
    group of state leaves, called once, taking that mesh's parameters only.

    Each step is compiled in ``prepare`` and cached under ``(key, "step", i)`` beside
    the layout (a key of None: compiled afresh every call).
    """

    def __init__(
        self,
        tx: Any,
        params_def: Any,
        leaves: list[Any],
        plan: Plan,
        inputs: tuple[tuple[int, ...], ...],
        key: Hashable | None,
    ):
        self.tx, self.params_def, self.leaves, self.key = tx, params_def, leaves, key
        self.inputs = inputs
        self.index = {id(g): i for i, g in enumerate(plan.groups)}
        self.outputs = [[e.leaf_index for e in g.entries] for g in plan.groups]

    def _key(self, group: MeshGroup) -> Hashable | None:
        return None if self.key is None else (self.key, "step", self.index[id(group)])

    def builds(self, group: MeshGroup) -> list[tuple[Hashable, Any]]:
        return []  # compiled one at a time in prepare, each error noted as optax notes it

    def work(self, group: MeshGroup) -> list[tuple[Hashable | None, int]]:
        return [(self._key(group), 1)]

    def prepare(self, group: MeshGroup) -> Any:
        i = self.index[id(group)]
        inputs, outputs = self.inputs[i], self.outputs[i]
        key = self._key(group)
        exe = _compile.cached(key)
        if exe is None:
            exe = self._compile(group, inputs, outputs)
            _compile.store(key, exe)
        else:
            _progress.cache_hit(_compile.full_key(key))
        mesh = group.mesh
        args = [self.leaves[k] for k in inputs]

        def run() -> Any:
            try:
                out = exe(*args)
            except Exception as e:
                e.add_note(f"meshinit.optax: while making the state leaves on the mesh {mesh}")
                raise
            yield from enumerate(out)

        return run

    def _compile(self, group: MeshGroup, inputs: tuple[int, ...], outputs: list[int]) -> Any:
        tx, params_def = self.tx, self.params_def
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.leaves]

        def program(*real):
            # This mesh's real arrays, and zeros for the other meshes' parameters:
            # none of this mesh's leaves reads them (checked in _layout), so XLA drops them.
            given = dict(zip(inputs, real, strict=True))
            full = [
                given[i] if i in given else jnp.zeros(x.shape, x.dtype) for i, x in enumerate(specs)
            ]
            out = jax.tree_util.tree_leaves(tx.init(jax.tree_util.tree_unflatten(params_def, full)))
            return [out[j] for j in outputs]

        args = [
            jax.ShapeDtypeStruct(
                self.leaves[i].shape, self.leaves[i].dtype, sharding=_auto(self.leaves[i].sharding)
            )
            for i in inputs
        ]
        making = f"the optimizer state of {len(outputs)} leaves"
        mesh = cast(Mesh, group.mesh)
        out_shardings = [e.sharding for e in group.entries]
        key = None if self.key is None else _compile.full_key(self._key(group))
        return _compile.compile_now(mesh, program, out_shardings, args, making=making, key=key)


def _auto(sharding: NamedSharding) -> NamedSharding:
    mesh = cast(Mesh, sharding.mesh)  # the sharding of an array: a concrete mesh
    return NamedSharding(_compile.auto_twin(mesh), sharding.spec)


def init(
    tx: Any,
    params: Any,
    *,
    scalars_on: Mesh | None = None,
    shard_over: str | tuple[str, ...] | None = None,
    memory_kind: str | None = None,
) -> Any:
    """``tx.init(params)``, with each state leaf made directly on its parameter's shards.

    A state leaf that mirrors a parameter (its dot-joined path ends with the
    parameter's path and the shapes match, the longest match winning; failing that,
    the parameter of that shape sharing the most trailing path components) gets
    exactly that parameter's sharding. Every other leaf is replicated on
    ``scalars_on``. One computation per mesh makes that mesh's leaves from that
    mesh's parameters only, so no device ever holds a full copy of a sharded leaf,
    and parameters on disjoint meshes work. Values equal ``tx.init(params)`` computed on one device.

    Args:
      tx: an ``optax.GradientTransformation``.
      params: a tree of placed ``jax.Array``s, each with a ``NamedSharding``, on one
        mesh or several.
      scalars_on: the mesh on which leaves that mirror no parameter (step counts,
        scalars) are replicated. Default: the mesh of the first parameter in tree
        order (``jax.tree.leaves(params)[0]``).
      shard_over: a mesh axis name or a tuple of them (ZeRO-1: ``"data"``). Each
        mirroring leaf is sharded further over those axes of its parameter's mesh
        (axes a mesh lacks, has at size 1, or the parameter already uses, are
        skipped for it): they
        go onto the first dimension the parameter leaves unsharded whose size their
        product divides; failing one, they are appended to the first sharded
        dimension that stays divisible, after its own axes; failing both, the leaf
        keeps the parameter's sharding. The parameters are untouched.
      memory_kind: the memory the mirroring leaves live in (``"pinned_host"`` for
        offloaded optimizer state); None keeps each parameter's. Leaves that mirror
        no parameter stay in device memory.

    Returns:
      The optimizer state, as ``tx.init`` structures it.

    Raises:
      TypeError: a parameter is not placed with a ``NamedSharding``.
      PlanError: ``params`` has no leaves; ``shard_over`` names an axis that no mesh
        of the parameters has, or ``memory_kind`` is one a mesh's devices do not
        offer (all of them at once); a state leaf would combine parameters on
        different meshes.

    Examples:
      >>> params = meshinit.materialize(meshinit.plan(specs), 0)
      >>> opt_state = meshinit.optax.init(optax.adamw(1e-3), params)
      >>> hsdp = jax.make_mesh((2, 4), ("data", "tensor"))  # ZeRO-1 needs a data axis
      >>> params = meshinit.init(
      ...     {"w": meshinit.param((64, 256), init, axes=(None, "tensor"), mesh=hsdp)}, 0)
      >>> zero1 = meshinit.optax.init(optax.adamw(1e-3), params, shard_over="data")
      >>> params["w"].sharding.spec, zero1[0].mu["w"].sharding.spec
      (P(None, 'tensor'), P('data', 'tensor'))
    """
    # Collective under jax.distributed: a failure on one process fails every process.
    with _agree.collective("meshinit.optax.init"):
        return _init(tx, params, scalars_on, shard_over, memory_kind)


def _init(
    tx: Any,
    params: Any,
    scalars_on: Mesh | None,
    shard_over: str | tuple[str, ...] | None,
    memory_kind: str | None,
) -> Any:
    _check_tx(tx, "init")
    paths, leaves, treedef = _flat_params(params)
    axes = _state.shard_over_axes(shard_over)
    _state.check_placement(leaves, axes, memory_kind)
    mesh = _state.scalars_mesh(leaves, scalars_on)
    structure = _structure_key(treedef, leaves, mesh, (axes, memory_kind))
    traced = None
    computes = _signature.value_fingerprint(tx.init)  # cheap: code and closure, by value
    if computes is not None:
        key: Hashable | None = ("closure", computes, structure)
    else:  # nothing to tell it by but what it traces to
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        traced = _trace_init(tx, treedef, specs)
        computes = _compile.computation(*traced)
        key = None if computes is None else ("traced", computes, structure)
    # (what tx.init computes, structure) -> (state treedef, ((mesh, input positions,
    # output positions, executable), ...)). Keyed by value, never by identity: a
    # transformation whose init reads state that changed since gets a new entry.
    # (what tx.init computes, structure) -> the state's plan; each group's step under
    # (key, "step", i). Keyed by value, never by identity: a transformation whose init
    # reads state that changed since gets new entries.
    layout = _compile.cached(key)
    if layout is None:
        layout = _layout(tx, treedef, paths, leaves, scalars_on, axes, memory_kind, traced)
        _compile.store(key, layout)
    plan, inputs = layout
    return run_plan(
        plan,
        _Steps(tx, treedef, leaves, plan, inputs, key),
        what="meshinit.optax.init",
        progress=False,  # optax shows no bar and logs no line of its own
        log=False,
        note=lambda n, where: f"meshinit.optax: deleted the {n} state arrays it had made",
    )


del _optax
