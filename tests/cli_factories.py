"""Factories for ``meshinit plan`` tests: ``meshinit plan tests/cli_factories.py:NAME``."""

import jax
from jax.sharding import AbstractMesh, AxisType

import meshinit

FACTORY_RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"), ("norm", None))
lecun_init = jax.nn.initializers.lecun_normal()
ones = jax.nn.initializers.ones


def _abstract_mesh(sizes: tuple[int, ...], names: tuple[str, ...]) -> AbstractMesh:
    """An AbstractMesh with Auto axes, like ``Mesh(...)`` and ``--abstract-mesh``, on
    every jax: AbstractMesh's own default is Auto on jax 0.10 and Explicit from 0.11."""
    return AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))


OWN = _abstract_mesh((4,), ("tensor",))  # a mesh some specs bind themselves


def layer() -> dict:
    return {
        "up": meshinit.param((64, 256), lecun_init, axes=("embed", "mlp")),
        "down": meshinit.param((256, 64), lecun_init, axes=("mlp", "embed")),
        "norm": meshinit.param((64,), ones, axes=("norm",)),
    }


def specs() -> dict:
    """Four layers and an embedding with no mesh: give one with --abstract-mesh."""
    with meshinit.defaults(rules=FACTORY_RULES):
        return {
            "embed": meshinit.param((512, 64), lecun_init, axes=("vocab", "embed")),
            "layers": [layer() for _ in range(4)],
        }


def mixed() -> dict:
    """:func:`specs` plus a head that binds its own mesh."""
    tree = specs()
    tree["head"] = meshinit.param((64, 512), lecun_init, axes=(None, "tensor"), mesh=OWN)
    return tree


def same_mesh_twice() -> dict:
    """One spec takes the default mesh, one binds an equal mesh of its own."""
    return {
        "default": meshinit.param((8, 8), ones, axes=("x", None)),
        "own": meshinit.param((8, 8), ones, axes=("x", None), mesh=_abstract_mesh((2,), ("x",))),
    }


def stages() -> dict:
    """Layers 0-3 on one concrete stage and 4-7 on another (needs 8 devices)."""
    devices = jax.devices()
    out = {}
    for s in range(2):
        mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[4 * s : 4 * s + 4])
        with meshinit.defaults(mesh=mesh, rules=FACTORY_RULES):
            out[str(s)] = {"layers": {str(i): layer() for i in range(4 * s, 4 * s + 4)}}
    return out


def nnx_model():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self):
            self.up = nnx.Param(meshinit.param((64, 256), lecun_init, axes=("embed", "mlp")))

    class Model(nnx.Module):
        def __init__(self):
            with meshinit.defaults(rules=FACTORY_RULES):
                self.blocks = nnx.List([Block() for _ in range(3)])
                self.head = nnx.Param(
                    meshinit.param((64, 512), lecun_init, axes=("embed", "vocab"))
                )

    return Model()


def nnx_ordinary():
    """Ordinary nnx code, no meshinit in it: kernels carry ``out_sharding`` and no mesh,
    as flax code run under ``jax.set_mesh`` writes them; the head binds its own mesh.

    Called eagerly it fails (flax has no mesh to place the kernels on): ``meshinit plan``
    must only trace it.
    """
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(
                64, 256, kernel_metadata={"out_sharding": ("fsdp", "tensor")}, rngs=rngs
            )
            self.down = nnx.Linear(
                256, 64, kernel_metadata={"out_sharding": ("tensor", "fsdp")}, rngs=rngs
            )
            self.norm = nnx.RMSNorm(64, rngs=rngs)  # no metadata: replicated

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(3)])
            self.head = nnx.Param(
                lecun_init(rngs.params(), (64, 512)), out_sharding=(None, "tensor"), mesh=OWN
            )
            self.dropout = nnx.Dropout(0.1, rngs=rngs)  # RNG state: a key and a count

    return Model(nnx.Rngs(0))


def nnx_ordinary_on_mesh():
    """Ordinary nnx code on a real (2, 4) mesh (needs 8 devices), every kernel sharded.

    It stands for a model too large to allocate: called eagerly (its kernels arrays,
    not tracers), it raises.
    """
    from flax import nnx

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

    class Model(nnx.Module):
        def __init__(self, rngs):
            meta = {"out_sharding": ("fsdp", "tensor"), "mesh": mesh}
            self.layers = nnx.List(
                [nnx.Linear(64, 256, kernel_metadata=meta, rngs=rngs) for _ in range(4)]
            )

    model = Model(nnx.Rngs(0))
    if not isinstance(model.layers[0].kernel.get_value(), jax.core.Tracer):
        raise MemoryError("nnx_ordinary_on_mesh was called, not traced: it allocated")
    return model


def eqx_model():
    import equinox as eqx

    class Model(eqx.Module):
        layers: list
        head: object

        def __init__(self):
            with meshinit.defaults(rules=FACTORY_RULES):
                self.layers = [layer() for _ in range(2)]
                self.head = meshinit.param((64, 512), lecun_init, axes=("embed", "vocab"))

    return Model()


def bad_axes() -> dict:
    """Every layer names a logical axis with no rule, and one shape does not divide."""
    with meshinit.defaults(rules=FACTORY_RULES):
        return {
            "layers": [
                {"up": meshinit.param((64, 256), lecun_init, axes=("embed", "mlpp"))}
                for _ in range(6)
            ],
            "odd": meshinit.param((3, 64), lecun_init, axes=("vocab", None)),
        }


def raises():
    raise ValueError("vocab size 1000 is not\na multiple of 128")


def empty() -> dict:
    return {"learning_rate": 3e-4}


def needs_arguments(depth):
    return depth


NOT_A_FUNCTION = 3


def _logical_nnx(mesh=None):
    from flax import nnx

    lecun = nnx.initializers.lecun_normal()

    class Model(nnx.Module):
        def __init__(self, rngs):
            up = nnx.with_partitioning(lecun, ("embed", "mlp"), mesh=mesh)
            down = nnx.with_partitioning(lecun, ("mlp", "embed"), mesh=mesh)
            self.up = nnx.Linear(64, 256, kernel_init=up, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(256, 64, kernel_init=down, use_bias=False, rngs=rngs)

    return Model(nnx.Rngs(0))


def nnx_logical():
    """Ordinary nnx code with logical names, no mesh and no rules: the most common
    style, which ``meshinit plan`` plans with ``--rules`` (issue 57)."""
    return _logical_nnx()


def nnx_logical_on_mesh():
    """:func:`nnx_logical` on a real (2, 4) mesh of its own (needs 8 devices)."""
    return _logical_nnx(jax.make_mesh((2, 4), ("fsdp", "tensor")))


def specs_logical() -> dict:
    """Specs with logical names and neither mesh nor rules."""
    return {"layers": [layer() for _ in range(2)]}
