"""Cold init of the CPU reference model: meshinit against the jax.jit recipe.

Each case runs in a fresh process (no persistent compilation cache), the clock starts
after imports and mesh creation and stops when every array is ready; for meshinit it
includes building the specs and the plan. Best of ``--repeats`` processes per case.

The model: a Llama-style stack in f32 on a (fsdp=2, tensor=4) mesh of 8 simulated CPU
devices, rules vocab/heads/kv/mlp -> tensor, embed -> fsdp; 8 distinct signatures.

Run: python benchmarks/cold_init.py [--layers 8 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

RULES = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("mlp", "tensor"),
)
LAYER = {
    "q": ((256, 256), ("embed", "heads")),
    "k": ((256, 64), ("embed", "kv")),
    "v": ((256, 64), ("embed", "kv")),
    "o": ((256, 256), ("heads", "embed")),
    "gate": ((256, 1024), ("embed", "mlp")),
    "up": ((256, 1024), ("embed", "mlp")),
    "down": ((1024, 256), ("mlp", "embed")),
    "n1": ((256,), ("embed",)),
    "n2": ((256,), ("embed",)),
}


def case(recipe: str, layers: int) -> float:
    import time

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshinit

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    lecun, ones = jax.nn.initializers.lecun_normal, jax.nn.initializers.ones

    def init_of(name):
        return ones if name.startswith("n") else lecun()

    start = time.perf_counter()
    if recipe == "meshinit":
        with meshinit.defaults(mesh=mesh, rules=RULES):

            def p(shape, axes, init):
                return meshinit.param(shape, init, axes=axes)

            specs = {
                "embed": p((4096, 256), ("vocab", "embed"), lecun()),
                "layers": [
                    {n: p(s, a, init_of(n)) for n, (s, a) in LAYER.items()} for _ in range(layers)
                ],
                "head": p((256, 4096), ("embed", "vocab"), lecun()),
            }
        out = meshinit.materialize(meshinit.plan(specs), jax.random.key(0))
    elif recipe == "jax.jit":  # MaxText: one jit, every parameter an output

        def spec_of(axes):
            return NamedSharding(mesh, P(*meshinit.logical_to_mesh_axes(axes, RULES)))

        shapes = {
            "embed": ((4096, 256), ("vocab", "embed")),
            "layers": [dict(LAYER) for _ in range(layers)],
            "head": ((256, 4096), ("embed", "vocab")),
        }
        is_leaf = lambda x: isinstance(x, tuple) and isinstance(x[0], tuple)  # noqa: E731
        shardings = jax.tree.map(lambda x: spec_of(x[1]), shapes, is_leaf=is_leaf)

        def build(key):
            leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_leaf)
            keys = jax.random.split(key, len(leaves))
            # flatten order: dict keys sorted, so embed, head, then each layer's names
            names = ["embed", "head", *[n for _ in range(layers) for n in sorted(LAYER)]]
            vals = [
                init_of(n)(k, s, jnp.float32)
                for n, k, (s, _) in zip(names, keys, leaves, strict=True)
            ]
            return jax.tree.unflatten(treedef, vals)

        out = jax.jit(build, out_shardings=shardings)(jax.random.key(0))
    else:
        raise ValueError(recipe)
    jax.block_until_ready(out)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--recipes", nargs="+", default=["meshinit", "jax.jit"])
    ap.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(case(args.case[0], int(args.case[1]))))
        return
    results = {}
    for layers in args.layers:
        for recipe in args.recipes:
            times = []
            for _ in range(args.repeats):
                r = subprocess.run(
                    [sys.executable, __file__, "--case", recipe, str(layers)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                times.append(json.loads(r.stdout.strip().splitlines()[-1]))
            results[(recipe, layers)] = min(times)
            print(f"{recipe:10s} layers={layers:3d}  cold {min(times):7.2f} s", flush=True)
    for layers in args.layers:
        if ("jax.jit", layers) in results and ("meshinit", layers) in results:
            ratio = results[("meshinit", layers)] / results[("jax.jit", layers)]
            print(f"layers={layers}: meshinit / jax.jit = {ratio:.2f}")
    if len(args.layers) > 1 and all(("meshinit", n) in results for n in args.layers):
        lo, hi = min(args.layers), max(args.layers)
        print(
            f"meshinit depth ratio {hi}/{lo} layers = "
            f"{results[('meshinit', hi)] / results[('meshinit', lo)]:.2f}"
        )


if __name__ == "__main__":
    main()
