"""The recipes written in flax nnx: the reference stack as an nnx Module
(:func:`nnx_module`), built inside ``nnx.jit`` (``nnx.jit``), eagerly (``eager-nnx``),
and by ``meshinit.nnx.init`` unchanged (``meshinit.nnx``, ``:2mesh``, ``:table``).
"""

from __future__ import annotations

from typing import Any

from models import Leaf, Model, mesh_axes, stage_patterns, table


def nnx_module(model: Model, mesh: Any, annotated: bool = True) -> type:
    """A flax nnx Module class whose ``__init__(rngs)`` builds ``model``'s parameters;
    ``annotated=False`` leaves out their sharding metadata (a table places them)."""
    from flax import nnx

    dtype = model.jnp_dtype

    def param(rngs: nnx.Rngs, leaf: Leaf) -> nnx.Param:
        value = leaf.init()(rngs.params(), leaf.shape, dtype)
        if not annotated:
            return nnx.Param(value)
        return nnx.Param(value, out_sharding=mesh_axes(leaf.axes), mesh=mesh)

    class Layer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            for name, leaf in model.layer().items():
                setattr(self, name, param(rngs, leaf))

    class Transformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            tree = model.tree()
            self.embed = param(rngs, tree["embed"])
            self.layers = nnx.List([Layer(rngs) for _ in range(model.layers)])
            self.head = param(rngs, tree["head"])

    return Transformer


def nnx_arrays(model: Model, module: Any) -> dict[str, Any]:
    """The module's parameter arrays in the common tree shape."""
    return {
        "embed": module.embed[...],
        "layers": [{n: getattr(layer, n)[...] for n in model.layer()} for layer in module.layers],
        "head": module.head[...],
    }


def nnx_jit_init(model: Model, mesh: Any) -> Any:
    import jax
    from flax import nnx

    Transformer = nnx_module(model, mesh)

    @nnx.jit
    def create():
        return Transformer(nnx.Rngs(0))

    # Explicit-axes shardings inside a jit need the mesh in context.
    with jax.set_mesh(mesh):
        module = create()
    return nnx_arrays(model, module)


def eager_nnx_init(model: Model, mesh: Any) -> Any:
    from flax import nnx

    assert nnx.using_eager_sharding(), "flax's eager sharding is off"
    module = nnx_module(model, mesh)(nnx.Rngs(0))
    return nnx_arrays(model, module)


def meshinit_nnx_init(
    model: Model, mesh: Any, two_stages: bool = False, by_table: bool = False
) -> Any:
    """``meshinit.nnx.init`` of the ``nnx.jit`` recipe's Module, its code unchanged;
    ``by_table``: the same Module without sharding metadata, placed by :func:`table`."""
    from flax import nnx

    import meshinit.nnx

    Transformer = nnx_module(model, mesh, annotated=not by_table)
    meshes = stage_patterns(model, mesh) if two_stages else None
    placed = {"placements": table(model), "mesh": mesh} if by_table else {}
    module = meshinit.nnx.init(lambda: Transformer(nnx.Rngs(0)), meshes=meshes, **placed)
    return nnx_arrays(model, module)
