"""Equinox adapter: place the parameters of equinox Modules exactly on their meshes.

Two ways in:

- :func:`materialize` for modules that declare their parameters as specs
  (``self.w = meshinit.param(...)`` in ``__init__``). Building such a module
  allocates nothing; the core plans and materializes it like any other pytree, so a
  module gets the same values as a dict with the same paths. This is the fast path.
- :func:`init` for existing constructors (``eqx.nn.MLP(..., key=k)``), whose values
  must stay exactly what the constructor makes. Placements pick each array leaf's
  sharding by a regex on its path; the constructor is traced once and compiled by
  meshinit's constructor engine, once per (mesh, per-array computation, sharding),
  with exact out_shardings, so no device ever holds what it does not own.
  :func:`plan` previews it without compiling.

Paths are the dot-joined pytree paths the core uses everywhere: ``layers.0.weight``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.sharding import AbstractMesh, Mesh

try:
    import equinox  # noqa: F401  (what _adapters.eqx needs, named before it is imported)
except ImportError as e:
    raise ImportError("meshinit.eqx needs equinox: pip install 'meshinit[eqx]'") from e

from ._adapters import eqx as _eqx
from ._adapters import prepared as _prepared
from ._adapters.placement import table as _table
from ._plan.planner import plan as _plan_tree
from ._run import agree as _agree
from ._run.materialize import materialize as _materialize_plan

__all__ = ["init", "materialize", "plan"]


def materialize(module: Any, key: Any) -> Any:
    """Replaces every :class:`~meshinit.ParamSpec` in ``module`` with a placed array.

    ``meshinit.materialize(meshinit.plan(module), key)``: the module is a pytree, its
    paths are its attribute names, indices and dict keys joined with dots, and the
    arrays come back in a module of the same type. The value contract holds: the
    same model declared as a dict, an nnx Module or an equinox Module gets
    bit-identical values.

    Args:
      module: an equinox Module (or any pytree) whose fields hold specs. Other
        leaves, arrays included, pass through untouched.
      key: an int seed, a typed key or a legacy uint32 key; all three give the same
        values.

    Returns:
      A module of the same type with a ready ``jax.Array`` in place of each spec,
      each with exactly its planned ``NamedSharding``.

    Raises:
      PlanError: every problem in the module's specs, each naming its path.

    Examples:
      >>> class Linear(eqx.Module):
      ...     w: jax.Array
      ...     def __init__(self, mesh):
      ...         self.w = meshinit.param((256, 1024), lecun_normal(),
      ...                                 axes=("fsdp", "tensor"), mesh=mesh)
      >>> model = meshinit.eqx.materialize(Linear(mesh), jax.random.key(0))
      >>> model.w.sharding
      NamedSharding(mesh=Mesh('fsdp': 2, 'tensor': 4, axis_types=(Explicit, Explicit)),
                    spec=P('fsdp', 'tensor'), memory_kind=device)
    """
    with _agree.collective("meshinit.eqx.materialize"):  # a plan failing on one process too
        return _materialize_plan(_plan_tree(module), key)


Placement = _table.Placement
"""``(regex, axes)``, ``(regex, axes, mesh)`` or ``(regex, axes, mesh, memory_kind)``."""


def plan(
    factory: Callable[[Any], Any],
    key: Any,
    placements: Any,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Any = None,
) -> Any:
    """The plan :func:`init` would follow, without compiling or allocating anything.

    The factory is traced abstractly once. Paths are the dot-joined pytree paths
    (``layers.0.weight``), as in :func:`init`.

    Args:
      factory: as for :func:`init`.
      key: as for :func:`init`.
      placements: as for :func:`init`
        ([Placements](../placements.md)); their meshes may be ``AbstractMesh`` es.
      mesh: as for :func:`init`; an ``AbstractMesh`` plans before hardware exists.
      rules: as for :func:`init`.

    Returns:
      A :class:`meshinit.Plan`.

    Raises:
      PlanError: as for :func:`init`.

    Examples:
      >>> p = meshinit.eqx.plan(lambda k: eqx.nn.MLP(64, 16, 256, 2, key=k), 0,
      ...                       [(r".*weight", ("tensor", None)), (r".*", None)], mesh=mesh)
    """
    return _eqx.prepare(factory, key, placements, mesh, rules, what="meshinit.eqx.plan").plan


def init(
    factory: Callable[[Any], Any],
    key: Any,
    placements: Any,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Any = None,
    existing: Any = None,
) -> Any:
    """Builds ``factory(key)`` with each array placed exactly, compiled once per mesh.

    For existing equinox constructors, which make arrays themselves. The values are
    those of ``factory(key)``: integers and keys bit for bit as run eagerly, each
    float element as ``jax.jit(factory)`` gives it or within 8·eps·S of eager's (S:
    the magnitudes of its terms; docs/concepts.md, "Unchanged constructors"); each
    array leaf is placed by the first placement whose regex matches its whole path.

    The constructor is traced once, abstractly (nothing is allocated), and compiled
    by meshinit's constructor engine: keys and small values are computed once on the
    host, and each array's own computation is compiled once per (mesh, computation,
    sharding) and run per array, so a deep stack compiles what a shallow one does,
    and each device computes only its own shards.

    Args:
      factory: ``factory(key) -> Module`` (any pytree), traceable, for example
        ``lambda k: eqx.nn.MLP(2, 3, 8, 2, key=k)``.
      key: an int seed (the factory gets ``jax.random.key(seed)``), a typed key, or a
        legacy uint32 key (the factory gets it as it is).
      placements: the sharding of each array leaf, by its dot-joined path
        (``layers.0.weight``): a table of ``(regex, axes)`` entries (each regex
        full-matched, the first match wins), a tree of shardings or a rule
        ``(path, shape_dtype) -> axes``; every array leaf must be placed. The forms,
        and how each is read and checked: [Placements](../placements.md).
      mesh: the mesh of placements that name none; defaults to the
        ``meshinit.defaults()`` mesh, else the ``jax.set_mesh`` one.
      rules: the logical-to-mesh rule table, as in :func:`meshinit.param`.
      existing: the values of some leaves, made elsewhere: their plan paths
        (``layers.0.weight``) to arrays, flat or as a nested dict, or a Module of the
        factory's structure (a checkpoint restored into it), whose array leaves are
        taken by their paths. Each is placed on its planned sharding (resharded if it
        is on another mesh, shard by shard if it is numpy); nothing is compiled or run
        for them, and every other leaf gets exactly the value a full init gives. A
        big-endian numpy array is placed with its values; a path given twice (flat and
        nested, or keys ``0`` and ``"0"``) is an error.

    Returns:
      What ``factory(key)`` returns, with each array a ready ``jax.Array`` carrying
      exactly its planned ``NamedSharding``. Non-array leaves (activation functions)
      come from the abstract trace.

    Raises:
      PlanError: all problems at once: array leaves that no placement matches (one
        per path), malformed placements or regexes, and what planning finds (unknown
        logical axes, indivisible dimensions, a missing mesh, ...), a tree of
        placements that lacks a leaf or has one no leaf has, and ``existing``
        paths that name no leaf or are given twice, or whose value is no array (PRNG
        keys, a ``ShapeDtypeStruct`` of a restore target such as
        ``eqx.filter_eval_shape``'s) or differs in shape or dtype.
      TypeError, ValueError: ``placements`` is a str or a sequence that is neither a
        table nor a tree of shardings, or the key is not a single
        sharding-invariant key.

    Examples:
      >>> mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
      >>> mlp = meshinit.eqx.init(
      ...     lambda k: eqx.nn.MLP(64, 16, 256, 2, key=k),
      ...     jax.random.key(0),
      ...     [(r"layers\\.\\d+\\.weight", ("tensor", "fsdp")),
      ...      (r"layers\\.\\d+\\.bias", None)],
      ...     mesh=mesh,
      ... )
      >>> mlp.layers[0].weight.sharding.spec
      P('tensor', 'fsdp')
    """
    return _prepared.init(
        "meshinit.eqx.init",
        lambda: _eqx.prepare(factory, key, placements, mesh, rules, what="meshinit.eqx.init"),
        existing,
    )
