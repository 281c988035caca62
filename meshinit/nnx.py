"""flax nnx adapter: spec-declared Modules, and existing Modules placed unchanged.

Two ways in:

- :func:`materialize`: a Module whose Variables hold ``ParamSpec``s
  (``self.w = nnx.Param(meshinit.param(...))``) gets arrays in their place. The fast
  path: values follow meshinit's value contract, compiled once per signature.
- :func:`init`: an ordinary Module whose Variables carry flax sharding metadata
  (``out_sharding``, or the older ``sharding``/``sharding_names``, with ``mesh`` and
  ``sharding_rules``) comes back with exactly the shardings that metadata describes,
  and the values its own ``nnx.Rngs`` produce. The factory is traced once and
  compiled by meshinit's constructor engine (:mod:`meshinit._engine.run`): once per
  (mesh, per-variable computation, sharding), so depth adds no compile.
  :func:`plan` previews it without compiling.

And for training, :func:`optimizer`: an ordinary ``nnx.Optimizer`` whose state is
placed exactly like the params it mirrors, by ``meshinit.optax.init``.

Paths are nnx state paths, dot-joined (``layers.0.w``), so a spec-declared Module
gets the same values as ``meshinit.init`` on a dict with the same paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("meshinit.nnx needs flax: pip install 'meshinit[nnx]'") from e

from jax.sharding import AbstractMesh, Mesh

from ._adapters import nnx as _prep
from ._adapters import nnx_meta as _nnx_meta
from ._adapters import prepared as _prepared
from ._adapters.nnx_optimizer import optimizer
from ._plan import planner as _planner
from ._plan.plan import Plan
from ._run import agree as _agree
from ._run import materialize as _materialize

__all__ = ["materialize", "init", "plan", "abstract", "optimizer"]


def spec_tree(module: nnx.Module) -> dict[str, Any]:
    """The specs a spec-declared Module holds, as the tree :func:`materialize` plans.

    Paths in its plan are the Module's nnx paths (``layers.0.w``).
    """
    _, state = nnx.split(module)
    return _prep.nest(_prep.specs_of(list(nnx.to_flat_state(state))))


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
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"meshinit.nnx.materialize takes an nnx Module whose Variables hold "
            f"meshinit.param specs, got {type(module).__name__}; for a tree of specs use "
            f"meshinit.init(tree, key)"
        )
    graphdef, state = nnx.split(module)
    flat = list(nnx.to_flat_state(state))
    specs = _prep.specs_of(flat)
    with _agree.collective("meshinit.nnx.materialize"):  # a plan failing on one process too
        plan = _planner.plan(_prep.nest(specs))
        arrays = _materialize.materialize(plan, key)
    entries = {e.path: e for e in plan.entries}
    placed = []
    for path, var in flat:
        if path in specs:
            entry = entries[_prep.dotted(path)]
            var = var.replace(_prep.get(arrays, path), **_nnx_meta.placed_metadata(entry))
        placed.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def plan(
    factory: Callable[[], nnx.Module],
    *,
    placements: Any = None,
    mesh: Mesh | AbstractMesh | None = None,
    meshes: Any = None,
    rules: Any = None,
) -> Plan:
    """The plan :func:`init` would follow, without compiling or allocating anything.

    The factory is traced abstractly once; every Variable's placement is resolved as
    :func:`init` resolves it. Its paths are the dot-joined nnx paths
    (``layers.3.attn.q_norm.scale``), as in :func:`init`'s plan.

    Args:
      factory: as for :func:`init`.
      placements: as for :func:`init`
        ([Placements](../placements.md)); their meshes may be ``AbstractMesh`` es.
      mesh: as for :func:`init`; an ``AbstractMesh`` plans before hardware exists.
      meshes: as for :func:`init`; ``AbstractMesh`` es work, for planning before the
        hardware exists.
      rules: as for :func:`init`.

    Returns:
      A :class:`meshinit.Plan`. Typed keys (``nnx.Rngs`` state) are entries of their own
      shape and key dtype (``key<fry>``), on the sharding :func:`init` gives them.

    Raises:
      PlanError: as for :func:`init`.

    Examples:
      >>> print(meshinit.nnx.plan(lambda: Model(rngs=nnx.Rngs(0))).compact())
      a row stands for the n parameters its path pattern names; per device sums all n
      <BLANKLINE>
      mesh 0: Mesh(fsdp=2, tensor=4; Explicit; devices 0-7)
        path                 n  array        logical  PartitionSpec  per device
        layers.{0,1}.bias    2  f32[64]      -        replicated          512 B  !
        layers.{0,1}.kernel  2  f32[64,64]   -        fsdp,tensor       4.0 KiB
        w                    1  f32[64,256]  -        fsdp,tensor       8.0 KiB
        5 params, 96.5 KiB in all, 12.5 KiB per device
        ! 2 params replicated across an axis that could shard them: 512 B per device
          fsdp=2 could shard 2 (512 B per device): layers.{0,1}.bias
          tensor=4 could shard 2 (512 B per device): layers.{0,1}.bias
      <BLANKLINE>
      total: 5 params, 96.5 KiB, 1 mesh, most on one device 12.5 KiB
    """
    return _prep.prepare(
        factory, meshes, rules, "meshinit.nnx.plan", placements=placements, mesh=mesh
    ).plan


def abstract(
    factory: Callable[[], nnx.Module],
    *,
    placements: Any = None,
    mesh: Mesh | AbstractMesh | None = None,
    meshes: Any = None,
    rules: Any = None,
) -> nnx.Module:
    r"""The Module :func:`init` would return, each Variable's value a
    ``jax.ShapeDtypeStruct`` with its exact ``NamedSharding``; nothing is compiled or
    allocated.

    What ``nnx.eval_shape`` gives, with the shardings it drops, on every mesh and
    stage. flax's metadata is kept as it is. ``nnx.split`` of it gives the graphdef
    and the restore target of a checkpoint saved from ``nnx.state(model)`` (orbax's
    ``StandardCheckpointer``), in this layout: the layout it was saved in does not
    matter. Typed PRNG keys (``nnx.Rngs`` state) are structs of their key dtype.

    Args:
      factory: as for :func:`init`.
      placements: as for :func:`init`
        ([Placements](../placements.md)); a placed Variable's metadata says what was
        placed, as in :func:`init`.
      mesh: as for :func:`init`; an ``AbstractMesh`` plans before hardware exists.
      meshes: as for :func:`init`; ``AbstractMesh`` es work, for a target planned
        before the hardware exists.
      rules: as for :func:`init`.

    Returns:
      An nnx Module of the factory's graph, holding structs, not arrays.

    Raises:
      PlanError: as for :func:`init`.

    Examples:
      >>> graphdef, target = nnx.split(meshinit.nnx.abstract(lambda: Model(nnx.Rngs(0))))
      >>> model = nnx.merge(
      ...     graphdef, ocp.StandardCheckpointer().restore(path, target))  # doctest: +SKIP

      (The restore needs a checkpoint on disk: not run in the tests.)
    """
    with _agree.collective("meshinit.nnx.abstract"):
        prep = _prep.prepare(
            factory, meshes, rules, "meshinit.nnx.abstract", placements=placements, mesh=mesh
        )
    return prep.rewrap(prep.plan.abstract())


def init(
    factory: Callable[[], nnx.Module],
    *,
    placements: Any = None,
    mesh: Mesh | AbstractMesh | None = None,
    meshes: Any = None,
    rules: Any = None,
    existing: Any = None,
) -> nnx.Module:
    r"""Builds an ordinary nnx Module with every Variable placed as its metadata, or a
    placement table, says.

    Every Variable with flax sharding metadata comes back on
    ``NamedSharding(mesh, flax's partition spec)``, Variables without it (RNG state,
    unannotated arrays, or the empty ``P()``) replicated on that mesh. The mesh is the
    first ``meshes`` pattern that full-matches the Variable's dot-joined path, else
    its ``mesh=`` metadata, else ``mesh``, else the ``jax.set_mesh`` context mesh,
    else the default device. A ``placements`` entry that matches a Variable's path
    overrides its metadata. Values are the factory's own, from its own ``nnx.Rngs``;
    a placement moves a Variable and never changes its bits. A numpy value
    (``nnx.Param(np.ones(...), out_sharding=...)``) is placed as flax's eager sharding
    places it, where its sharding is not empty or a placement names it; else it stays
    numpy, as flax leaves it.

    The factory is traced once, abstractly, and compiled by meshinit's constructor
    engine: the keys, counters and small values are computed once on the host, and
    each large Variable's own computation is compiled once per (mesh, computation,
    sharding) and run per Variable, so a 32-layer model compiles what an 8-layer one
    does, and no device computes what it does not own. Params on disjoint submeshes
    work, under an active ``jax.set_mesh`` too.

    Args:
      factory: a zero-argument callable returning an nnx Module. It is traced, so it
        must build its own ``nnx.Rngs``, must not mutate outside state, and must not
        call ``jax.set_mesh``.
      placements: the sharding kept outside the model, by dot-joined Variable path
        (``layers.0.attn.q.kernel``): a table of ``(regex, axes)`` entries (each regex
        full-matched, the first match wins), a tree of shardings or a rule
        ``(path, shape_dtype) -> axes``. A placement overrides the Variable's sharding
        metadata, which then says what was placed; a Variable it does not place keeps
        its metadata. The forms, and how each is read and checked:
        [Placements](../placements.md).
      mesh: the mesh of placements that name none, and of Variables whose metadata
        names none; without it, the ``jax.set_mesh`` context mesh (for placements,
        the ``meshinit.defaults(mesh=...)`` one first).
      meshes: ordered ``(regex, mesh)`` pairs. The first regex that full-matches a
        Variable's path puts it on that mesh, overriding its ``mesh=`` metadata and
        the context mesh: how existing code is split into pipeline stages unchanged.
        A pattern that matches no Variable path is warned about
        (:class:`meshinit.UnusedPatternWarning`), likely a typo.
      rules: flax's logical axis rule table, ``(logical name, mesh axes)`` pairs (the
        ``logical_axis_rules`` of MaxText's configs): the factory is traced and its
        Variables placed as under ``flax.linen.logical_axis_rules(rules)``, which
        replaces any table the caller entered, for this call only. Without it, the
        table the caller entered (``with nn.logical_axis_rules(rules):``) applies, as
        flax applies it.
      existing: the values of some Variables, made elsewhere (a checkpoint, pretrained
        weights): their plan paths (``layers.1.up.kernel``) to arrays, flat or as a
        nested dict (``nnx.to_pure_dict(state)``, an ``nnx.State``, a Module). Each is placed
        on its planned sharding: an array already there is used as it is, one on
        another mesh is resharded, a numpy array is placed shard by shard. Nothing is
        compiled or run for them; every other Variable gets exactly the value a full
        init gives. A typed key (``nnx.Rngs`` state) may be given as a key (compared as
        one: shape and implementation) or as its key data. A big-endian numpy array is
        placed with its values; a path given twice (flat and nested, or keys ``0``
        and ``"0"``) is an error.

    Returns:
      The Module, with flax's metadata kept as it was.

    Raises:
      PlanError: a sharding names an axis that is not in its mesh, a dimension does
        not divide, a sharded Variable has no mesh, or a typed key's sharding has more
        entries than the key has dimensions; a placement is malformed, or a tree of
        placements lacks a Variable or has a leaf no Variable has; an ``existing`` path
        names no
        Variable, is given twice, or its value is no array (a key for a weight, a
        restore target's ``ShapeDtypeStruct``) or differs in shape or dtype; each
        problem names its path, all at once, before anything is allocated.
      ValueError: the factory leaks tracers, mutates outside state or sets a mesh.

    Examples:
      >>> model = meshinit.nnx.init(lambda: Model(rngs=nnx.Rngs(0)))
      >>> staged = meshinit.nnx.init(
      ...     lambda: Model(rngs=nnx.Rngs(0)),
      ...     meshes=[(r"layers\.[0-3]\..*", stage0), (r".*", stage1)])
    """
    return _prepared.init(
        "meshinit.nnx.init",
        lambda: _prep.prepare(
            factory, meshes, rules, "meshinit.nnx.init", placements=placements, mesh=mesh
        ),
        existing,
    )
