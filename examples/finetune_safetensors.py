"""Fine-tuning's init: base weights from Hugging Face safetensors, a new head made, one plan.

A small Llama-style flax nnx model (unchanged nnx code with flax sharding metadata)
is split over two pipeline stages on disjoint devices. Its base weights come from a
sharded safetensors checkpoint with Hugging Face names, torch's ``(out, in)`` layout
and attention stored flat; the new head is not in the files. One plan drives both:

1. ``meshinit.safetensors.load`` reads each base weight straight onto its planned
   sharding, renamed, reshaped and transposed, reading only each shard's bytes;
2. ``meshinit.nnx.init(factory, existing=loaded)`` makes only the head.

The checkpoint is written first, from an eager model, so the script checks itself.

Run: python examples/finetune_safetensors.py [directory]
"""

import sys
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import meshinit  # noqa: E402
from meshinit.safetensors import Tensor  # noqa: E402

D, HEADS, HEAD_DIM, MLP, VOCAB, LAYERS = 64, 4, 16, 256, 512, 4
lecun = nnx.initializers.lecun_normal()


class Layer(nnx.Module):
    def __init__(self, rngs):
        qkv = ("fsdp", "tensor", None)  # (embed, heads, head_dim)
        self.q = nnx.Param(lecun(rngs.params(), (D, HEADS, HEAD_DIM)), out_sharding=qkv)
        up = nnx.with_partitioning(lecun, ("fsdp", "tensor"))
        down = nnx.with_partitioning(lecun, ("tensor", "fsdp"))
        self.up = nnx.Linear(D, MLP, use_bias=False, kernel_init=up, rngs=rngs)
        self.down = nnx.Linear(MLP, D, use_bias=False, kernel_init=down, rngs=rngs)
        self.norm = nnx.RMSNorm(D, rngs=rngs)


class Llama(nnx.Module):
    def __init__(self, rngs, classes=None):
        embed = nnx.with_partitioning(nnx.initializers.normal(0.02), ("tensor", "fsdp"))
        self.embed = nnx.Embed(VOCAB, D, embedding_init=embed, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(LAYERS)])
        if classes:  # the fine-tuning head: new, not in the checkpoint
            head = nnx.with_partitioning(lecun, ("fsdp", None))
            self.head = nnx.Linear(D, classes, kernel_init=head, rngs=rngs)


# nnx path -> Hugging Face tensor: the first rule that matches the whole path wins,
# and \1, \2 in a name are its groups. The MLP is stored (out, in), q flat.
HF_NAMES = [
    (r"embed\.embedding", "model.embed_tokens.weight"),
    (  # (heads * head_dim, embed) -> (embed, heads, head_dim)
        r"layers\.(\d+)\.q",
        Tensor(
            r"model.layers.\1.self_attn.q_proj.weight",
            shape=(HEADS, HEAD_DIM, D),
            permute=(2, 0, 1),
        ),
    ),
    (
        r"layers\.(\d+)\.(up|down)\.kernel",
        Tensor(r"model.layers.\1.mlp.\2_proj.weight", permute=(1, 0)),
    ),
    (r"layers\.(\d+)\.norm\.scale", r"model.layers.\1.input_layernorm.weight"),
    (r"head\..*", None),  # the new head: not in the files, made by the init
]


def write_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    """A pretrained model's weights, as Hugging Face stores them, in two files."""
    with nnx.use_eager_sharding(False):
        base = Llama(nnx.Rngs(7))
    tensors = {"model.embed_tokens.weight": np.asarray(base.embed.embedding[...])}
    for i, layer in enumerate(base.layers):
        p = f"model.layers.{i}"
        q = np.asarray(layer.q[...]).transpose(1, 2, 0).reshape(HEADS * HEAD_DIM, D)
        tensors[f"{p}.self_attn.q_proj.weight"] = q
        tensors[f"{p}.mlp.up_proj.weight"] = np.asarray(layer.up.kernel[...]).T
        tensors[f"{p}.mlp.down_proj.weight"] = np.asarray(layer.down.kernel[...]).T
        tensors[f"{p}.input_layernorm.weight"] = np.asarray(layer.norm.scale[...])
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, str(directory / f"model-{i + 1}-of-2.safetensors"))
    return {
        "embed.embedding": tensors["model.embed_tokens.weight"],
        "layers.3.up.kernel": tensors["model.layers.3.mlp.up_proj.weight"].T,
    }


def main(directory: Path) -> None:
    want = write_checkpoint(directory)
    devices = np.array(jax.devices())
    stage0 = Mesh(devices[:4].reshape(2, 2), ("fsdp", "tensor"))
    stage1 = Mesh(devices[4:].reshape(2, 2), ("fsdp", "tensor"))
    stages = [(r"embed\..*|layers\.[01]\..*", stage0), (r".*", stage1)]

    def factory():
        return Llama(nnx.Rngs(0), classes=10)

    plan = meshinit.nnx.plan(factory, meshes=stages)
    loaded = meshinit.safetensors.load(plan, directory, names=HF_NAMES)
    model = meshinit.nnx.init(factory, meshes=stages, existing=loaded)

    assert set(loaded) == {e.path for e in plan.entries} - {"head.kernel", "head.bias"}
    up = model.layers[3].up.kernel[...]
    assert up.sharding.mesh == stage1 and up is loaded["layers.3.up.kernel"]
    assert np.array_equal(np.asarray(up), want["layers.3.up.kernel"])
    assert np.array_equal(np.asarray(model.embed.embedding[...]), want["embed.embedding"])
    assert model.embed.embedding[...].sharding.mesh == stage0
    head = model.head.kernel[...]
    full = meshinit.nnx.init(factory, meshes=stages)  # the head is what a full init makes
    assert np.asarray(head).tobytes() == np.asarray(full.head.kernel[...]).tobytes()
    print(f"loaded {len(loaded)} base weights from {directory}, made the head:")
    print(f"  layers.3.up.kernel {up.shape} on {up.sharding.spec}, devices 4-7")
    print(f"  head.kernel {head.shape} on {head.sharding.spec}, devices 4-7")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
