"""flax nnx adapter: spec-declared Modules, and existing Modules placed unchanged.

Two ways in:

- :func:`materialize`: a Module whose Variables hold ``ParamSpec``s
  (``self.w = nnx.Param(meshinit.param(...))``) gets arrays in their place. The fast
  path: values follow meshinit's value contract, compiled once per signature.
- :func:`init`: an ordinary Module whose Variables carry flax sharding metadata
  (``out_sharding``, or the older ``sharding``/``sharding_names``, with ``mesh`` and
  ``sharding_rules``) comes back with exactly the shardings that metadata describes,
  and the values its own ``nnx.Rngs`` produce. This compiles the whole constructor
  once per mesh group, so it is no faster to compile than ``nnx.jit``.

And for training, :func:`optimizer`: an ordinary ``nnx.Optimizer`` whose state is
placed exactly like the params it mirrors, by ``meshinit.optax.init``.

Paths are nnx state paths, dot-joined (``layers.0.w``), so a spec-declared Module
gets the same values as ``meshinit.init`` on a dict with the same paths.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

try:
    from flax import errors as flax_errors
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("meshinit.nnx needs flax: pip install meshinit[nnx]") from e

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from . import _materialize, _plan
from ._errors import Problem
from ._spec import ParamSpec

__all__ = ["materialize", "init", "optimizer"]


def _path(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def _nest(flat: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """``{("layers", 0, "w"): x}`` -> ``{"layers": {"0": {"w": x}}}``.

    String keys, so the core's paths are exactly the dot-joined nnx paths, and paths
    that join to the same string are reported as duplicates.
    """
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
        node[str(path[-1])] = value
    return tree


def _get(tree: dict[str, Any], path: tuple[Any, ...]) -> Any:
    for part in path:
        tree = tree[str(part)]
    return tree


def _placed_metadata(entry: _plan.PlanEntry) -> dict[str, Any]:
    """Metadata that makes flax's own tools report the placed PartitionSpec."""
    meta: dict[str, Any] = {"out_sharding": tuple(entry.sharding.spec), "mesh": entry.mesh}
    if entry.spec.rules is not None:
        meta["logical_axes"] = entry.spec.axes  # the logical names, kept for readers
    return meta


def _specs(flat: list[tuple[tuple[Any, ...], nnx.Variable]]) -> dict[tuple[Any, ...], ParamSpec]:
    """The ``ParamSpec``s that a flat state's Variables hold, by nnx path."""
    return {path: var.get_value() for path, var in flat if isinstance(var.get_value(), ParamSpec)}


def _spec_tree(module: nnx.Module) -> dict[str, Any]:
    """The specs a spec-declared Module holds, as the tree :func:`materialize` plans.

    Paths in its plan are the Module's nnx paths (``layers.0.w``).
    """
    _, state = nnx.split(module)
    return _nest(_specs(list(nnx.to_flat_state(state))))


def materialize(module: nnx.Module, key: Any) -> nnx.Module:
    """Replaces every ``ParamSpec`` held by the Module's Variables with its placed array.

    Args:
      module: an nnx Module whose Variables hold ``ParamSpec``s; other Variables (RNG
        state, arrays) pass through unchanged.
      key: an int seed, a typed key or a legacy key, as for ``meshinit.materialize``.

    Returns:
      A new Module of the same graph; ``module`` itself is left as it was. Each placed
      Variable carries ``out_sharding`` (mesh axes) and ``mesh`` metadata, so
      ``nnx.get_partition_spec(nnx.state(model))`` gives exactly the placed spec, and
      ``logical_axes`` with the spec's logical names.

    Examples:
      >>> class MLP(nnx.Module):
      ...     def __init__(self):
      ...         self.up = nnx.Param(meshinit.param((d, 4 * d), init, axes=("embed", "mlp")))
      >>> with meshinit.defaults(mesh=mesh, rules=rules):
      ...     model = meshinit.nnx.materialize(MLP(), jax.random.key(0))
    """
    graphdef, state = nnx.split(module)
    flat = list(nnx.to_flat_state(state))
    specs = _specs(flat)
    plan = _plan.plan(_nest(specs))
    arrays = _materialize.materialize(plan, key)
    entries = {e.path: e for e in plan.entries}
    placed = []
    for path, var in flat:
        if path in specs:
            entry = entries[_path(path)]
            var = var.replace(_get(arrays, path), **_placed_metadata(entry))
        placed.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def _is_key(value: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key)


