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

from typing import Any

try:
    import flax.linen as nn
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("meshinit.linen needs flax: pip install 'meshinit[linen]'") from e

from jax.sharding import AbstractMesh, Mesh, NamedSharding

from ._adapters import linen as _linen
from ._adapters import prepared as _prepared
from ._plan.plan import Plan

__all__ = ["init", "plan"]


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
      placements: as for :func:`init`
        ([Placements](../placements.md)); its meshes may be ``AbstractMesh`` es.
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
    options = dict(mesh=mesh, rules=rules, default=default, meshes=meshes, placements=placements)
    what = "meshinit.linen.plan"
    return _linen.prepare(module, key, example_args, example_kwargs, what=what, **options).plan


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
      placements: the sharding kept outside the model, by dot-joined variable path
        (``params.layers_0.up.kernel``): a table of ``(regex, axes)`` entries (each
        regex full-matched, the first match wins), a tree of shardings (the whole
        variables dict, ``params`` level included) or a rule ``(path, shape_dtype) ->
        axes``. A placement overrides the variable's annotation and ``default``; its
        box then says what was placed (an ``nn.LogicallyPartitioned`` where logical
        names resolved through rules, else an ``nn.Partitioned``). The forms, and how
        each is read and checked: [Placements](../placements.md).
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
    options = dict(mesh=mesh, rules=rules, default=default, meshes=meshes, placements=placements)
    what = "meshinit.linen.init"
    return _prepared.init(
        what,
        lambda: _linen.prepare(module, key, example_args, example_kwargs, what=what, **options),
        existing,
    )
