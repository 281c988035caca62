"""Spec-declared nnx layers stacked on a leading axis and run with ``nnx.scan``.

``meshinit.stacked`` gives each layer its own fan-in (``lecun_normal`` on a raw
``(L, d, d)`` shape would shrink the std by sqrt(L)), and slice ``i`` equals what
layer ``i`` would get on its own. The layers axis is replicated here; map it to a
mesh axis in the rules to shard it.

Run: python examples/nnx_stacked.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshinit  # noqa: E402

RULES = (("layers", None), ("embed", "fsdp"), ("mlp", "tensor"))
D, LAYERS = 128, 6


class Block(nnx.Module):
    """One MLP block; its Params hold stacked specs: one slice per layer."""

    def __init__(self, n: int):
        lecun = jax.nn.initializers.lecun_normal
        self.up = nnx.Param(
            meshinit.stacked(n, meshinit.param((D, 4 * D), lecun(), axes=("embed", "mlp")))
        )
        self.down = nnx.Param(
            meshinit.stacked(n, meshinit.param((4 * D, D), lecun(), axes=("mlp", "embed")))
        )

    def __call__(self, x):
        return x + jax.nn.gelu(x @ self.up.get_value()) @ self.down.get_value()


class Model(nnx.Module):
    def __init__(self):
        self.blocks = Block(LAYERS)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, block):
            return block(x)

        return step(x, self.blocks)


def main() -> None:
    # Auto axes: the forward pass leaves collectives to XLA (Explicit would ask for
    # out_sharding on every matmul whose contracting dimension is sharded).
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(auto, auto))
    with meshinit.defaults(mesh=mesh, rules=RULES):
        model = meshinit.nnx.materialize(Model(), jax.random.key(0))
    up = model.blocks.up.get_value()
    print("blocks.up", up.shape, up.sharding.spec)
    std = float(np.std(np.asarray(up)))
    print(f"per-layer std {std:.4f} (lecun: 1/sqrt({D}) = {1 / np.sqrt(D):.4f})")
    assert abs(std - 1 / np.sqrt(D)) < 0.005
    y = nnx.jit(lambda m, x: m(x))(model, jnp.ones((4, D)))
    print("forward through", LAYERS, "scanned layers:", y.shape)
    assert np.isfinite(np.asarray(y)).all()


if __name__ == "__main__":
    main()
