"""flax linen annotations as meshinit specs: a variable's ``nn.Partitioned`` /
``nn.LogicallyPartitioned`` box, its mesh and rules, or the ``default=`` placement for
unannotated variables, translated into a spec."""

from __future__ import annotations

from typing import Any, cast

try:
    import flax.core
    import flax.linen as nn
    from flax.core import meta
    from flax.core import scope as _scope
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("meshinit.linen needs flax: pip install 'meshinit[linen]'") from e

from collections.abc import Mapping

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .._errors import Problem
from .._spec.constructor import from_constructor
from .._spec.spec import ParamSpec, memory_kind_default, replicated_default
from . import common as _adapters
from .placement.parsed import Parsed, not_an_array
from .placement.replicas import Replicas


def is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def value_of(x: Any) -> Any:
    """A box's value, without the sharding constraint linen's ``unbox`` would add."""
    if isinstance(x, meta.Partitioned):
        return x.unbox(apply_constraint=False)
    return x.unbox() if is_box(x) else x


def fallback_mesh(mesh: Any) -> Mesh | AbstractMesh:
    """``mesh``, else the context mesh, else a mesh with no axes over the default device."""
    if mesh is not None:
        return mesh
    found = _adapters.context_mesh()
    return found if found is not None else _adapters.default_mesh()


def default_placement(default: Any, mesh: Any) -> tuple[Any, Any] | None:
    """``(mesh, spec entries or None)`` for leaves without an annotation, or None."""
    if default is None:
        return None
    if isinstance(default, str):
        if default != "replicated":
            raise ValueError(
                f'default must be "replicated", a Mesh or a NamedSharding; got {default!r}'
            )
        return fallback_mesh(mesh), None
    if isinstance(default, Mesh | AbstractMesh):
        return default, None
    if isinstance(default, NamedSharding):
        return default.mesh, tuple(default.spec)
    raise TypeError(
        f'default must be "replicated", a Mesh or a NamedSharding; got {type(default).__name__}'
    )


_NO_ANNOTATION = (
    "has no partitioning annotation; wrap its initializer with "
    "nn.with_logical_partitioning(init, names) or nn.with_partitioning(init, names), "
    'or pass default="replicated" to replicate every unannotated variable'
)


def _placeable(path: str, leaf: Any, problems: list[Problem], by: str = "") -> Any:
    """A variable's abstract value, or None with its problem recorded: not an array,
    or an array of PRNG keys; ``by`` names the placement that matched it, if any."""
    value = value_of(leaf)
    if not isinstance(value, jax.ShapeDtypeStruct):
        if by:
            problems.append(not_an_array(path, by, value))
        else:
            text = f"holds {type(value).__name__}, not an array; meshinit cannot place it"
            problems.append(Problem(path, text))
        return None
    problem = _adapters.key_array_problem(path, value.dtype)
    if problem is not None:
        problems.append(problem)
        return None
    return value


def spec_for(
    path: str,
    leaf: Any,
    mesh: Any,
    rules: Any,
    default: tuple[Any, Any] | None,
    problems: list[Problem],
    override: Any = None,
    call: str = "meshinit.linen.init",
) -> ParamSpec | None:
    """Translates one variable (boxed or not) into a spec; records what is wrong.

    ``override`` (a ``meshes=`` match) wins over the annotation's own mesh; ``call``
    is the function the user called, as a message names it.
    """
    boxed = isinstance(leaf, meta.Partitioned)
    value = _placeable(path, leaf, problems)
    if value is None:
        return None
    ndim = len(value.shape)
    spec_rules: Any = None  # any table of rules: ParamSpec normalizes it
    axes: tuple[Any, ...] | None
    if boxed:
        names = tuple(leaf.names)
        problem = _adapters.unconstrained_problem(path, names, "names")
        if problem is not None:
            problems.append(problem)
            return None
        if len(names) > ndim:
            problems.append(
                Problem(path, f"names {names} have more entries than its {ndim} dimensions")
            )
            return None
        axes = names + (None,) * (ndim - len(names))  # as PartitionSpec pads
        where = override if override is not None else leaf.mesh
        where = where if where is not None else mesh
        where = where if where is not None else _adapters.context_mesh()
        if where is None:
            problems.append(
                Problem(
                    path,
                    f"is annotated but has no mesh: pass mesh= to {call} or to its "
                    f"annotation, or call under jax.set_mesh",
                )
            )
            return None
        if isinstance(leaf, nn.LogicallyPartitioned):
            spec_rules = leaf.rules if leaf.rules is not None else rules
            if spec_rules is None:
                spec_rules = nn.get_logical_axis_rules() or None
            if spec_rules is None:
                problems.append(
                    Problem(
                        path,
                        f"has logical axis names {names} but no rules: pass rules= to "
                        f"{call} or to its annotation, or call under "
                        f"nn.logical_axis_rules(...)",
                    )
                )
                return None
    elif default is not None:
        where, entries = default
        axes = None if entries is None else entries + (None,) * (ndim - len(entries))
    else:
        problems.append(Problem(path, _NO_ANNOTATION))
        return None
    try:
        return ParamSpec(
            shape=value.shape,
            init=from_constructor,
            replicated=replicated_default(),
            memory_kind=memory_kind_default(),
            axes=axes,
            mesh=where,
            rules=spec_rules,
            dtype=value.dtype,
        )
    except (TypeError, ValueError) as e:
        problems.append(Problem(path, str(e)))
        return None


