"""flax linen adapter: existing linen Modules, placed as their partitioning annotations say.

:func:`init` takes an ordinary linen Module whose parameters are annotated with
``nn.with_logical_partitioning`` (logical axis names, resolved with rule tables in
the linen/MaxText pair format) or ``nn.with_partitioning`` (mesh axis names), each
optionally with its own ``mesh=``. It traces ``module.init`` once, abstractly, plans
every annotated leaf to an exact ``NamedSharding``, and hands the trace to meshinit's
constructor engine (:mod:`meshinit._engine.run`), which compiles each variable's own
computation once per (mesh, computation, sharding): the values are those of
``module.init``, and no device computes what it does not own. :func:`plan` previews
it without compiling.

Paths are the dot-joined variable paths: ``params.layers_0.mlp.wi.kernel``.
"""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

try:
    import flax.linen as nn
    from flax.core import meta
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("meshinit.linen needs flax: pip install meshinit[linen]") from e

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from . import _paths
from ._adapters import common as _adapters
from ._adapters import linen_meta as _linen_meta
from ._adapters import placement as _placement
from ._adapters import placements as _placements
from ._engine import entry as _engine
from ._errors import PlanError, Problem
from ._format import describe_mesh
from ._plan import planner as _planner
from ._plan.plan import Plan
from ._run import agree as _agree

__all__ = ["init", "plan"]


_EXPLICIT_BOX = (
    "its box carries mesh={mesh}, whose axes are Explicit: linen's unbox constrains the "
    "value with jax.lax.with_sharding_constraint, which jax refuses on Explicit axes "
    "(flax's own module.init fails the same way). Fix: give the box an Auto-axes mesh "
    "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n)), or leave mesh= "
    "off the box and pass the Explicit mesh to meshinit.linen.init(mesh=... or meshes=...)"
)


def _explicit_box_problem(error: ValueError) -> Problem | None:
    """The path and fix for linen's unbox failing on a box whose own mesh is Explicit.

    linen applies a box's sharding constraint as the module reads it, to the box's own
    ``mesh=`` when it has one. meshinit leaves flax's classes alone (it traces under the
    Auto twin of the context mesh, which covers every box without a mesh of its own),
    so a box that names an Explicit mesh fails inside ``module.init``; the frames of
    that failure say which variable it was.
    """
    box = scope = name = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        here = frame.f_locals
        if frame.f_code.co_name == "unbox" and isinstance(here.get("self"), meta.Partitioned):
            box = here["self"]
        elif frame.f_code.co_name == "param" and hasattr(here.get("self"), "path_text"):
            scope, name = here["self"], here.get("name")
    if box is None or box.mesh is None or "Auto axes" not in str(error):
        return None
    parts = ["params", *(p for p in scope.path_text.split("/") if p)] if scope else []
    path = ".".join([*parts, str(name)]) if scope is not None and name is not None else ""
    return Problem(path, _EXPLICIT_BOX.format(mesh=describe_mesh(box.mesh)))


def _host_keys(key: Any) -> tuple[list[np.ndarray], Callable[[list[Any]], Any]]:
    """Host key data, and the function that rebuilds ``module.init``'s rngs from it.

    A dict of keys (``{"params": k1, "dropout": k2}``) becomes a dict again. A legacy
    uint32 key reaches ``module.init`` as a legacy key, a typed key (or an int seed, as
    ``jax.random.key(seed)``) as a typed key of its implementation.
    """
    names = list(key) if isinstance(key, Mapping) else None
    keys = [key[n] for n in names] if names is not None else [key]
    data, makers = zip(*(_traced_key(k, names, i) for i, k in enumerate(keys)), strict=True)
    data = list(data)

    def rebuild(values: list[Any]) -> Any:
        rebuilt = [make(v) for make, v in zip(makers, values, strict=True)]
        return dict(zip(names, rebuilt, strict=True)) if names is not None else rebuilt[0]

    return data, rebuild


def _traced_key(
    key: Any, names: list[Any] | None, i: int
) -> tuple[np.ndarray, Callable[[Any], Any]]:
    """:func:`_adapters.traced_key`, its error naming the entry of a dict of keys."""
    try:
        return _adapters.traced_key(key)
    except (TypeError, ValueError) as e:
        if names is None:
            raise
        raise type(e)(f"key[{names[i]!r}]: {e}") from e


