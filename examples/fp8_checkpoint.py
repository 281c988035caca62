"""An FP8 checkpoint (DeepSeek-V3/R1, Kimi K2, Qwen3-FP8 style) loaded onto a mesh.

Such a checkpoint stores each linear weight as ``float8_e4m3fn`` with a float32
``<name>_scale_inv`` beside it, one scale per 128x128 block, and its ``config.json``
says ``quantization_config: {quant_method: "fp8", weight_block_size: [128, 128]}``.

1. ``meshinit.safetensors.save(..., quantize="fp8")`` writes one from sharded float32
   weights (DeepGEMM's ``per_block_cast_to_fp8``), ``config.json`` included.
2. ``meshinit.safetensors.load`` reads it back dequantized onto a (2, 4) mesh: each
   device reads only its float8 bytes and the scales that cover them.
3. Each value is checked bit for bit against DeepSeek's ``weight_dequant``, computed
   here with numpy from the file's bytes: ``bf16(float32(w) * scale)``.

Where ``config.json`` is read from: beside the files. A folder given to ``load``: the
folder's ``config.json``; a file, or a list of files: the folder of the (first) file;
an ``s3://``, ``gs://`` or ``hf://`` folder: its ``config.json`` object. The load
consults it only where it must (float8 or MXFP4 weights, a framework's map), and a
``weight_block_size`` there that the scales' shapes contradict is refused, shown last.

Run: python examples/fp8_checkpoint.py [directory]
"""

import json
import sys
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshinit  # noqa: E402
import meshinit.safetensors  # noqa: E402

# Shapes that 128 does not divide: the last blocks are ragged, as in real checkpoints.
D, MLP, LAYERS = 320, 384, 2
# plan path -> Hugging Face tensor; the kernels are (in, out), torch stores (out, in)
NAMES = [
    (
        r"layers\.(\d+)\.(up|down)",
        meshinit.safetensors.Tensor(r"model.layers.\1.mlp.\2_proj.weight", permute=(1, 0)),
    ),
    (r"norm", "model.norm.weight"),
]


def write(folder: Path, mesh) -> None:
    """The pretrained model, float32 on the mesh, saved as an FP8 release."""
    rng = np.random.default_rng(0)
    stored = {"model.norm.weight": rng.standard_normal(D, np.float32)}
    for i in range(LAYERS):
        stored[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((MLP, D), np.float32)
        stored[f"model.layers.{i}.mlp.down_proj.weight"] = rng.standard_normal((D, MLP), np.float32)
    arrays = {
        name: jax.device_put(w, NamedSharding(mesh, P(*("fsdp", "tensor")[: w.ndim])))
        for name, w in stored.items()
    }
    config = {"model_type": "llama", "hidden_size": D, "intermediate_size": MLP}
    meshinit.safetensors.save(arrays, folder, quantize="fp8", config=config, overwrite=True)


def read_stored(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, with numpy and ml_dtypes: an 8-byte header
    length, a JSON header, then the bytes (the safetensors package's numpy reader
    has no float8)."""
    dtypes = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "BF16": ml_dtypes.bfloat16}
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        start, end = t["data_offsets"]
        raw = data[8 + size + start : 8 + size + end]
        out[name] = np.frombuffer(raw, dtypes[t["dtype"]]).reshape(t["shape"])
    return out


def weight_dequant(w: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """DeepSeek's ``weight_dequant``: float32(w) times its block's scale, in bfloat16."""
    s = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)
    return (w.astype(np.float32) * s[: w.shape[0], : w.shape[1]]).astype(ml_dtypes.bfloat16)


def main(folder: Path) -> None:
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    write(folder, mesh)
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    print(f"wrote {sorted(p.name for p in folder.iterdir())}")
    print(f"config.json: quantization_config = {json.dumps(quantization, sort_keys=True)}")
    stored = read_stored(folder / "model.safetensors")
    for name in sorted(n for n in stored if n.endswith("_scale_inv")):
        weight = stored[name.removesuffix("_scale_inv")]
        print(
            f"  {name.removesuffix('_scale_inv')}: {weight.dtype} {weight.shape}, "
            f"{name.rsplit('.', 1)[1]}: {stored[name].dtype} {stored[name].shape}"
        )

    # The model's plan: bfloat16 kernels, (in, out), sharded both ways.
    init = jax.nn.initializers.zeros
    with meshinit.defaults(mesh=mesh, dtype=jax.numpy.bfloat16):
        specs = {
            "layers": [
                {
                    "up": meshinit.param((D, MLP), init, axes=("fsdp", "tensor")),
                    "down": meshinit.param((MLP, D), init, axes=("tensor", "fsdp")),
                }
                for _ in range(LAYERS)
            ],
            "norm": meshinit.param((D,), init, axes=(None,)),
        }
    plan = meshinit.plan(specs)
    planned = {e.path: e.sharding for e in plan.entries}
    print(meshinit.safetensors.inventory(plan, folder, names=NAMES))
    params = meshinit.safetensors.load(plan, folder, names=NAMES)

    block = tuple(quantization["weight_block_size"])
    exact = 0
    for path, array in sorted(params.items()):
        if path == "norm":
            want = stored["model.norm.weight"].astype(ml_dtypes.bfloat16)
        else:  # stored (out, in) as torch keeps it: transposed for the plan
            _, layer, kind = path.split(".")
            name = f"model.layers.{layer}.mlp.{kind}_proj.weight"
            want = weight_dequant(stored[name], stored[f"{name}_scale_inv"], block).T
        assert array.sharding == planned[path], path
        for shard in array.addressable_shards:  # each device's block, as it was placed
            got = np.asarray(shard.data).view(np.uint16)
            assert np.array_equal(got, want[shard.index].view(np.uint16)), (path, shard.index)
        exact += 1
        how = "as stored (not quantized)" if path == "norm" else "weight_dequant's bits"
        print(
            f"  {path}: {array.dtype} {array.shape} {array.sharding.spec}: "
            f"{len(array.addressable_shards)} shards, {how}"
        )
    print(f"loaded {exact}/{len(params)} parameters bit for bit")

    # config.json is read beside the files: a list of files finds it too ...
    files = sorted(str(p) for p in folder.glob("*.safetensors"))
    again = meshinit.safetensors.load(plan, files, names=NAMES)
    same = all(np.array_equal(np.asarray(again[p]), np.asarray(params[p])) for p in params)
    print(f"from the list of files {[Path(f).name for f in files]}: the same bits: {same}")
    assert same
    # ... and what it says is believed, or refused: a block size the scales contradict.
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (folder / "config.json").write_text(json.dumps(config))
    try:
        meshinit.safetensors.load(plan, folder, names=NAMES)
    except meshinit.PlanError as e:
        print(
            f"with weight_block_size [64, 64] in config.json: refused, {len(e.problems)} "
            f"problems, the first:\n  {e.problems[0]}"
        )
    else:
        raise AssertionError("a block size the scales contradict was loaded")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp) / "fp8-checkpoint")