def placed_spec(
    path: str,
    leaf: Any,
    placement: Parsed,
    mesh: Any,
    rules: Any,
    override: Any,
    problems: list[Problem],
    replicas: Replicas,
) -> ParamSpec | None:
    """The spec of a variable that a ``placements=`` entry matches, boxed or not.

    The entry's axes replace the box's names: logical names resolve through ``rules``
    (else an active ``nn.logical_axis_rules``, else the box's own rules), a
    PartitionSpec names mesh axes. The mesh is ``override`` (a ``meshes=`` match), else
    the entry's, else ``mesh``, else the context mesh (``meshinit.defaults``,
    ``jax.set_mesh``), else the box's own, else, where the entry replicates it, the one
    mesh the placements name (``replicas``, which refuses it where that is not clear).
    """
    value = _placeable(path, leaf, problems, placement.name)
    if value is None:
        return None
    own = leaf.mesh if isinstance(leaf, meta.Partitioned) else None
    candidates = (override, placement.mesh, _adapters.placement_mesh(mesh), own)
    where = next((m for m in candidates if m is not None), None)
    axes = placement.axes_for(len(value.shape))
    table = rules if rules is not None else (nn.get_logical_axis_rules() or None)
    if table is None and isinstance(leaf, nn.LogicallyPartitioned):
        table = leaf.rules
    where = replicas.mesh_or_problem(where, path, placement, axes, problems, "meshinit.linen.init")
    if where is None:
        return None
    memory_kind = placement.memory_kind
    try:
        return ParamSpec(
            shape=value.shape,
            init=from_constructor,
            replicated=replicated_default(),
            memory_kind=memory_kind if memory_kind is not None else memory_kind_default(),
            axes=axes,
            mesh=where,
            rules=placement.rules_for(table),
            dtype=value.dtype,
        )
    except (TypeError, ValueError) as e:
        problems.append(Problem(path, f"{placement.name}: {e}"))
        return None


def placed_box(leaf: Any, array: Any, spec: ParamSpec, sharding: Any, keep_mesh: bool) -> Any:
    """The box a placed variable comes back in, saying what was placed: its logical
    names (``nn.LogicallyPartitioned``, the box's own rules kept) where they resolved
    through rules, else the placed mesh axes (``nn.Partitioned``). It names the mesh it
    was placed on where the placement, ``meshes=`` or the box itself named one."""
    where = sharding.mesh if keep_mesh else None
    if spec.rules is not None and spec.axes is not None:
        own = leaf.rules if isinstance(leaf, nn.LogicallyPartitioned) else None
        names = cast(tuple[str | None, ...], tuple(spec.axes))
        return nn.LogicallyPartitioned(array, names, mesh=where, rules=own)
    return nn.Partitioned(array, tuple(sharding.spec), mesh=where)


INTERMEDIATES = "intermediates"


def without_intermediates(
    variables: Any, kwargs: Mapping[str, Any], what: str
) -> tuple[Any, str | None]:
    """``module.init``'s variables without the activations ``capture_intermediates=``
    collected, unless ``mutable=`` asks for them; and what to warn, if anything.

    flax returns the ``'intermediates'`` collection whenever ``capture_intermediates``
    is set, whatever ``mutable=`` says; its ``mutable`` default,
    ``DenyList('intermediates')``, leaves it out otherwise. Each activation is a value
    of the forward pass: made as a variable, it is one more program output that
    recomputes the forward pass up to it (kauldron's ``TrainStep`` passes
    ``capture_intermediates=True`` to ``init``, then drops the collection; meshinit
    took 37-75x longer for it). So meshinit leaves it out, as that ``mutable=`` would,
    and keeps it only where ``mutable=`` names it (``True``, or a list with
    ``'intermediates'``). Nothing else changes: the parameters do not depend on it.
    """
    if not isinstance(variables, dict | flax.core.FrozenDict) or INTERMEDIATES not in variables:
        return variables, None
    mutable = kwargs.get("mutable", _scope.DenyList(INTERMEDIATES))
    leaves = jax.tree_util.tree_leaves(variables[INTERMEDIATES])
    count = sum(isinstance(x, jax.Array) for x in leaves)
    if _scope.in_filter(mutable, INTERMEDIATES):
        if not count:
            return variables, None
        return variables, (
            f"{what}: the {INTERMEDIATES!r} collection holds {count} arrays (activations "
            f"of the forward pass), and mutable= keeps it: each is made as a variable, "
            f"one more program output that recomputes the forward pass up to it. Leave "
            f"{INTERMEDIATES!r} out of mutable= (flax's default leaves it out) if you "
            f"do not use them"
        )
    variables, _ = flax.core.pop(variables, INTERMEDIATES)
    return variables, (
        f"{what}: capture_intermediates= collected {count} arrays (activations of the "
        f"forward pass) in the {INTERMEDIATES!r} collection; they are left out of the "
        f"result and never computed, as flax's default mutable=DenyList({INTERMEDIATES!r}) "
        f"would (each would be one more program output recomputing the forward pass). "
        f"Pass mutable=True, or a list of collections naming {INTERMEDIATES!r}, to keep them"
    )
