"""A Llama-style flax nnx model with logical axis rules, placed exactly by meshinit.

Every Param holds a spec that names logical axes (``vocab``, ``embed``, ``heads``,
``kv``, ``mlp``); one set of rules maps them to the mesh, the MaxText way. Change the
rules or the mesh and the same model lands elsewhere, with the same values.

Run: python examples/nnx_llama.py [--layers N] [--dim D]
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshinit  # noqa: E402

RULES = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("mlp", "tensor"),
)
lecun = jax.nn.initializers.lecun_normal
ones = jax.nn.initializers.ones


def p(shape, init, axes):
    return nnx.Param(meshinit.param(shape, init, axes=axes))


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int):
        self.q = p((d, heads * head_dim), lecun(), ("embed", "heads"))
        self.k = p((d, kv_heads * head_dim), lecun(), ("embed", "kv"))
        self.v = p((d, kv_heads * head_dim), lecun(), ("embed", "kv"))
        self.o = p((heads * head_dim, d), lecun(), ("heads", "embed"))


class Mlp(nnx.Module):
    def __init__(self, d: int, ffn: int):
        self.gate = p((d, ffn), lecun(), ("embed", "mlp"))
        self.up = p((d, ffn), lecun(), ("embed", "mlp"))
        self.down = p((ffn, d), lecun(), ("mlp", "embed"))


class Layer(nnx.Module):
    def __init__(self, d: int, ffn: int, heads: int, kv_heads: int):
        self.attn_norm = p((d,), ones, ("embed",))
        self.attn = Attention(d, heads, kv_heads, d // heads)
        self.mlp_norm = p((d,), ones, ("embed",))
        self.mlp = Mlp(d, ffn)


class Llama(nnx.Module):
    def __init__(self, layers: int, d: int, vocab: int):
        self.embed = p((vocab, d), lecun(), ("vocab", "embed"))
        self.layers = nnx.List([Layer(d, 4 * d, heads=8, kv_heads=4) for _ in range(layers)])
        self.norm = p((d,), ones, ("embed",))
        self.head = p((d, vocab), lecun(), ("embed", "vocab"))


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--layers", type=int, default=4)
    args.add_argument("--dim", type=int, default=256)
    args = args.parse_args()

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=mesh, rules=RULES):
        model = Llama(args.layers, args.dim, vocab=4096)  # specs only: nothing allocated
    plan = meshinit.plan(model)
    print(plan.summary())
    model = meshinit.nnx.materialize(model, jax.random.key(0))

    bad = 0
    for entry in plan.entries:
        param = model  # walk the path, "layers.0.attn.q.value", to the Param
        for name in entry.path.split(".")[:-1]:
            param = param[int(name)] if name.isdigit() else getattr(param, name)
        value = param.get_value()
        exact = value.sharding == entry.sharding
        bad += not exact
        if entry.path.startswith(("embed", "layers.0.", "head")):
            print(
                f"{entry.path:24s} {str(value.shape):14s} {str(value.sharding.spec):28s} "
                f"{'exact' if exact else 'WRONG'}"
            )
    q = np.asarray(model.layers[0].attn.q.get_value())
    print(
        f"layers.0.attn.q std {q.std():.4f} (lecun: 1/sqrt({args.dim}) = "
        f"{1 / np.sqrt(args.dim):.4f})"
    )
    ok = bad == 0 and abs(q.std() - 1 / np.sqrt(args.dim)) < 0.01
    ok = ok and bool(jnp.all(model.norm.get_value() == 1))
    print(f"{len(plan.entries) - bad}/{len(plan.entries)} placements exact")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
