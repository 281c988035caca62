"""Capacity planning for Llama-3-405B on 2048 devices, without a single device.

Planning works on an ``AbstractMesh``: it resolves every parameter's exact sharding and
per-device bytes, and allocates nothing. This plans the 405B parameter shapes in bf16
on a (data=16, fsdp=16, tensor=8) mesh twice: with the weights replicated across
``data`` (HSDP), then with ``embed`` sharded over ``fsdp`` and ``data`` together (full
FSDP), and prints each plan's summary: bytes per device, the most on one device, and
what replication across an axis that could shard the weights costs. Parameters only:
gradients, optimizer state and activations come on top.

Run: python examples/capacity_405b.py
"""

import math
import time

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

import meshinit

LAYERS, D, FFN, VOCAB = 126, 16384, 53248, 128256
Q_HEADS, KV_HEADS, HEAD_DIM = 128, 8, 128

HSDP = (
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
)
FSDP = (*HSDP[:-1], ("embed", ("fsdp", "data")))


def layer() -> dict:
    lecun, ones = jax.nn.initializers.lecun_normal(), jax.nn.initializers.ones
    q, kv = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        "attn": {
            "q": meshinit.param((D, q), lecun, axes=("embed", "heads")),
            "k": meshinit.param((D, kv), lecun, axes=("embed", "kv")),
            "v": meshinit.param((D, kv), lecun, axes=("embed", "kv")),
            "o": meshinit.param((q, D), lecun, axes=("heads", "embed")),
        },
        "mlp": {
            "gate": meshinit.param((D, FFN), lecun, axes=("embed", "mlp")),
            "up": meshinit.param((D, FFN), lecun, axes=("embed", "mlp")),
            "down": meshinit.param((FFN, D), lecun, axes=("mlp", "embed")),
        },
        "attn_norm": meshinit.param((D,), ones, axes=("embed",)),
        "mlp_norm": meshinit.param((D,), ones, axes=("embed",)),
    }


def specs(mesh: AbstractMesh | None, rules) -> dict:
    normal = jax.nn.initializers.normal(0.02)
    with meshinit.defaults(mesh=mesh, rules=rules, dtype=jnp.bfloat16):
        return {
            "embed": meshinit.param((VOCAB, D), normal, axes=("vocab", "embed")),
            "layers": [layer() for _ in range(LAYERS)],
            "norm": meshinit.param((D,), jax.nn.initializers.ones, axes=("embed",)),
            "head": meshinit.param((D, VOCAB), normal, axes=("embed", "vocab")),
        }


def model() -> dict:
    """The FSDP specs with no mesh of their own, for the command line to supply one:

    meshinit plan examples/capacity_405b.py:model --abstract-mesh data=16,fsdp=16,tensor=8
    """
    return specs(None, FSDP)


def main() -> None:
    mesh = AbstractMesh(
        (16, 16, 8), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3
    )
    for name, rules in (("HSDP, embed -> fsdp", HSDP), ("FSDP, embed -> (fsdp, data)", FSDP)):
        start = time.perf_counter()
        tree = specs(mesh, rules)
        built = time.perf_counter() - start
        start = time.perf_counter()
        plan = meshinit.plan(tree)
        planned = time.perf_counter() - start
        start = time.perf_counter()
        most = plan.max_device_bytes
        counted = time.perf_counter() - start

        params = sum(math.prod(e.spec.shape) for e in plan.entries)
        print(f"== {name}: {params / 1e9:.1f}B params, {len(plan.entries)} specs, bf16")
        print(
            f"built the specs in {built:.3f} s, planned in {planned:.3f} s, "
            f"max_device_bytes in {counted:.3f} s"
        )
        print(plan.summary(), end="\n\n")

        # Every device of one mesh holds the same bytes: the shardings divide evenly.
        per_device = plan.bytes_per_device()
        assert len(per_device) == mesh.size == 2048
        assert set(per_device.values()) == {plan.groups[0].device_bytes} == {most}
        assert plan.nbytes == 2 * params
        if rules is HSDP:
            # Every weight is replicated across data=16, which could shard each of them.
            assert plan.groups[0].replicated_bytes == most
        else:
            # Only the norms stay replicated (across tensor), a few KiB per device.
            assert 0 < plan.groups[0].replicated_bytes < 2**20


if __name__ == "__main__":
    main()
