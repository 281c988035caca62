"""A stacked equinox model: one array per weight with a leading layers axis, scanned.

Equinox models often keep their layers stacked (``jax.lax.scan`` over the leading
axis compiles one layer instead of N). ``meshinit.stacked(n, spec)`` declares such a
weight: slice ``i`` is exactly what layer ``i`` would get on its own, with its
per-layer fan-in, where a variance-scaling initializer on the whole ``(L, d, h)``
shape would count ``L`` into the fan and shrink every layer's std by ``sqrt(L)``.

The module declares specs in ``__init__``, so building it allocates nothing, and
``meshinit.eqx.materialize`` places every weight with one small compiled program per
distinct weight shape, whatever the depth.

Run: python examples/eqx_stacked.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshinit  # noqa: E402

# ("layers", None) keeps the layers axis whole on every device; ("layers", "stage") on a
# mesh with a stage axis would split the stack into pipeline stages instead.
RULES = (
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
)
LAYERS, VOCAB, D, H = 6, 512, 128, 512


class Blocks(eqx.Module):
    """``LAYERS`` residual MLP blocks, stored stacked and applied with ``lax.scan``."""

    up: jax.Array  # (LAYERS, D, H)
    down: jax.Array  # (LAYERS, H, D)
    scale: jax.Array  # (LAYERS, D)

    def __init__(self):
        lecun = jax.nn.initializers.lecun_normal()
        self.up = meshinit.stacked(LAYERS, meshinit.param((D, H), lecun, axes=("embed", "mlp")))
        self.down = meshinit.stacked(LAYERS, meshinit.param((H, D), lecun, axes=("mlp", "embed")))
        self.scale = meshinit.stacked(
            LAYERS, meshinit.param((D,), jax.nn.initializers.ones, axes=("embed",))
        )

    def __call__(self, x):
        def layer(x, weights):
            up, down, scale = weights
            return x + jax.nn.gelu(x @ up) @ down * scale, None

        x, _ = jax.lax.scan(layer, x, (self.up, self.down, self.scale))
        return x


class LanguageModel(eqx.Module):
    embed: jax.Array  # (VOCAB, D), tied with the output projection
    blocks: Blocks

    def __init__(self):
        lecun = jax.nn.initializers.lecun_normal()
        self.embed = meshinit.param((VOCAB, D), lecun, axes=("vocab", "embed"))
        self.blocks = Blocks()

    def __call__(self, tokens):
        return self.blocks(self.embed[tokens]) @ self.embed.T


def main() -> None:
    # Auto axes: XLA propagates the weights' shardings through the scan by itself.
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    with meshinit.defaults(mesh=mesh, rules=RULES):
        specs = LanguageModel()  # specs only: nothing is allocated yet
    print(meshinit.plan(specs), end="\n\n")
    model = meshinit.eqx.materialize(specs, jax.random.key(0))

    expected = {
        "embed": P("tensor", "fsdp"),
        "blocks.up": P(None, "fsdp", "tensor"),
        "blocks.down": P(None, "tensor", "fsdp"),
        "blocks.scale": P(None, "fsdp"),
    }
    flat, _ = jax.tree_util.tree_flatten_with_path(model)
    for keypath, array in flat:
        path = meshinit._paths.path_str(keypath)
        print(f"{path:13} {str(array.shape):15} {array.sharding.spec}")
        assert array.sharding == NamedSharding(mesh, expected[path]), path

    # Slice i is layer i's own initialization, with fan-in D (not LAYERS * D).
    up = np.asarray(model.blocks.up)
    layer_key = jax.random.fold_in(meshinit.param_key(jax.random.key(0), "blocks.up"), 3)
    alone = jax.jit(lambda k: jax.nn.initializers.lecun_normal()(k, (D, H), jnp.float32))
    np.testing.assert_array_max_ulp(up[3], np.asarray(alone(layer_key)), maxulp=2)
    std = up.reshape(LAYERS, -1).std(axis=1)
    print("per-layer std:", np.round(std, 4), "expected about", round(1 / np.sqrt(D), 4))
    assert np.allclose(std, 1 / np.sqrt(D), rtol=0.1)

    tokens = jnp.arange(16) % VOCAB
    logits = eqx.filter_jit(lambda m, t: m(t))(model, tokens)
    assert logits.shape == (16, VOCAB) and bool(jnp.all(jnp.isfinite(logits)))
    print("forward pass: logits", logits.shape, "sharded", logits.sharding.spec)


if __name__ == "__main__":
    main()