def _key_impl(struct: jax.ShapeDtypeStruct) -> Any:
    """The implementation of an abstract key, read while tracing it."""
    found = []

    def read(key):
        found.append(jax.random.key_impl(key))
        return key

    jax.eval_shape(read, struct)
    return found[0]


def _default_mesh() -> Mesh:
    """The context mesh, else a mesh with no axes over the default device."""
    mesh = jax.sharding.get_mesh()
    if not mesh.empty:
        return mesh
    device = jax.config.jax_default_device or jax.devices()[0]
    return Mesh(np.array(device), ())


def _spec_for(
    var: nnx.Variable, value: Any, problems: list[Problem], path: str
) -> ParamSpec | None:
    """Translates flax's sharding metadata into a spec whose axes are mesh axes.

    flax's own ``get_var_pspec`` does the translation, so flax's semantics hold: a
    shorter sharding tuple pads with None, and names without a rule pass through as
    mesh axis names (the core then checks they are axes of the mesh).
    """
    shape, dtype = value.shape, value.dtype
    if _is_key(value):  # keys travel as their uint32 data; rewrapped after placement
        data = jax.eval_shape(jax.random.key_data, value)
        shape, dtype = data.shape, data.dtype
    meta = var.get_metadata()
    if meta.get("out_sharding"):
        mesh = meta.get("mesh") or jax.sharding.get_mesh()
        if mesh is None or (isinstance(mesh, Mesh) and mesh.empty):
            problems.append(
                Problem(
                    path,
                    "has sharding metadata but no mesh: pass mesh= to "
                    "the Variable or build it under jax.set_mesh",
                )
            )
            return None
        pspec = nnx.spmd.get_var_pspec(var)
        entries = tuple(pspec) + (None,) * (len(value.shape) - len(pspec))
        if any(e is PartitionSpec.UNCONSTRAINED for e in entries):
            problems.append(
                Problem(
                    path,
                    "UNCONSTRAINED in its sharding cannot be placed "
                    "exactly; name mesh axes or None",
                )
            )
            return None
        axes = entries + (None,) * (len(shape) - len(entries))
    else:
        mesh, axes = _default_mesh(), None
    return ParamSpec(
        shape=shape,
        init=_materialize.from_constructor,
        axes=axes,
        mesh=mesh,
        rules=None,
        dtype=dtype,
    )


@contextlib.contextmanager
def _clear_factory_errors() -> Iterator[None]:
    """Turns jax's and flax's trace errors from a misbehaving factory into one clear error."""
    try:
        yield
    except (jax.errors.UnexpectedTracerError, flax_errors.TraceContextError) as e:
        raise ValueError(f"meshinit.nnx.init: {_FACTORY_RULES} ({type(e).__name__})") from e


_FACTORY_RULES = (
    "the factory is called more than once (abstractly, then once per mesh group), so "
    "it must build its own nnx.Rngs and must not touch outside state"
)


