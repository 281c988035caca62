"""Optimizer state beyond its parameters: ZeRO-1 over the data axis, and host offload.

An HSDP layout on a (data=2, fsdp=2, tensor=2) mesh of 8 simulated CPU devices: the
weights are sharded over fsdp and tensor and replicated over data, on purpose
(``replicated="data"`` keeps the plan's hints quiet about it). Adam's moments would be
replicated over data too; ``shard_over="data"`` shards them further, so each device
holds half. ``memory_kind="pinned_host"`` instead puts them in host memory, leaving
the device memory to the parameters. One jitted step with
``out_shardings=meshinit.shardings(...)`` keeps every placement, and the values are
exactly ``tx.init(params)``'s.

Run: python examples/zero1_offload.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import meshinit  # noqa: E402
import meshinit.optax  # noqa: E402

RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))


def specs(mesh) -> dict:
    lecun = jax.nn.initializers.lecun_normal()
    with meshinit.defaults(mesh=mesh, rules=RULES, replicated="data"):
        return {
            "embed": meshinit.param((512, 128), lecun, axes=("vocab", "embed")),
            "layers": [
                {
                    "up": meshinit.param((128, 512), lecun, axes=("embed", "mlp")),
                    "down": meshinit.param((512, 128), lecun, axes=("mlp", "embed")),
                }
                for _ in range(4)
            ],
        }


def device_bytes(tree, kind="device") -> int:
    """Bytes on device 0 in memory ``kind``."""
    device = jax.devices()[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        if x.sharding.memory_kind == kind
        for s in x.addressable_shards
        if s.device == device
    )


def main() -> None:
    # Auto axes: the step below lets XLA move the updates between the moments' and the
    # parameters' shardings (on Explicit axes the step would jax.sharding.reshard them).
    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=auto)
    plan = meshinit.plan(specs(mesh))
    assert not plan.groups[0].shardable_entries  # replicated over data by design
    params = meshinit.materialize(plan, 0)
    tx = optax.adam(1e-3)

    plain = meshinit.optax.init(tx, params)
    zero1 = meshinit.optax.init(tx, params, shard_over="data")
    offload = meshinit.optax.init(tx, params, memory_kind="pinned_host")
    print(f"parameters on device 0:               {device_bytes(params):>7} B")
    print(f"adam state on device 0, as the params: {device_bytes(plain):>7} B")
    print(f"adam state on device 0, ZeRO-1 (data): {device_bytes(zero1):>7} B")
    print(
        f"adam state offloaded: {device_bytes(offload):>7} B in device memory, "
        f"{device_bytes(offload, 'pinned_host')} B in pinned_host"
    )
    print("mu of layers.0.up:", zero1[0].mu["layers"][0]["up"].sharding.spec)
    assert device_bytes(zero1) * 2 <= device_bytes(plain) + 8  # the count stays replicated

    # The values are tx.init's, whatever the placement.
    cpu = jax.devices()[0]
    want = tx.init(jax.tree.map(lambda x: jax.device_put(np.asarray(x), cpu), params))
    for state in (zero1, offload):
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # A step keeps every placement: the restore target says the same.
    out = (meshinit.shardings(params), meshinit.shardings(zero1))

    def step(params, state):
        grads = jax.tree.map(jnp.ones_like, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, zero1 = jax.jit(step, out_shardings=out)(params, zero1)
    assert meshinit.shardings(zero1) == out[1]
    target = meshinit.optax.abstract(tx, plan, shard_over="data")
    assert jax.tree.map(lambda x: x.sharding, target) == out[1]
    print("one step kept every sharding; optax.abstract gives the same restore target")


if __name__ == "__main__":
    main()
