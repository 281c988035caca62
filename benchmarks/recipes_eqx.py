"""The recipes written in equinox: the reference stack as equinox code
(:func:`eqx_factory`), built by ``eqx.filter_jit`` with every array placed inside
(``eqx.filter_jit``) and by ``meshinit.eqx.init`` with regex placements
(``meshinit.eqx``). Equinox stores a Linear's weight as (out, in): :func:`eqx_layout`.
"""

from __future__ import annotations

from typing import Any

from models import RULES, Leaf, Model, leaves, path_str, sharding_of


def eqx_factory(model: Model) -> Any:
    """``factory(key) -> module``: the stack as equinox code, ``eqx.nn.Linear`` without
    bias for each matrix (weights (out, in)), ``eqx.nn.Embedding``, and ones for the norms.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    dtype = model.jnp_dtype
    matrices = [n for n, leaf in model.layer().items() if leaf.ndim == 2]

    class Layer(eqx.Module):
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        o: eqx.nn.Linear
        gate: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        n1: jax.Array
        n2: jax.Array

        def __init__(self, key: Any):
            keys = jax.random.split(key, len(matrices))
            for name, k in zip(matrices, keys, strict=True):
                fan_in, fan_out = model.layer()[name].shape
                setattr(self, name, eqx.nn.Linear(fan_in, fan_out, False, dtype, key=k))
            self.n1 = jnp.ones((model.d,), dtype)
            self.n2 = jnp.ones((model.d,), dtype)

    class Transformer(eqx.Module):
        embed: eqx.nn.Embedding
        layers: list[Layer]
        head: eqx.nn.Linear

        def __init__(self, key: Any):
            keys = jax.random.split(key, model.layers + 2)
            self.embed = eqx.nn.Embedding(model.vocab, model.d, dtype=dtype, key=keys[0])
            self.layers = [Layer(k) for k in keys[1:-1]]
            self.head = eqx.nn.Linear(model.d, model.vocab, False, dtype, key=keys[-1])

    return Transformer


def eqx_layout(path: str, leaf: Leaf) -> Leaf:
    """The leaf as the equinox stack stores it: a Linear's weight is (out, in)."""
    if leaf.ndim == 2 and path != "embed":
        return Leaf(leaf.shape[::-1], leaf.axes[::-1])
    return leaf


def eqx_placements(model: Model) -> list[tuple[str, tuple[str, ...]]]:
    """``meshinit.eqx.init``'s placements: (regex over pytree paths, logical axes)."""
    tree = model.tree()
    out = [(r"embed\.weight", tree["embed"].axes)]
    for name, leaf in model.layer().items():
        if leaf.ndim == 2:
            out.append((rf"layers\.\d+\.{name}\.weight", eqx_layout(name, leaf).axes))
        else:
            out.append((rf"layers\.\d+\.{name}", leaf.axes))
    out.append((r"head\.weight", eqx_layout("head", tree["head"]).axes))
    return out


def eqx_arrays(model: Model, module: Any) -> dict[str, Any]:
    """The stack's arrays in the common tree shape, as stored (see :func:`eqx_layout`)."""
    return {
        "embed": module.embed.weight,
        "layers": [
            {
                n: getattr(layer, n).weight if leaf.ndim == 2 else getattr(layer, n)
                for n, leaf in model.layer().items()
            }
            for layer in module.layers
        ],
        "head": module.head.weight,
    }


def eqx_jit_init(model: Model, mesh: Any) -> Any:
    """How equinox users shard at init: ``eqx.filter_jit`` of the constructor, with
    ``eqx.filter_shard`` on every array inside (equinox's parallelism example), or
    ``jax.sharding.reshard`` where the mesh's axes are Explicit."""
    import equinox as eqx
    import jax

    factory = eqx_factory(model)
    key = jax.random.key(0)
    layouts = {path: eqx_layout(path, leaf) for path, leaf in leaves(model)}
    # A shardings tree of the module's structure: the weight of ``layers.0.q`` (a
    # Linear) is the model's ``layers.0.q``.
    shardings = jax.tree_util.tree_map_with_path(
        lambda p, _: sharding_of(mesh, layouts[path_str(p).removesuffix(".weight")]),
        eqx.filter_eval_shape(factory, key),
    )

    explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)

    @eqx.filter_jit
    def create(key: Any) -> Any:
        module = factory(key)
        if not explicit:
            return eqx.filter_shard(module, shardings)
        # filter_shard is with_sharding_constraint, which jax rejects on Explicit axes
        # ("use reshard"): the same, through reshard.
        arrays, static = eqx.partition(module, eqx.is_array)
        return eqx.combine(jax.sharding.reshard(arrays, shardings), static)

    with jax.set_mesh(mesh):  # Explicit shardings inside a jit need the mesh in context
        module = create(key)
    return eqx_arrays(model, module)


def meshinit_eqx_init(model: Model, mesh: Any) -> Any:
    import jax

    import meshinit.eqx

    module = meshinit.eqx.init(
        eqx_factory(model), jax.random.key(0), eqx_placements(model), mesh=mesh, rules=RULES
    )
    return eqx_arrays(model, module)