def init(factory: Callable[[], nnx.Module]) -> nnx.Module:
    """Builds an ordinary nnx Module with every Variable placed as its metadata says.

    Every Variable with flax sharding metadata comes back on
    ``NamedSharding(variable's mesh or the context mesh, flax's partition spec)``.
    Variables without it (RNG state, unannotated arrays) are replicated on the context
    mesh, or placed on the default device when no ``jax.set_mesh`` is active. Values
    are exactly those the factory produces from its own ``nnx.Rngs``.

    Per mesh group, the factory is jitted with flax's eager sharding off and returns
    only that group's Variables, with exact out_shardings; XLA drops the rest. This
    works where flax itself fails, such as Params on disjoint submeshes under an
    active ``jax.set_mesh``, but it compiles the whole constructor once per group.
    For fast compiles, declare parameters with ``meshinit.param`` and use
    :func:`materialize`.

    Args:
      factory: a zero-argument callable returning an nnx Module. It is called more
        than once (abstractly, then once per mesh group), so it must build its own
        ``nnx.Rngs`` and must not mutate outside state.

    Returns:
      The Module, with flax's metadata kept as it was.

    Raises:
      PlanError: a sharding names an axis that is not in its mesh, a dimension does
        not divide, or a sharded Variable has no mesh; each problem names its path.
      ValueError: the factory leaks tracers or mutates state created outside it.

    Examples:
      >>> model = meshinit.nnx.init(lambda: Model(rngs=nnx.Rngs(0)))
    """
    graphdefs = []
    traced: list[nnx.Variable] = []  # held, so their ids stay unique while we compare

    def abstract_state() -> nnx.State:
        with nnx.use_eager_sharding(False):
            graphdef, state = nnx.split(factory())
        graphdefs.append(graphdef)  # static structure, no tracers in it
        traced.extend(var for _, var in nnx.to_flat_state(state))
        return state

    # jax.eval_shape, not nnx.eval_shape: flax would resolve the sharding metadata
    # itself and fail on the first bad name, where we want every problem with its path.
    with _clear_factory_errors():
        state = jax.eval_shape(abstract_state)
    (graphdef,) = graphdefs
    flat = list(nnx.to_flat_state(state))
    problems: list[Problem] = []
    specs: dict[tuple[Any, ...], ParamSpec] = {}
    for path, var in flat:
        value = var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            spec = _spec_for(var, value, problems, _path(path))
            if spec is not None:
                specs[path] = spec
    plan = _plan.build_plan(_nest(specs), check_inits=False, problems=problems)
    order = [entry.path for entry in plan.entries]

    seen = {id(var) for var in traced}

    def build() -> list[Any]:
        with nnx.use_eager_sharding(False):
            _, built = nnx.split(factory())
        flat_built = list(nnx.to_flat_state(built))
        reused = [_path(p) for p, v in flat_built if id(v) in seen]
        if reused:  # its values are tracers of the abstract pass
            raise ValueError(
                f"meshinit.nnx.init: {_FACTORY_RULES}; it returned Variables it had built "
                f"before ({', '.join(reused[:3])})"
            )
        values = {_path(p): v.get_value() for p, v in flat_built}
        out = []
        for path in order:
            v = values[path]
            out.append(jax.random.key_data(v) if _is_key(v) else v)
        return out

    with _clear_factory_errors():
        arrays = _materialize.materialize_from(plan, build)
    placed = []
    for path, var in flat:
        if path in specs:
            array = _get(arrays, path)
            value = var.get_value()
            if _is_key(value):
                array = jax.random.wrap_key_data(array, impl=_key_impl(value))
            # Traced with eager sharding off; give back what the user's flax would record.
            var = var.replace(array, eager_sharding=nnx.using_eager_sharding())
        placed.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


class _Prebuilt:
    """A transformation whose ``init`` hands back state made beforehand.

    ``nnx.Optimizer`` calls ``tx.init`` itself, eagerly, on every parameter at once;
    given this instead, it wraps the placed state in its own Variables (``OptArray``,
    ``OptVariable`` with the parameter's metadata) and computes nothing.
    """

    def __init__(self, tx: Any, state: Any):
        self.update = tx.update
        self._state = state

    def init(self, params: Any) -> Any:
        return self._state