def _host_inputs(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The array leaves of the example inputs, as host values, and how to put them back.

    Arrays enter each group's computation as numpy values (an array on another mesh
    must not pin the computation to it); a ``jax.ShapeDtypeStruct`` stands for zeros
    of its shape, made inside the computation. Everything else (``train=False``,
    ``method=``) stays static.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    data: list[Any] = []
    slots: list[tuple[str, Any]] = []
    for leaf in leaves:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            slots.append(("zeros", leaf))
        elif isinstance(leaf, jax.Array | np.ndarray):
            slots.append(("arg", len(data)))
            data.append(np.asarray(leaf))
        else:
            slots.append(("static", leaf))

    def rebuild(values: list[Any]) -> Any:
        out = []
        for kind, x in slots:
            if kind == "zeros":
                out.append(jax.numpy.zeros(x.shape, x.dtype))
            elif kind == "arg":
                out.append(values[x])
            else:
                out.append(x)
        return jax.tree_util.tree_unflatten(treedef, out)

    return data, rebuild


@dataclasses.dataclass(frozen=True)
class _Prepared:
    plan: Plan
    traced: Any
    outputs: list[int]
    flat: list[tuple[Any, Any]]  # (key path, box or value) of every variable, traced
    treedef: Any
    placed: dict[str, bool]  # placed by placements=: whether its box names the mesh


def _abstract(leaf: Any, aval: Any) -> Any:
    struct = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return leaf.replace_boxed(struct) if _linen_meta.is_box(leaf) else struct


def _prepare(
    module: nn.Module,
    key: Any,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    *,
    mesh: Any,
    rules: Any,
    default: Any,
    meshes: Any,
    placements: Any,
    what: str,
) -> _Prepared:
    """Traces ``module.init`` once and plans its variables; compiles and allocates nothing."""
    patterns = _adapters.parse_meshes(meshes)
    table, problems = _placements.parse(placements)
    _adapters.check_mesh("mesh", mesh)
    placement = _linen_meta.default_placement(default, mesh)
    key_data, make_rngs = _host_keys(key)
    input_data, make_inputs = _host_inputs((example_args, example_kwargs))
    n_keys = len(key_data)
    found: list[Any] = []
    notes: list[str | None] = []  # what capture_intermediates= gave (linen_meta)

    def run_init(*values: Any) -> list[Any]:
        args, kwargs = make_inputs(list(values[n_keys:]))
        try:
            variables = module.init(make_rngs(list(values[:n_keys])), *args, **kwargs)
        except ValueError as e:
            problem = _explicit_box_problem(e)
            if problem is None:
                raise
            raise PlanError([problem]) from e
        variables, note = _linen_meta.without_intermediates(variables, example_kwargs, what)
        notes.append(note)
        flat, treedef = jax.tree_util.tree_flatten_with_path(variables, is_leaf=_linen_meta.is_box)
        found.append((flat, treedef))
        leaves = [_linen_meta.value_of(leaf) for _, leaf in flat]
        return [x for x in leaves if isinstance(x, jax.Array)]

    host = [*key_data, *input_data]
    traced = _engine.trace(run_init, *host)
    if notes[0] is not None:
        warnings.warn(notes[0], stacklevel=3)
    flat, treedef = found[0]
    avals = iter(traced.out_avals)
    outputs_of: dict[str, int] = {}
    leaves: list[tuple[str, Any]] = []
    for keypath, leaf in flat:
        path = _paths.path_str(keypath)
        if isinstance(_linen_meta.value_of(leaf), jax.Array):
            leaf = _abstract(leaf, next(avals))
            outputs_of[path] = len(outputs_of)
        leaves.append((path, leaf))
    # every path matched first: a replicated placement without a mesh takes the one
    # mesh the others name
    matched = {p: table.match(p, _linen_meta.value_of(x)) if table else None for p, x in leaves}
    replicas = _placement.Replicas(matched.values())
    specs = []
    placed: dict[str, bool] = {}
    lengths: dict[str, int] = {}
    for path, leaf in leaves:
        # A meshes= match wins over every other mesh; an unannotated variable it
        # matches is replicated there (or laid out as default= says).
        override = next((m for pattern, m in patterns if pattern.fullmatch(path)), None)
        entry = matched[path]
        if entry is not None:
            spec = None  # a broken entry is said once, for itself
            if not entry.broken:
                spec = _linen_meta.placed_spec(
                    path, leaf, entry, mesh, rules, override, problems, replicas
                )
            specs.append(spec)
            if spec is not None:
                own = isinstance(leaf, meta.Partitioned) and leaf.mesh is not None
                named = entry.mesh is not None or override is not None or own
                placed[path] = named or path in replicas.given
                lengths[path] = entry.spelled
            continue
        if table.lacks(path):  # a tree without it: said once, by the tree
            specs.append(None)
            continue
        if isinstance(leaf, meta.Partitioned):
            lengths[path] = len(leaf.names)
        fallback = placement
        if override is not None:
            fallback = (override, None if placement is None else placement[1])
        specs.append(
            _linen_meta.spec_for(path, leaf, mesh, rules, fallback, problems, override=override)
        )
    # A meshes= pattern that matches no variable places nothing: likely a typo, warned.
    names = [_paths.path_str(k) for k, _ in flat]
    _adapters.warn_idle_meshes(what, patterns, names)
    problems += table.finish(what, names, "annotation")
    problems += replicas.problems(what, _placement.CONTEXT)
    plan = _planner.build_plan(
        jax.tree_util.tree_unflatten(treedef, specs), check_inits=False, problems=problems
    )
    # flax's spelling (nn.logical_to_mesh_sharding of nn.get_partition_spec): one entry
    # per name of a box (a placed variable's new box included), none for a leaf
    # without one (P()), so == holds
    plan = _adapters.respell(plan, {p: lengths.get(p, 0) for p in names})
    outputs = [outputs_of[e.path] for e in plan.entries]
    return _Prepared(plan, traced, outputs, flat, treedef, placed)


