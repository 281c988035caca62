"""Per-device bytes of Adam's state with and without ``shard_over``, and offloaded.

The reference Llama-style stack (``models.Model``) with its weights sharded as the
suite's rules say over ``fsdp`` and ``tensor`` and replicated over ``data`` (DDP/HSDP),
on an 8-device CPU mesh (data=2, fsdp=2, tensor=2) by default. For each placement of
``optax.adam``'s state made by ``meshinit.optax.init``, the bytes each device holds,
read from the arrays' addressable shards (exact, not timed): as the parameters,
``shard_over="data"`` (ZeRO-1), and ``memory_kind="pinned_host"`` (device and host
memory apart). Also the time of each ``init``, as a ratio to the first; the machine
is shared, so times are noisy.

Run: python benchmarks/state_bytes.py [--layers 8] [--mesh 2 2 2] [--smoke]
"""

from __future__ import annotations

import argparse
import time

import jax
import models
import recipes

MESH_AXES = ("data", "fsdp", "tensor")


def per_device(tree, kind: str) -> dict[int, int]:
    """Bytes per device id of the arrays of ``tree`` that live in memory ``kind``."""
    out: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        if x.sharding.memory_kind != kind:
            continue
        for shard in x.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--mesh", type=int, nargs=3, default=(2, 2, 2), metavar="N")
    parser.add_argument("--smoke", action="store_true", help="2 layers, for CI")
    args = parser.parse_args()
    layers = 2 if args.smoke else args.layers
    devices = args.mesh[0] * args.mesh[1] * args.mesh[2]
    jax.config.update("jax_num_cpu_devices", devices)

    import optax

    import meshinit
    import meshinit.optax

    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh(tuple(args.mesh), MESH_AXES, axis_types=auto)
    model = models.Model.cpu(layers)
    with meshinit.defaults(replicated="data"):  # replicated over data on purpose
        specs = recipes.meshinit_specs(model, mesh)
    plan = meshinit.plan(specs)
    params = meshinit.materialize(plan, 0)
    tx = optax.adam(1e-3)

    cases = {
        "as the parameters": {},
        'shard_over="data" (ZeRO-1)': {"shard_over": "data"},
        'memory_kind="pinned_host"': {"memory_kind": "pinned_host"},
    }
    rows, first = [], None
    for name, options in cases.items():
        meshinit.optax.init(tx, params, **options)  # compile once, outside the clock
        start = time.perf_counter()
        state = jax.block_until_ready(meshinit.optax.init(tx, params, **options))
        seconds = time.perf_counter() - start
        first = first or seconds
        device = per_device(state, "device")
        host = per_device(state, "pinned_host")
        rows.append((name, max(device.values(), default=0), max(host.values(), default=0), seconds))
        jax.tree.map(lambda x: x.delete(), state)
    params_bytes = max(per_device(params, "device").values())
    base = rows[0][1]
    print(
        f"Adam state per device, {layers}-layer reference stack "
        f"({model.nbytes / 2**20:.1f} MiB of f32 parameters), mesh "
        f"{dict(zip(MESH_AXES, args.mesh, strict=True))}, parameters replicated over data: "
        f"{params_bytes / 2**20:.2f} MiB of parameters per device\n"
    )
    print("| state placement | device memory per device | / as the parameters | "
          "pinned_host per device | init time / first |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, device, host, seconds in rows:
        print(
            f"| {name} | {device / 2**20:.2f} MiB | {device / base:.3f} | "
            f"{host / 2**20:.2f} MiB | {seconds / first:.2f} |"
        )
    zero1 = rows[1][1]
    assert zero1 < base, "shard_over='data' must shrink the state on each device"
    assert rows[2][1] < 2**10 and rows[2][2] == base - rows[2][1], "offloaded: all but the count"


if __name__ == "__main__":
    main()
