"""The recipes written in flax linen: the reference stack as a linen Module
(:func:`linen_module`), initialized by flax's own recipe (``linen.jit``) and by
``meshinit.linen.init`` unchanged (``meshinit.linen``, ``:2mesh``, ``:table``).
"""

from __future__ import annotations

from typing import Any

from models import RULES, Leaf, Model, stage_patterns, table


def linen_module(model: Model, annotated: bool = True) -> Any:
    """A linen Module (an instance) that declares ``model``'s params as linen code does.

    Params are ``self.param(name, nn.with_logical_partitioning(init, axes), shape,
    dtype)``, named ``params.embed``, ``params.layers_<i>.<name>``, ``params.head``; its
    ``__call__`` looks up the embedding of int tokens.
    """
    import flax.linen as nn

    dtype = model.jnp_dtype

    def param(module: nn.Module, name: str, leaf: Leaf) -> Any:
        init = nn.with_logical_partitioning(leaf.init(), leaf.axes) if annotated else leaf.init()
        return module.param(name, init, leaf.shape, dtype)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            for name, leaf in model.layer().items():
                param(self, name, leaf)
            return x

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            tree = model.tree()
            x = param(self, "embed", tree["embed"])[tokens]
            for i in range(model.layers):
                x = Layer(name=f"layers_{i}")(x)
            param(self, "head", tree["head"])
            return x

    return Transformer()


def linen_tokens() -> Any:
    """The example input of :func:`linen_module`'s ``init``."""
    import numpy as np

    return np.zeros((1, 4), np.int32)


def linen_arrays(model: Model, variables: Any) -> dict[str, Any]:
    """The linen variables' param arrays (unboxed) in the common tree shape."""
    import flax.linen as nn

    params = nn.unbox(variables)["params"]
    return {
        "embed": params["embed"],
        "layers": [
            {n: params[f"layers_{i}"][n] for n in model.layer()} for i in range(model.layers)
        ],
        "head": params["head"],
    }


def linen_jit_init(model: Model, mesh: Any) -> Any:
    """flax's recipe: ``jax.eval_shape`` of ``module.init``, ``nn.get_partition_spec``,
    ``nn.logical_to_mesh_sharding``, then ``jax.jit(module.init, out_shardings=...)``.

    No mesh context: on Explicit axes the boxes' ``with_sharding_constraint`` would be
    an assertion (the arrays are made replicated and placed by the out_shardings).
    """
    import flax.linen as nn
    import jax

    module = linen_module(model)
    tokens = linen_tokens()
    key = jax.random.key(0)
    with nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(module.init, key, tokens)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
        variables = jax.jit(module.init, out_shardings=shardings)(key, tokens)
    return linen_arrays(model, variables)


def meshinit_linen_init(
    model: Model, mesh: Any, two_stages: bool = False, by_table: bool = False
) -> Any:
    """``meshinit.linen.init`` of :func:`linen_module`; ``two_stages`` splits it as
    ``meshinit.nnx:2mesh`` does, with ``meshes=``; ``by_table``: the Module without
    annotations, placed by :func:`table` (its logical names, through the rules)."""
    import jax

    import meshinit.linen

    module = linen_module(model, annotated=not by_table)
    staged: dict[str, Any] = {}
    if two_stages:
        staged["meshes"] = stage_patterns(model, mesh, prefix="params.", layer="layers_")
    if by_table:
        staged["placements"] = table(model, "params.", r"layers_\d+\.", logical=True)
    variables = meshinit.linen.init(
        module, jax.random.key(0), linen_tokens(), mesh=mesh, rules=RULES, **staged
    )
    return linen_arrays(model, variables)
