"""An existing equinox constructor, placed exactly with regex placements.

``eqx.nn.MLP`` makes its own arrays, so there are no specs to declare. Instead,
``meshinit.eqx.init`` traces the constructor once, abstractly, gives each array leaf
the sharding of the first placement whose regex matches its whole path, and compiles
each leaf's own computation once per (mesh, computation, sharding) with exact
out_shardings: each device builds only its shards, and the values are exactly what
``eqx.nn.MLP(..., key=key)`` makes.

Run: python examples/eqx_mlp.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshinit  # noqa: E402

# Ordered: the first regex that matches the whole path wins, so specific rules go first.
PLACEMENTS = [
    (r"layers\.0\.weight", ("tensor", None)),  # the first layer's units split over tensor
    (r"layers\.0\.bias", ("tensor",)),
    (r"layers\.\d+\.weight", ("fsdp", None)),  # the other weights split over fsdp
    (r"layers\.\d+\.bias", None),  # replicated
]
EXPECTED = {
    "layers.0.weight": P("tensor", None),
    "layers.0.bias": P("tensor"),
    "layers.1.weight": P("fsdp", None),
    "layers.1.bias": P(None),
    "layers.2.weight": P("fsdp", None),
    "layers.2.bias": P(None),
}


def factory(key):
    return eqx.nn.MLP(in_size=64, out_size=10, width_size=256, depth=2, key=key)


def arrays_by_path(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {meshinit._paths.path_str(kp): x for kp, x in flat if eqx.is_array(x)}


def main() -> None:
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    key = jax.random.key(0)
    model = meshinit.eqx.init(factory, key, PLACEMENTS, mesh=mesh)

    placed = arrays_by_path(model)
    eager = arrays_by_path(factory(key))
    for path, array in placed.items():
        print(f"{path:16} {str(array.shape):11} {array.sharding.spec}")
        assert array.sharding == NamedSharding(mesh, EXPECTED[path]), path
        np.testing.assert_allclose(array, eager[path], rtol=1e-6, atol=1e-6, err_msg=path)
    print("shardings exact; values equal eqx.nn.MLP(..., key=key) run eagerly")

    @eqx.filter_jit
    def forward(model, x):
        return jax.vmap(model)(x)

    y = forward(model, jnp.ones((8, 64)))
    assert y.shape == (8, 10) and bool(jnp.all(jnp.isfinite(y)))
    print("forward pass:", y.shape)

    # A leaf that no placement matches is an error that names it, never a silent default.
    try:
        meshinit.eqx.init(factory, key, PLACEMENTS[:3], mesh=mesh)
    except meshinit.PlanError as e:
        print(e)
        assert [p.path for p in e.problems] == ["layers.1.bias", "layers.2.bias"]
    else:
        raise AssertionError("unmatched leaves were not reported")


if __name__ == "__main__":
    main()
