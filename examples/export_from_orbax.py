"""Export as its own step: an orbax checkpoint to Hugging Face safetensors, no training job.

What a trained model's owner runs after training, on any set of devices that holds the
model (the export of marin issue 6752, as a step of its own):

1. ``meshinit.nnx.plan(factory, mesh=...)`` plans the model without making it, and
   ``plan.abstract()`` is orbax's restore target: every array is read straight onto
   its planned sharding, whatever layout the training job saved it from;
2. ``meshinit.safetensors.save(restored, folder, names=HF_NAMES, ...)`` writes
   Hugging Face's files; under ``jax.distributed`` every process writes its own files
   of the export at once, and no host gathers the model;
3. the export is checked: ``meshinit.safetensors.load`` reads it back onto another
   layout (two pipeline stages), bit for bit what the training job saved (cast to
   bf16), and the ``safetensors`` package opens every file.

The training job's checkpoint is written first, from ``meshinit.nnx.init`` on a
(fsdp=2, tensor=4) mesh, so the script checks itself. The export step (``export``)
runs unchanged in every process of a jax.distributed job, after
``jax.distributed.initialize``, with a folder every process reaches or a ``gs://`` URL:
each process restores and writes only its own part.

Run: python examples/export_from_orbax.py [DIR]
     (DIR: a new or empty directory; without it, a temporary one, removed at exit)
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from safetensors import safe_open  # noqa: E402

import meshinit  # noqa: E402
from meshinit.safetensors import Tensor  # noqa: E402

VOCAB, D, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 512, 64, 4, 2, 16, 256, 4


def dense(d_in, d_out, axes, rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.q = dense(D, HEADS * HEAD_DIM, ("fsdp", "tensor"), rngs)
        self.k = dense(D, KV_HEADS * HEAD_DIM, ("fsdp", "tensor"), rngs)
        self.v = dense(D, KV_HEADS * HEAD_DIM, ("fsdp", "tensor"), rngs)
        self.o = dense(HEADS * HEAD_DIM, D, ("tensor", "fsdp"), rngs)


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.gate = dense(D, FFN, ("fsdp", "tensor"), rngs)
        self.up = dense(D, FFN, ("fsdp", "tensor"), rngs)
        self.down = dense(FFN, D, ("tensor", "fsdp"), rngs)


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.attn_norm = nnx.RMSNorm(D, rngs=rngs)
        self.attn = Attention(rngs)
        self.mlp_norm = nnx.RMSNorm(D, rngs=rngs)
        self.mlp = Mlp(rngs)


class Llama(nnx.Module):
    def __init__(self, rngs):
        embed = nnx.with_partitioning(nnx.initializers.normal(0.02), ("tensor", "fsdp"))
        self.embed = nnx.Embed(VOCAB, D, embedding_init=embed, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.lm_head = dense(D, VOCAB, ("fsdp", "tensor"), rngs)


def factory():
    return Llama(nnx.Rngs(0))


# plan path -> Hugging Face tensor, the table meshinit.safetensors.load reads (the first
# rule that matches the whole path wins; \1, \2 are its groups). Kernels are (in, out),
# torch's Linear stores (out, in): permute=(1, 0), which the export undoes.
HF_NAMES = [
    (r"embed\.embedding", "model.embed_tokens.weight"),
    (
        r"layers\.(\d+)\.attn\.(q|k|v|o)\.kernel",
        Tensor(r"model.layers.\1.self_attn.\2_proj.weight", permute=(1, 0)),
    ),
    (
        r"layers\.(\d+)\.mlp\.(gate|up|down)\.kernel",
        Tensor(r"model.layers.\1.mlp.\2_proj.weight", permute=(1, 0)),
    ),
    (r"layers\.(\d+)\.attn_norm\.scale", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.mlp_norm\.scale", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"norm\.scale", "model.norm.weight"),
    (r"lm_head\.kernel", Tensor("lm_head.weight", permute=(1, 0))),
]

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": D,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "rms_norm_eps": 1e-6,  # nnx.RMSNorm's default epsilon
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def train(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """The training job's side: a model made on its mesh, saved by orbax as training
    code saves it (``nnx.to_pure_dict`` of its state). Returns its values by path."""
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    model = meshinit.nnx.init(factory, mesh=mesh)
    with ocp.CheckpointManager(directory) as manager:
        manager.save(0, args=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model))))
        manager.wait_until_finished()
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in flat}


def export(checkpoints: pathlib.Path, folder: pathlib.Path) -> meshinit.safetensors.Export:
    """The export step: restore straight onto the plan's shardings, then write."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))  # any layout that holds the model
    plan = meshinit.nnx.plan(factory, mesh=mesh)  # nothing is made or compiled
    with ocp.CheckpointManager(checkpoints) as manager:
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.StandardRestore(plan.abstract()))
    leaves = jax.tree_util.tree_leaves(restored)
    wrong = [e.path for e in plan.entries if leaves[e.leaf_index].sharding != e.sharding]
    assert not wrong, f"restored off their planned shardings: {wrong}"
    print(f"restored step {step}: {len(plan.entries)} arrays, each on its planned sharding")
    return meshinit.safetensors.save(
        restored,
        folder,
        names=HF_NAMES,
        dtype=jnp.bfloat16,
        max_shard_size="500KB",  # small files for a small model; default "5GB"
        config=HF_CONFIG,
    )