def optimizer(model: nnx.Module, tx: Any, *, wrt: Any = nnx.Param) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=wrt)``, with its state placed exactly like the params.

    Every state leaf that mirrors a parameter (Adam's ``mu`` and ``nu``, momentum)
    gets that parameter's sharding, and the step counts (``opt.step`` and the
    transformation's own counts) are replicated on the mesh of the first ``wrt``
    Variable in nnx state order, all made by :func:`meshinit.optax.init`: one
    computation per mesh, values equal to ``tx.init`` on one device. This works for
    Params on several meshes, disjoint submeshes included, where
    ``nnx.Optimizer(model, tx, wrt=...)`` puts the counts on one default device, and
    fails with "incompatible devices" under ``nnx.jit`` or an Auto ``jax.set_mesh``.

    flax's own constructor builds the object, so it is an ordinary ``nnx.Optimizer``
    with the same Variable types, metadata and tree structure as flax's. It is handed
    a transformation whose ``init`` returns the placed state, so flax computes no
    state and re-applies no sharding; ``opt.tx`` is then set to ``tx``, and
    ``opt.step`` to the placed count. The model is read, never moved or resharded.

    One ``opt.update(model, grads)`` spans every parameter, so it runs only where
    one computation may: Auto meshes over the same devices. Params on disjoint
    meshes, or on different Explicit meshes, are trained per stage: one optimizer per
    stage's sub-Module.

    Args:
      model: an nnx Module whose ``wrt`` Variables hold arrays placed with a
        ``NamedSharding``, as :func:`init` and :func:`materialize` leave them.
      tx: an ``optax.GradientTransformation``.
      wrt: the nnx filter of the Variables to optimize, as for ``nnx.Optimizer``.

    Returns:
      An ``nnx.Optimizer`` whose ``opt_state`` and ``step`` are placed as above.

    Raises:
      TypeError: a ``wrt`` Variable is not placed with a ``NamedSharding``.
      ValueError: ``wrt`` selects no Variable, or a state leaf would combine
        parameters on different meshes.

    Examples:
      >>> model = meshinit.nnx.init(lambda: Model(rngs=nnx.Rngs(0)))
      >>> opt = meshinit.nnx.optimizer(model, optax.adamw(1e-3))
      >>> opt.opt_state[0].mu["w"].get_value().sharding == model.w.get_value().sharding
      True
    """
    from . import optax as meshinit_optax  # imports optax only when asked for

    params = nnx.state(model, wrt)
    step, state = meshinit_optax.init(_WithStep(tx), params)
    flags = [_eager_flag(v) for v in jax.tree.leaves(state, is_leaf=_is_variable)]
    # flax's to_opt_state rebuilds each mirror as an OptVariable with its Param's
    # metadata, which re-applies the sharding the array already has; under an Auto
    # jax.set_mesh over other devices that fails. Off while it builds, then restored.
    state = jax.tree.map(
        lambda v: v.replace(eager_sharding=False) if _is_variable(v) else v,
        state,
        is_leaf=_is_variable,
    )
    opt = nnx.Optimizer(model, _Prebuilt(tx, state), wrt=wrt)
    for var, flag in zip(jax.tree.leaves(opt.opt_state, is_leaf=_is_variable), flags, strict=True):
        if flag is not None:
            var.set_metadata("eager_sharding", flag)
    opt.tx = tx
    opt.step.set_value(step)
    return opt


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _eager_flag(x: Any) -> bool | None:
    return x.get_metadata("eager_sharding", None) if _is_variable(x) else None


# tx.init -> the init of (step, tx's state). It holds tx.init weakly, so meshinit.optax's
# cache, weak on the init it is given, keeps working and frees with the transformation.
_step_inits: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class _WithStep:
    """``tx`` with flax's step count in front of its state, so one call makes both."""

    def __init__(self, tx: Any):
        try:
            self.init = _step_inits[tx.init]
        except (KeyError, TypeError):
            ref = _weak_or_strong(tx.init)

            def init(params: Any) -> Any:
                return jax.numpy.zeros((), jax.numpy.uint32), ref()(params)

            self.init = init
            with contextlib.suppress(TypeError):  # not weakly referable: never cached
                _step_inits[tx.init] = init


def _weak_or_strong(fn: Any) -> Callable[[], Any]:
    if inspect.ismethod(fn):  # a fresh bound method each access: a weak ref would die now
        return lambda: fn
    try:
        return weakref.ref(fn)
    except TypeError:
        return lambda: fn