def plan(
    module: nn.Module,
    key: Any,
    *example_args: Any,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Any = None,
    default: str | Mesh | NamedSharding | None = None,
    meshes: Any = None,
    placements: Any = None,
    **example_kwargs: Any,
) -> Plan:
    """The plan :func:`init` would follow, without compiling or allocating anything.

    ``module.init`` is traced abstractly once, and every variable is resolved as
    :func:`init` resolves it. Paths are the dot-joined variable paths
    (``params.layers_0.mlp.wi.kernel``), as in :func:`init`.

    Args:
      module: as for :func:`init`.
      key: as for :func:`init`.
      *example_args: as for :func:`init`.
      mesh: as for :func:`init`; an ``AbstractMesh`` plans before hardware exists.
      rules: as for :func:`init`.
      default: as for :func:`init`.
      meshes: as for :func:`init`; its meshes may be ``AbstractMesh`` es.
      placements: as for :func:`init`; its meshes may be ``AbstractMesh`` es.
      **example_kwargs: as for :func:`init`.

    Returns:
      A :class:`meshinit.Plan`.

    Raises:
      PlanError: as for :func:`init`.

    Examples:
      >>> print(meshinit.linen.plan(model, 0, tokens, mesh=mesh, rules=rules).compact())
      a row stands for the n parameters its path pattern names; per device sums all n
      <BLANKLINE>
      mesh 0: Mesh(fsdp=2, tensor=4; Explicit; devices 0-7)
        path                      n  array        logical      PartitionSpec  per device
        params.Dense_0.kernel     1  f32[64,256]  embed,mlp    fsdp,tensor       8.0 KiB
        params.Embed_0.embedding  1  f32[256,64]  vocab,embed  tensor,fsdp       8.0 KiB
        2 params, 128.0 KiB in all, 16.0 KiB per device
      <BLANKLINE>
      total: 2 params, 128.0 KiB, 1 mesh, most on one device 16.0 KiB
    """
    return _prepare(
        module,
        key,
        example_args,
        example_kwargs,
        mesh=mesh,
        rules=rules,
        default=default,
        meshes=meshes,
        placements=placements,
        what="meshinit.linen.plan",
    ).plan