def check(folder: pathlib.Path, trained: dict[str, np.ndarray]) -> None:
    """Reads the export back onto two pipeline stages, and opens it with safetensors."""
    devices = np.array(jax.devices())
    stage0 = Mesh(devices[:4].reshape(2, 2), ("fsdp", "tensor"))
    stage1 = Mesh(devices[4:].reshape(2, 2), ("fsdp", "tensor"))
    stages = [(r"embed\..*|layers\.[01]\..*", stage0), (r".*", stage1)]
    plan = meshinit.nnx.plan(factory, meshes=stages)
    loaded = meshinit.safetensors.load(plan, folder, names=HF_NAMES, unused="error")
    differ = []
    for entry in plan.entries:
        value = loaded[entry.path]
        assert value.sharding == entry.sharding, entry.path
        want = trained[entry.path].astype(jnp.bfloat16).astype(np.float32)  # what bf16 keeps
        if np.asarray(value).tobytes() != want.tobytes():
            differ.append(entry.path)
    assert not differ, f"DIFFER after the round trip: {differ}"
    print(f"loaded back onto 2 stages: {len(plan.entries)}/{len(plan.entries)} bit for bit")

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    names, total = set(), 0
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / name), framework="flax") as f:  # the package's own checks
            assert f.metadata() == {"format": "pt"}, f.metadata()
            for key in f.keys():
                names.add(key)
                total += f.get_tensor(key).nbytes
    assert names == set(index["weight_map"]) and total == index["metadata"]["total_size"]
    with safe_open(str(folder / index["weight_map"]["lm_head.weight"]), framework="flax") as f:
        head = f.get_tensor("lm_head.weight")
    assert head.shape == (VOCAB, D) and head.dtype == jnp.bfloat16  # torch's (out, in)
    want = trained["lm_head.kernel"].T.astype(jnp.bfloat16)
    assert np.asarray(head).tobytes() == want.tobytes()
    print(f"safetensors opened {len(names)} tensors, {total} bytes, as the index lists them")


def run(directory: pathlib.Path) -> int:
    trained = train(directory / "checkpoints")
    folder = directory / "hf-export"
    report = export(directory / "checkpoints", folder)
    print(f"wrote {', '.join(report.files)}: {report.total_size} bytes of tensors")
    print(f"bytes written by each process: {list(report.bytes_by_process)}")
    check(folder, trained)
    return 0


def main(argv: list[str]) -> int:
    if argv:
        return run(pathlib.Path(argv[0]).resolve())  # orbax wants an absolute path
    with tempfile.TemporaryDirectory(prefix="meshinit-export-") as tmp:
        return run(pathlib.Path(tmp))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
