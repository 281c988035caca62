"""What one launch of a multi-device executable costs on simulated CPU devices.

The same work, 64 parameters of one lecun_normal signature on the reference mesh, made
by ``64 / n`` launches of an executable that makes ``n`` of them (unrolled, the way
meshinit's rounds make one of each signature per launch). Interleaved: each repeat
runs every ``n`` once, so drifting load hits them alike; best of ``--repeats``. Shows
wall time, the process's CPU time and the executable's compile time.

Also, for contrast, the same number of elements made by single-device executables,
one per device shard, round-robin over the 8 devices: XLA's CPU client runs the
launches of a multi-device executable one at a time, each waiting until the previous
one has finished on every device, and single-device launches are not held that way.
(Those shards' values differ from the sharded parameter's: only the work is the same.)

Run: python benchmarks/launches.py [--outputs 1 2 4] [--params 64] [--repeats 9]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from harness import setup_cpu
from models import mesh_axes

SHAPE = (256, 1024)
AXES = ("embed", "mlp")


def _multi_device(mesh: Any, n: int, launches: int) -> tuple[Any, list[Any], float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshinit._run.compile import auto_twin, compile_lowered

    auto = auto_twin(mesh)
    init = jax.nn.initializers.lecun_normal()
    out = NamedSharding(auto, P(*mesh_axes(AXES)))
    rep = NamedSharding(auto, P())

    def program(keys):
        return [init(jax.random.wrap_key_data(keys[i]), SHAPE, jnp.float32) for i in range(n)]

    start = time.perf_counter()
    with jax.set_mesh(auto):
        lowered = jax.jit(program, out_shardings=[out] * n).lower(
            jax.ShapeDtypeStruct((n, 2), np.uint32, sharding=rep)
        )
    exe = compile_lowered(lowered, mesh)
    seconds = time.perf_counter() - start
    rng = np.random.default_rng(n)
    args = [
        jax.device_put(rng.integers(0, 2**32, (n, 2), dtype=np.uint32), rep)
        for _ in range(launches)
    ]
    return exe, args, seconds


def _single_device(mesh: Any, launches: int) -> tuple[list[Any], list[Any]]:
    """One executable per device making a shard-sized array; ``launches`` per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    init = jax.nn.initializers.lecun_normal()
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    shard = (SHAPE[0] // fsdp, SHAPE[1] // tensor)
    exes, args = [], []
    for d in mesh.devices.flat:
        struct = jax.ShapeDtypeStruct(
            (2,), np.uint32, sharding=jax.sharding.make_single_device_sharding(d)
        )
        exes.append(
            jax.jit(lambda k: init(jax.random.wrap_key_data(k), shard, jnp.float32))
            .lower(struct)
            .compile()
        )
        keys = np.random.default_rng(d.id).integers(0, 2**32, (launches, 2), dtype=np.uint32)
        args.append([jax.device_put(k, d) for k in keys])
    return exes, args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--params", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    for n in args.outputs:
        if n < 1 or args.params % n:
            parser.error(f"--outputs {n}: must be positive and divide --params {args.params}")

    import jax

    mesh = setup_cpu()
    jax.jit(lambda x: x + 1).lower(1.0).compile()  # the first compile pays XLA's start-up
    cases: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    for n in args.outputs:
        exe, keys, compile_s[f"{n}"] = _multi_device(mesh, n, args.params // n)
        cases[f"{n}"] = lambda exe=exe, keys=keys: [exe(k) for k in keys]
    exes, keys = _single_device(mesh, args.params)
    cases["single"] = lambda: [
        exes[d](k) for per in zip(*keys, strict=True) for d, k in enumerate(per)
    ]

    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeats):
        for name, run in cases.items():
            cpu, wall = time.process_time(), time.perf_counter()
            out = jax.block_until_ready(run())
            took = (time.perf_counter() - wall, time.process_time() - cpu)
            del out
            best[name] = min(best.get(name, took), took)

    mib = args.params * SHAPE[0] * SHAPE[1] * 4 / 2**20
    devices = mesh.devices.size
    print(
        f"{args.params} x lecun_normal{list(SHAPE)} f32 ({mib:.0f} MiB) on {devices} CPU "
        f"devices, best of {args.repeats} (interleaved)\n"
    )
    print("| launches | params per launch | wall | CPU time | CPU / wall | wall ms/MiB | compile |")
    print("|---|---|---|---|---|---|---|")
    for name, (wall, cpu) in best.items():
        if name == "single":
            launches = f"{args.params * devices} single-device"
            per, comp = "1 shard", ""
        else:
            launches, per = str(args.params // int(name)), name
            comp = f"{compile_s[name]:.2f} s"
        print(
            f"| {launches} | {per} | {wall * 1e3:.0f} ms | {cpu * 1e3:.0f} ms | "
            f"{cpu / wall:.2f} | {wall * 1e3 / mib:.2f} | {comp} |"
        )


if __name__ == "__main__":
    main()
