"""An MXFP4 checkpoint (gpt-oss style) loaded onto a mesh.

gpt-oss publishes each expert weight ``X`` as a pair: ``X_blocks`` (uint8
``[E, R, G, 16]``: two fp4 e2m1 values a byte, the low nibble first, 32 values a
group) and ``X_scales`` (uint8 ``[E, R, G]``: one e8m0 exponent a group, bias 127).
Its ``config.json`` says ``quantization_config: {quant_method: "mxfp4"}``.

meshinit offers the pair as the tensor ``X`` of shape ``[E, G * 32, R]`` that
transformers' ``convert_moe_packed_tensors`` makes of it, so the plan names
``...experts.down_proj`` as a dequantized checkpoint would. Each device reads only the
bytes and exponents of the groups its block reaches and unpacks them itself.

The checkpoint is written here with the ``safetensors`` package, and every value is
checked bit for bit against a numpy port of ``convert_moe_packed_tensors``.

Where ``config.json`` is read from: beside the files (the folder given to ``load``, or
the folder of the first file of a list; an ``s3://``, ``gs://`` or ``hf://`` folder's
own). A pair is read as MXFP4 only where that config says ``mxfp4``; without it the
load is refused, shown last.

Run: python examples/mxfp4_checkpoint.py [directory]
"""

import json
import sys
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import meshinit  # noqa: E402
import meshinit.safetensors  # noqa: E402

EXPERTS, D, MLP, GROUP = 4, 64, 96, 32  # 4 experts; hidden 64, expert MLP 96
PREFIX = "model.layers.0.mlp.experts"
# e2m1: the 16 values a nibble stands for
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def write(folder: Path) -> dict[str, np.ndarray]:
    """gate_up_proj ([E, 2 * MLP, D] as torch applies it) and down_proj ([E, D, MLP]),
    packed as gpt-oss packs them, and the config that says so."""
    rng = np.random.default_rng(0)
    stored = {}
    for name, (rows, k) in {"gate_up_proj": (2 * MLP, D), "down_proj": (D, MLP)}.items():
        groups = k // GROUP
        stored[f"{PREFIX}.{name}_blocks"] = rng.integers(
            0, 256, (EXPERTS, rows, groups, GROUP // 2), np.uint8
        )
        stored[f"{PREFIX}.{name}_scales"] = rng.integers(
            120, 132, (EXPERTS, rows, groups), np.uint8
        )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return stored


def convert_moe_packed_tensors(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' dequantization, in numpy: each nibble's value (the low one first)
    times 2^(exponent - 127), rounded once to bfloat16; groups and rows transposed:
    ``[E, R, G, 16]`` and ``[E, R, G]`` give ``[E, G * 32, R]``."""
    *prefix, groups, half = blocks.shape
    values = np.empty((*prefix, groups, 2 * half), np.float64)
    values[..., 0::2] = np.array(FP4)[blocks & 0x0F]
    values[..., 1::2] = np.array(FP4)[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.astype(ml_dtypes.bfloat16).reshape(*prefix, groups * 2 * half).swapaxes(1, 2)


def main(folder: Path) -> None:
    stored = write(folder)
    print(f"wrote {sorted(p.name for p in folder.iterdir())}")
    for name, t in sorted(stored.items()):
        print(f"  {name}: {t.dtype} {t.shape}")
    print(f"config.json: {json.loads((folder / 'config.json').read_text())}")

    # The plan: each [E, K, R] tensor as transformers makes it, experts over "expert",
    # the output features over "tensor".
    mesh = jax.make_mesh((2, 4), ("expert", "tensor"))
    init = jax.nn.initializers.zeros
    with meshinit.defaults(mesh=mesh, dtype=jax.numpy.bfloat16):
        specs = {
            "gate_up": meshinit.param((EXPERTS, D, 2 * MLP), init, axes=("expert", None, "tensor")),
            "down": meshinit.param((EXPERTS, MLP, D), init, axes=("expert", None, "tensor")),
        }
    plan = meshinit.plan(specs)
    names = {"gate_up": f"{PREFIX}.gate_up_proj", "down": f"{PREFIX}.down_proj"}
    print(meshinit.safetensors.inventory(plan, folder, names=names))
    params = meshinit.safetensors.load(plan, folder, names=names)

    for path, array in sorted(params.items()):
        name = names[path]
        want = convert_moe_packed_tensors(stored[f"{name}_blocks"], stored[f"{name}_scales"])
        assert array.sharding == {e.path: e.sharding for e in plan.entries}[path], path
        for shard in array.addressable_shards:  # each device's block, as it was placed
            got = np.asarray(shard.data).view(np.uint16)
            assert np.array_equal(got, want[shard.index].view(np.uint16)), (path, shard.index)
        print(
            f"  {path}: {array.dtype} {array.shape} {array.sharding.spec}: "
            f"{len(array.addressable_shards)} shards, convert_moe_packed_tensors' bits"
        )
    print(f"loaded {len(params)}/{len(params)} parameters bit for bit")

    # The config beside the files decides: without "mxfp4" the pairs are not read so.
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    try:
        meshinit.safetensors.load(plan, folder, names=names)
    except meshinit.PlanError as e:
        print(
            f"with no quantization_config in config.json: refused, {len(e.problems)} "
            f"problems, the first:\n  {e.problems[0]}"
        )
    else:
        raise AssertionError("MXFP4 pairs were read with no config declaring them")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp) / "mxfp4-checkpoint")
