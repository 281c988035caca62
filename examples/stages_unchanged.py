"""An unchanged flax nnx model split into two pipeline stages, in one call.

The model below is ordinary nnx code written for one (fsdp, tensor) mesh: its layers
are ``nnx.Linear``, ``nnx.Embed`` and ``nnx.RMSNorm`` with ``out_sharding`` metadata,
its values come from its own ``nnx.Rngs``. Nothing in it knows about stages. One
``meshes=`` argument puts the embedding and the first half of the layers on devices
0-3 and the rest on devices 4-7, each stage a (fsdp=2, tensor=2) mesh, where one
``nnx.jit`` cannot output to both ("incompatible devices").

``meshinit.nnx.plan`` previews the placement first (nothing compiled or allocated);
``meshinit.nnx.init`` then builds the model: traced once, and each weight's own
computation compiled once per (stage, computation, sharding), so a stage compiles the
same programs for 2 layers as for 20. The values are those of eager construction.

Run: python examples/stages_unchanged.py [--layers N]
"""

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshinit  # noqa: E402

lecun = nnx.initializers.lecun_normal()


def linear(d_in: int, d_out: int, axes: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        kernel_init=lecun,
        kernel_metadata={"out_sharding": axes},
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, rngs: nnx.Rngs):
        head_dim = d // heads
        self.q = linear(d, heads * head_dim, ("fsdp", "tensor"), rngs)
        self.k = linear(d, kv_heads * head_dim, ("fsdp", "tensor"), rngs)
        self.v = linear(d, kv_heads * head_dim, ("fsdp", "tensor"), rngs)
        self.o = linear(heads * head_dim, d, ("tensor", "fsdp"), rngs)
        self.q_norm = nnx.RMSNorm(head_dim, rngs=rngs)  # no sharding metadata: replicated


class Mlp(nnx.Module):
    def __init__(self, d: int, ffn: int, rngs: nnx.Rngs):
        self.gate = linear(d, ffn, ("fsdp", "tensor"), rngs)
        self.up = linear(d, ffn, ("fsdp", "tensor"), rngs)
        self.down = linear(ffn, d, ("tensor", "fsdp"), rngs)


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(d, scale_metadata={"out_sharding": P()}, rngs=rngs)
        self.attn = Attention(d, heads=8, kv_heads=4, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, scale_metadata={"out_sharding": P()}, rngs=rngs)
        self.mlp = Mlp(d, 4 * d, rngs)


class Llama(nnx.Module):
    def __init__(self, layers: int, d: int, vocab: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(
            vocab, d, embedding_metadata={"out_sharding": ("tensor", "fsdp")}, rngs=rngs
        )
        self.layers = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = linear(d, vocab, ("fsdp", "tensor"), rngs)


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--layers", type=int, default=4)
    args = args.parse_args()
    n, half = args.layers, args.layers // 2

    devices = jax.devices()
    stage0 = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[:4])
    stage1 = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=devices[4:])
    first = "|".join(str(i) for i in range(half))
    meshes = [
        (rf"embed\..*|layers\.({first})\..*", stage0),  # the first half, and the embedding
        (r".*", stage1),  # everything else: the second half, the final norm, the head
    ]

    def factory():
        return Llama(n, 256, vocab=4096, rngs=nnx.Rngs(0))

    print(meshinit.nnx.plan(factory, meshes=meshes).compact())  # nothing compiled
    start = time.perf_counter()
    model = meshinit.nnx.init(factory, meshes=meshes)
    jax.block_until_ready(nnx.state(model))
    print(f"\ninit: {time.perf_counter() - start:.2f} s")

    # What eager nnx would make, on one device, to compare the values with.
    with nnx.use_eager_sharding(False):
        reference = dict(nnx.to_flat_state(nnx.state(factory())))

    shown = {"embed.embedding", "head.kernel"}  # and the q of the layers either side of the cut
    shown |= {
        f"layers.{i}.attn.{w}" for i in (half - 1, half) for w in ("q.kernel", "q_norm.scale")
    }
    bad = 0
    flat = list(nnx.to_flat_state(nnx.state(model)))
    for path, var in flat:
        name = ".".join(map(str, path))
        value = var.get_value()
        in_first = path[0] == "embed" or (path[0] == "layers" and int(path[1]) < half)
        want = stage0 if in_first else stage1
        # The sharding the metadata names, on the stage's mesh; none (or P()) is replicated.
        axes = P(*(var.get_metadata().get("out_sharding") or ()))
        exact = value.sharding.mesh == want and value.sharding.is_equivalent_to(
            NamedSharding(want, axes), value.ndim
        )
        same = np.array_equal(np.asarray(value), np.asarray(reference[path].get_value()))
        bad += not (exact and same)
        if name in shown:
            ids = ",".join(str(i) for i in sorted(d.id for d in value.sharding.device_set))
            print(
                f"{name:28s} devices {ids:8s} {str(value.sharding.spec):22s} "
                f"{'exact' if exact else 'WRONG'}, {'values as eager' if same else 'VALUES DIFFER'}"
            )
    print(f"{len(flat) - bad}/{len(flat)} Variables on their stage's mesh, values as eager nnx")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