def init(
    module: nn.Module,
    key: Any,
    *example_args: Any,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Any = None,
    default: str | Mesh | NamedSharding | None = None,
    meshes: Any = None,
    placements: Any = None,
    existing: Any = None,
    **example_kwargs: Any,
) -> Any:
    """Runs ``module.init(key, *example_args, **example_kwargs)`` with every variable placed.

    Each variable annotated with ``nn.with_logical_partitioning`` or
    ``nn.with_partitioning`` (or placed by a ``placements`` table kept outside the
    model) comes back on exactly the ``NamedSharding`` its annotation describes: on
    the first ``meshes`` mesh whose regex full-matches its path, else on the
    annotation's own ``mesh=``, else on ``mesh``, else on the ``jax.set_mesh`` context
    mesh. Logical names resolve with the annotation's own
    ``rules=``, else ``rules``, else the rules of an active ``nn.logical_axis_rules``,
    by linen's algorithm (see :func:`meshinit.logical_to_mesh_axes`), strictly: a
    logical name without a rule is an error, not silently replicated. Values are
    those of ``module.init``: integers and keys bit for bit as run eagerly, each
    float element as ``jax.jit(module.init)`` gives it or within 8·eps·S of eager's
    (S: the magnitudes of its terms; docs/concepts.md, "Unchanged constructors").

    ``module.init`` is traced once, abstractly (nothing allocated), and compiled by
    meshinit's constructor engine: keys and small values are computed once on the
    host, and each large variable's own computation is compiled once per (mesh,
    computation, sharding), so compile time does not grow with depth, and no device
    computes what it does not own.

    Args:
      module: a linen Module.
      key: what ``module.init`` takes as rngs: a legacy key (``jax.random.PRNGKey``),
        a typed key, or a dict of them (``{"params": k1, "dropout": k2}``); an int
        seed means ``jax.random.key(seed)``. Keys must be threefry. An object that
        holds a key (a pytree whose only leaf is the key, or one with
        ``__jax_array__``: kauldron's ``kd.random.PRNGKey``, as in
        ``RngStreams.init_rngs()``) stands for the key it holds.
      *example_args: the example inputs of ``module.init``. Arrays enter as host
        values (so they must be fully addressable); a ``jax.ShapeDtypeStruct``
        stands for zeros of its shape and allocates nothing outside the trace;
        other values stay static.
      mesh: the mesh of annotations and placements that name none.
      rules: ``(logical_name, mesh_axes)`` pairs, as in flax linen and MaxText, for
        ``nn.with_logical_partitioning`` annotations that carry no rules.
      default: where variables without an annotation go. None (the default) makes
        each of them an error. ``"replicated"`` replicates them on ``mesh`` (else
        the context mesh, else the default device); a ``Mesh`` replicates them on
        that mesh; a ``NamedSharding`` places each on its mesh with its spec.
      meshes: ordered ``(regex, mesh)`` pairs over the dot-joined variable paths
        (``params.layer_0.up.kernel``); the first full match puts the variable on
        that mesh, overriding its annotation's mesh, ``mesh`` and the context mesh:
        how an existing model is split into pipeline stages unchanged. A pattern that
        matches no variable path is warned about (:class:`meshinit.UnusedPatternWarning`).
      placements: the sharding kept outside the model: ordered ``(regex, axes)``,
        ``(regex, axes, mesh)`` or ``(regex, axes, mesh, memory_kind)``, as
        :func:`meshinit.eqx.init` takes them. The first regex that full-matches a
        variable's path (``params.layers_0.up.kernel``) places it, overriding its
        annotation (and ``default``); its box then says what was placed: an
        ``nn.LogicallyPartitioned`` with the logical names where they resolved through
        rules, else an ``nn.Partitioned`` with the mesh axes, naming the mesh where the
        placement, ``meshes`` or the annotation named one. ``axes``: None
        (replicated), a ``jax.sharding.PartitionSpec`` (mesh axes, padded with None to
        the rank), or one entry per dimension: logical names where rules are in effect
        (``rules``, or an active ``nn.logical_axis_rules``), else mesh axes. The mesh is
        a ``meshes`` match, else the placement's, else ``mesh``, else the context mesh
        (``meshinit.defaults(mesh=...)``, then ``jax.set_mesh``), else the box's own;
        a placement that replicates (None, ``P()``) and finds none takes the one mesh
        the other placements name, and with none or several is a ``PlanError``.
        An entry that matches no variable is warned about
        (:class:`meshinit.UnusedPatternWarning`). ``meshinit.searched(rules)`` is a
        table matched by ``re.search`` on ``/``-joined paths (EasyDeL's rules,
        unchanged). ``placements`` may also be a tree of the variables' structure
        holding a ``PartitionSpec``, a ``NamedSharding`` (its mesh and memory kind
        too) or None (replicated) per variable, as ``nn.get_partition_spec`` of
        ``jax.eval_shape(module.init, ...)`` gives (the whole variables dict, with its
        ``params`` level): every variable must have a leaf, and every leaf a variable.
        Or a rule: ``placements(path, shape_dtype)``, called once per variable with
        its dot-joined path and ``jax.ShapeDtypeStruct``, returning a
        ``NamedSharding``, a ``PartitionSpec``, a tuple of axes or None. Every form is
        checked as a table is.
      existing: the values of some variables, made elsewhere: their plan paths
        (``params.up.kernel``) to arrays, flat or as a nested variables dict (boxes
        are unboxed). Each is placed on its planned sharding (resharded if it is on
        another mesh, shard by shard if it is numpy); nothing is compiled or run for
        them, and every other variable gets exactly the value a full init gives. A
        big-endian numpy array is placed with its values; a path given twice (flat
        and nested) is an error.
      **example_kwargs: keyword arguments of ``module.init`` (``train=False``,
        ``method=...``, ``mutable=...``). With ``capture_intermediates=``, flax
        returns the forward pass's activations as an ``'intermediates'`` collection;
        meshinit leaves it out (computes and returns none of it), as flax's default
        ``mutable=DenyList('intermediates')`` would, and warns with their count: made
        as variables, each activation is one more program output that recomputes
        the forward pass up to it (kauldron's ``TrainStep`` passes
        ``capture_intermediates=True`` and then drops the collection). A ``mutable=``
        that names it (``True``, or a list with ``'intermediates'``) keeps it, with a
        warning of the count; being unannotated, they then need ``default=``.

    Returns:
      The variables ``module.init`` returns, in the same structure (less an
      ``'intermediates'`` collection ``mutable=`` does not name): annotated
      variables stay in their ``nn.Partitioned`` / ``nn.LogicallyPartitioned`` boxes,
      with a placed ``jax.Array`` inside. Unbox with ``nn.unbox(variables)`` (or
      ``flax.core.meta.unbox``) before ``module.apply`` if your code does not.

    Raises:
      PlanError: all problems at once, each naming its variable path: variables
        without an annotation (when no ``default``), names that are not mesh axes or
        have no rule, dimensions that do not divide, a missing mesh or rules, a
        malformed ``meshes``, an ``existing`` path that names no variable or is given
        twice, or whose value is no array (PRNG keys, a ``ShapeDtypeStruct``) or
        differs in shape or dtype.
      TypeError, ValueError: a malformed ``default``, or a key that is not a single
        threefry key (or a dict of them).

    Examples:
      >>> mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
      >>> rules = (("embed", "fsdp"), ("mlp", "tensor"))
      >>> dense = nn.Dense(64, kernel_init=nn.with_logical_partitioning(
      ...     nn.initializers.lecun_normal(), ("embed", "mlp")), use_bias=False)
      >>> variables = meshinit.linen.init(dense, jax.random.PRNGKey(0),
      ...     jnp.ones((1, 16)), mesh=mesh, rules=rules)
      >>> variables["params"]["kernel"].value.sharding.spec
      P('fsdp', 'tensor')
    """
    # Collective: module.init failing while traced on one process fails every process.
    with _agree.collective("meshinit.linen.init"), _engine.paused_gc():
        prep = _prepare(
            module,
            key,
            example_args,
            example_kwargs,
            mesh=mesh,
            rules=rules,
            default=default,
            meshes=meshes,
            placements=placements,
            what="meshinit.linen.init",
        )
        placed = jax.tree_util.tree_leaves(
            _engine.make_arrays(
                prep.plan,
                prep.traced,
                prep.outputs,
                what="meshinit.linen.init",
                existing=_adapters.flat_existing(existing, _linen_meta.value_of),
            )
        )
    entries = {e.path: e for e in prep.plan.entries} if prep.placed else {}
    boxes = []
    for (keypath, leaf), array in zip(prep.flat, placed, strict=True):
        path = _paths.path_str(keypath) if prep.placed else ""
        if path in prep.placed:  # its box says what was placed
            e = entries[path]
            boxes.append(_linen_meta.placed_box(leaf, array, e.spec, e.sharding, prep.placed[path]))
        else:
            boxes.append(leaf.replace_boxed(array) if _linen_meta.is_box(leaf) else array)
    return jax.tree_util.tree_unflatten(prep.treedef, boxes)
