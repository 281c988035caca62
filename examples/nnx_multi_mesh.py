"""Existing flax nnx code, placed exactly: the model from flax #5127, unchanged.

Under ``nnx.jit`` this model comes out with GSPMDShardings on the wrong mesh (or fails
with IndivisibleError on current jax). ``meshinit.nnx.init`` reads the same flax
metadata and places every Param on its own mesh, under any context mesh.

Run: python examples/nnx_multi_mesh.py
"""

import warnings

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import meshinit  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)  # flax: 'sharding' -> 'out_sharding'

mesh1, rules1 = jax.make_mesh((2, 4), ("a", "b")), (("A", "a"), ("B", "b"))
mesh2, rules2 = jax.make_mesh((2, 2, 2), ("x", "y", "z")), (("X", "x"), ("Y", "y"), ("Z", "z"))
mesh3, rules3 = jax.make_mesh((8,), ("c",)), (("C", "c"),)


class Model(nnx.Module):  # exactly as in the flax issue
    def __init__(self):
        self.small_linear1 = nnx.Param(
            jnp.ones((16, 16)), sharding=("A", "B"), mesh=mesh1, sharding_rules=rules1
        )
        self.small_linear2 = nnx.Param(
            jnp.ones((16, 16, 16)), sharding=("X", "Y", "Z"), mesh=mesh2, sharding_rules=rules2
        )
        self.small_linear3 = nnx.Param(
            jnp.ones((16, 16)), sharding=("C",), mesh=mesh3, sharding_rules=rules3
        )


def main() -> None:
    with jax.set_mesh(jax.make_mesh((4, 2), ("data", "context"))):
        model = meshinit.nnx.init(Model)
    wanted = {
        "small_linear1": (mesh1, ("a", "b")),
        "small_linear2": (mesh2, ("x", "y", "z")),
        "small_linear3": (mesh3, ("c",)),  # spelled as flax spells it: one entry per name
    }
    for name, (mesh, spec) in wanted.items():
        sharding = getattr(model, name).get_value().sharding
        print(f"{name}: {sharding}")
        assert sharding.mesh is mesh and tuple(sharding.spec) == spec
    print(nnx.get_partition_spec(nnx.state(model))["small_linear3"].get_value())


if __name__ == "__main__":
    main()
