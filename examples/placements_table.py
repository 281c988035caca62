"""A model with no sharding metadata, placed by a rule table kept beside it.

EasyDeL, t5x and many in-house trainers keep a model's sharding out of its code, in a
table of ``(path regex, PartitionSpec)`` rules. The Llama-like nnx Module below carries
no sharding metadata at all; the table, EasyDeL's Llama rules adapted to meshinit's
dot-joined, full-matched paths, places it with ``placements=``: on one
(fsdp, sp, tp) mesh, then split over two pipeline stages on disjoint devices with
``meshes=`` and the same table.

Every Variable is checked: on its table entry's PartitionSpec and mesh, its metadata
saying so (``nnx.get_partition_spec``), and its bits those of the same Module
initialized without a table (a placement moves a value, never changes it).

Run: python examples/placements_table.py [--layers N]
"""

import argparse
import re
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshinit  # noqa: E402


def linear(d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, rngs=rngs)  # no sharding metadata


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, rngs: nnx.Rngs):
        head_dim = d // heads
        self.q_proj = linear(d, heads * head_dim, rngs)
        self.k_proj = linear(d, kv_heads * head_dim, rngs)
        self.v_proj = linear(d, kv_heads * head_dim, rngs)
        self.o_proj = linear(heads * head_dim, d, rngs)


class Mlp(nnx.Module):
    def __init__(self, d: int, ffn: int, rngs: nnx.Rngs):
        self.gate_proj = linear(d, ffn, rngs)
        self.up_proj = linear(d, ffn, rngs)
        self.down_proj = linear(ffn, d, rngs)


class Layer(nnx.Module):
    def __init__(self, d: int, ffn: int, rngs: nnx.Rngs):
        self.self_attn = Attention(d, 8, 4, rngs)
        self.mlp = Mlp(d, ffn, rngs)
        self.input_layernorm = nnx.RMSNorm(d, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(d, rngs=rngs)


class Llama(nnx.Module):
    def __init__(
        self, layers: int, rngs: nnx.Rngs, d: int = 256, ffn: int = 512, vocab: int = 1024
    ):
        self.embed_tokens = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([Layer(d, ffn, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.lm_head = linear(d, vocab, rngs)


# EasyDeL 0.3.0's Llama rules ('/'-joined paths, re.search), as meshinit reads a table:
# dot-joined paths, each regex full-matched, the first match winning. (EasyDeL's own
# rules go in unchanged as placements=meshinit.searched(rules): docs/nnx.md.)
FSDP = ("fsdp", "sp")
PLACEMENTS = [
    (r"embed_tokens\.embedding", P(FSDP, "tp")),
    (r".*self_attn\.(q_proj|k_proj|v_proj)\.kernel", P(FSDP, "tp")),
    (r".*self_attn\.o_proj\.kernel", P("tp", FSDP)),
    (r".*mlp\.(gate_proj|up_proj)\.kernel", P(FSDP, "tp")),
    (r".*mlp\.down_proj\.kernel", P("tp", FSDP)),
    (r".*(input_layernorm|post_attention_layernorm)\.scale", P(None)),
    (r"norm\.scale", P(None)),
    (r"lm_head\.kernel", P(FSDP, "tp")),
    (r".*", P(None)),
]


def expected(path: str) -> P:
    return next(spec for regex, spec in PLACEMENTS if re.fullmatch(regex, path))


def check(model: nnx.Module, unplaced: dict, mesh_of) -> int:
    """Every Variable where its table entry says, its metadata saying so, its bits kept."""
    specs = nnx.to_flat_state(nnx.get_partition_spec(nnx.state(model)))
    said = {".".join(map(str, p)): v.get_value() for p, v in specs}
    count = 0
    for keypath, var in nnx.to_flat_state(nnx.state(model)):
        path = ".".join(map(str, keypath))
        value = var.get_value()
        want = NamedSharding(mesh_of(path), expected(path))
        assert value.sharding == want, (path, value.sharding, want)
        assert said[path] == expected(path), (path, said[path])
        assert np.asarray(value).tobytes() == unplaced[path].tobytes(), path
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    def factory():
        return Llama(args.layers, rngs=nnx.Rngs(0))

    bare = meshinit.nnx.init(factory)  # no table: every Variable on the default device
    unplaced = {
        ".".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(bare))
    }
    del bare

    mesh = jax.make_mesh((2, 1, 4), ("fsdp", "sp", "tp"))
    print(meshinit.nnx.plan(factory, placements=PLACEMENTS, mesh=mesh).compact())
    start = time.perf_counter()
    model = meshinit.nnx.init(factory, placements=PLACEMENTS, mesh=mesh)
    seconds = time.perf_counter() - start
    n = check(model, unplaced, lambda _: mesh)
    print(f"one mesh: {n} Variables placed by the table in {seconds:.2f} s, each checked")

    devices = jax.devices()
    stage0 = jax.make_mesh((2, 1, 2), ("fsdp", "sp", "tp"), devices=devices[:4])
    stage1 = jax.make_mesh((2, 1, 2), ("fsdp", "sp", "tp"), devices=devices[4:])
    first = "|".join(str(i) for i in range((args.layers + 1) // 2))
    meshes = [(rf"embed_tokens\..*|layers\.({first})\..*", stage0), (r".*", stage1)]

    def stage(path: str):
        return stage0 if re.fullmatch(meshes[0][0], path) else stage1

    staged = meshinit.nnx.init(factory, placements=PLACEMENTS, meshes=meshes)
    n = check(staged, unplaced, stage)
    for path, value in (
        ("embed_tokens.embedding", staged.embed_tokens.embedding.get_value()),
        ("lm_head.kernel", staged.lm_head.kernel.get_value()),
    ):
        print(path, value.sharding.spec, "on devices", sorted(d.id for d in value.devices()))
    print(f"two stages: {n} Variables placed by the same table, each checked")


if __name__ == "__main__":
    main()
