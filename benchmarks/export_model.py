"""``benchmarks/export.py``'s model: a scanned Llama-like stack in bf16, where its
arrays go on the ``(data=4, tensor=2)`` mesh, the export's ``names=`` (HF's Llama names,
a ``Stack`` per scanned array) and the tensors a Hugging Face checkpoint of it holds."""

from __future__ import annotations

# HF's Llama names of the scanned arrays; the norms are 1-D per layer (not transposed)
HF = {
    "layers.attn_norm": "input_layernorm",
    "layers.q": "self_attn.q_proj",
    "layers.k": "self_attn.k_proj",
    "layers.v": "self_attn.v_proj",
    "layers.o": "self_attn.o_proj",
    "layers.mlp_norm": "post_attention_layernorm",
    "layers.gate": "mlp.gate_proj",
    "layers.up": "mlp.up_proj",
    "layers.down": "mlp.down_proj",
}
NORMS = {"layers.attn_norm", "layers.mlp_norm"}


def layout(a) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Path -> (shape, PartitionSpec entries) of the scanned model."""
    n, d, q, kv = a.layers, a.d, a.heads * a.head_dim, a.kv_heads * a.head_dim
    m, t = ("data", "tensor"), ("tensor", "data")
    return {
        "embed": ((a.vocab, d), t),
        "layers.attn_norm": ((n, d), ()),
        "layers.q": ((n, d, q), (None, *m)),
        "layers.k": ((n, d, kv), (None, *m)),
        "layers.v": ((n, d, kv), (None, *m)),
        "layers.o": ((n, q, d), (None, *t)),
        "layers.mlp_norm": ((n, d), ()),
        "layers.gate": ((n, d, a.ffn), (None, *m)),
        "layers.up": ((n, d, a.ffn), (None, *m)),
        "layers.down": ((n, a.ffn, d), (None, *t)),
        "norm": ((d,), ()),
        "head": ((d, a.vocab), m),
    }


def model_bytes(a) -> int:
    return sum(2 * _prod(s) for s, _ in layout(a).values())


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def names(layers: int) -> dict:
    """The export's ``names=``: HF's Llama names, a Stack per scanned array."""
    from meshinit.safetensors import Stack, Tensor

    out: dict = {
        "embed": "model.embed_tokens.weight",
        "norm": "model.norm.weight",
        "head": Tensor("lm_head.weight", permute=(1, 0)),
    }
    for path, hf in HF.items():
        each = [f"model.layers.{i}.{hf}.weight" for i in range(layers)]
        out[path] = Stack([e if path in NORMS else Tensor(e, permute=(1, 0)) for e in each], 0)
    return out


def hf_tensors(whole: dict, layers: int) -> dict:
    """What the gather route writes: the same names and layouts, in numpy."""
    import numpy as np

    out = {
        "model.embed_tokens.weight": whole["embed"],
        "model.norm.weight": whole["norm"],
        "lm_head.weight": np.ascontiguousarray(whole["head"].T),
    }
    for path, hf in HF.items():
        for i in range(layers):
            x = whole[path][i]
            out[f"model.layers.{i}.{hf}.weight"] = np.ascontiguousarray(x if x.ndim == 1 else x.T)
    return out


# ------------------------------------------------------------------------ the server


def make(a, mesh) -> dict:
    """The model's arrays: each device's block drawn from a seed of its path and
    index (so that replicas agree across processes), made on its own process."""
    import zlib

    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def block(path, index, shape):
        start = [s.start or 0 for s in index] if index else []
        seed = zlib.crc32(f"{path}{start}".encode())
        n = [len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True)]
        x = np.random.default_rng(seed).standard_normal(n, np.float32) * 0.02
        return x.astype(ml_dtypes.bfloat16)

    return {
        path: jax.make_array_from_callback(
            shape, NamedSharding(mesh, P(*spec)), lambda i, p=path, s=shape: block(p, i, s)
        )
        for path, (shape, spec) in layout(a).items()
    }
