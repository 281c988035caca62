"""Pipeline stages on disjoint devices, initialized in one call.

One jit cannot output to meshes over different devices ("incompatible devices"), so a
model split into stages usually needs a hand-written init per stage. With meshinit,
each stage is a mesh group: one compiled program per stage, the stages' layers share
their compiled work, and values do not depend on where a layer lives.

Run: python examples/pipeline_stages.py
"""

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 8)

import meshinit  # noqa: E402

RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("norm", None))


def layer():
    lecun = jax.nn.initializers.lecun_normal
    return {
        "attn": {
            "qkv": meshinit.param((512, 3 * 512), lecun(), axes=("embed", "heads")),
            "out": meshinit.param((512, 512), lecun(), axes=("heads", "embed")),
        },
        "mlp": {
            "up": meshinit.param((512, 2048), lecun(), axes=("embed", "mlp")),
            "down": meshinit.param((2048, 512), lecun(), axes=("mlp", "embed")),
        },
        "norm": meshinit.param((512,), jax.nn.initializers.ones, axes=("norm",)),
    }


def main() -> None:
    devices = jax.devices()
    stages = [
        jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[4 * s : 4 * s + 4])
        for s in range(2)
    ]
    layers_per_stage = 4
    specs = {"layers": []}
    for mesh in stages:
        with meshinit.defaults(mesh=mesh, rules=RULES):
            specs["layers"] += [layer() for _ in range(layers_per_stage)]
    plan = meshinit.plan(specs)
    print(plan, end="\n\n")
    params = meshinit.materialize(plan, 0)

    up = params["layers"][5]["mlp"]["up"]  # layer 5 lives on stage 1: devices 4-7
    print("layers.5.mlp.up on devices", sorted(d.id for d in up.devices()))
    # The value contract: the same path gives the same value, wherever it is placed.
    alone = meshinit.init(
        {
            "layers": {
                "5": {
                    "mlp": {
                        "up": meshinit.param(
                            (512, 2048),
                            jax.nn.initializers.lecun_normal(),
                            mesh=jax.make_mesh((1,), ("x",)),
                        )
                    }
                }
            }
        },
        0,
    )
    same = np.array_equal(up, alone["layers"]["5"]["mlp"]["up"])
    print("same value on one device:", same)
    assert same


if __name__ == "__main__":
    main()
