"""MXFP4 checkpoints loaded dequantized (issue 59): gpt-oss's experts against a bf16 copy,
and the bits against transformers' ``convert_moe_packed_tensors``.

``--layers`` layers of gpt-oss-20b's expert weights as published: per layer
``mlp.experts.gate_up_proj_blocks`` ``[32, 5760, 90, 16]`` and ``down_proj_blocks``
``[32, 2880, 90, 16]`` (uint8) with their ``_scales`` (random nibbles; exponents 118 to
127), config.json's ``quant_method: mxfp4``, one file per layer; and a bf16 copy, the
tensors transformers makes of them (a numpy port, written beforehand). Each weight is a
stacked parameter ``[experts, layers, in, out]`` on ``P("x", None, "y", None)``, loaded
into bfloat16 by ``meshinit.safetensors.load``: from the MXFP4 files (dequantized on the
devices) and from the bf16 copy, each twice in one process (the first compiles; the
page cache warm for both).

Reported: each load's time, bytes read / stored MXFP4 bytes, and the elements whose
bits differ from the numpy port. With transformers and torch importable, the numpy
port is first compared with transformers' own function on layer 0 (exit 1 if any
element differs). ``--tpu``: the one chip of a TPU machine (mesh (1, 1)); else a (2, 4)
mesh of 8 simulated CPU devices.

Run: python benchmarks/mxfp4_load.py [--layers 2] [--divide 1] [--tpu] [--dir DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
WEIGHTS = {"gate_up_proj": (32, 5760, 90), "down_proj": (32, 2880, 90)}  # [E, R, G]
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def dequantized(blocks, scales):
    """A numpy port of transformers' ``convert_moe_packed_tensors``, in bfloat16."""
    import ml_dtypes
    import numpy as np

    lut = np.array(FP4 + [-v for v in FP4])
    *prefix, g, b = blocks.shape
    out = np.empty((*prefix, g, 2 * b))
    out[..., 0::2], out[..., 1::2] = lut[blocks & 15], lut[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127).astype(ml_dtypes.bfloat16)
    return out.reshape(*prefix, g * 2 * b).swapaxes(1, 2)


def write(directory: Path, layers: int, divide: int) -> tuple[int, dict]:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    (directory / "bf16").mkdir(parents=True, exist_ok=True)
    config = json.dumps({"quantization_config": {"quant_method": "mxfp4"}})
    (directory / "config.json").write_text(config)
    stored, shapes = 0, {}
    for i in range(layers):
        packed, copy = {}, {}
        for k, (e, r, g) in WEIGHTS.items():
            e, r = e // divide, r // divide
            name = f"model.layers.{i}.mlp.experts.{k}"
            blocks = rng.integers(0, 256, (e, r, g, 16), dtype=np.uint8)
            scales = rng.integers(118, 128, (e, r, g), dtype=np.uint8)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            copy[name] = np.ascontiguousarray(dequantized(blocks, scales))
            stored += blocks.nbytes + scales.nbytes
            shapes[k] = (e, g * 32, r)
        save_file(packed, str(directory / f"model-{i:05d}.safetensors"))
        save_file(copy, str(directory / "bf16" / f"model-{i:05d}.safetensors"))
    return stored, shapes


def transformers_check(directory: Path) -> str:
    """The numpy port against transformers' own function on layer 0, or why not run."""
    try:
        import torch
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except Exception as e:  # noqa: BLE001  (not importable: say so)
        return f"not run ({type(e).__name__}: {e})"
    import numpy as np
    from safetensors.numpy import load_file

    packed = load_file(str(directory / "model-00000.safetensors"))
    differ = total = 0
    for k in WEIGHTS:
        name = f"model.layers.0.mlp.experts.{k}"
        blocks, scales = packed[name + "_blocks"], packed[name + "_scales"]
        theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales))
        ours = dequantized(blocks, scales)
        got = theirs.view(torch.int16).numpy().view(np.uint16)
        differ += int((got != ours.view(np.uint16)).sum())
        total += ours.size
    if differ:
        raise SystemExit(f"the numpy port differs from transformers' in {differ} of {total}")
    return f"0 of {total} elements differ (transformers {__import__('transformers').__version__})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--divide", type=int, default=1, help="experts and rows divided by this")
    parser.add_argument("--tpu", action="store_true", help="the one chip (mesh (1, 1))")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile the last mxfp4 load")
    args = parser.parse_args()
    import jax

    if not args.tpu:
        jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import meshinit
    from meshinit.safetensors import Stack

    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or Path(scratch)
        stored, shapes = write(directory, args.layers, args.divide)
        print("transformers:", transformers_check(directory), flush=True)
        for path in directory.rglob("*.safetensors"):  # the page cache warm for both
            path.read_bytes()
        grid = (1, 1) if args.tpu else (2, 4)
        mesh = Mesh(np.array(jax.devices()[: grid[0] * grid[1]]).reshape(grid), ("x", "y"))
        made, names = {}, {}
        for k, (e, kk, r) in shapes.items():
            made[k] = meshinit.param(
                (e, args.layers, kk, r), jax.nn.initializers.zeros, dtype=jnp.bfloat16,
                axes=("x", None, "y", None), mesh=mesh,
            )  # fmt: skip
            per = [f"model.layers.{i}.mlp.experts.{k}" for i in range(args.layers)]
            names[k] = Stack(per, axis=1)
        plan = meshinit.plan(made)
        read = [0.0]

        def on_scalar(event, value, **kw):
            read[0] += value if event == "/meshinit/safetensors/bytes_read" else 0

        jax.monitoring.register_scalar_listener(on_scalar)
        times: dict[str, list[float]] = {"mxfp4": [], "bf16": []}
        loaded = {}
        for again in range(2):
            for route, source in (("bf16", directory / "bf16"), ("mxfp4", directory)):
                read[0] = 0.0
                last = args.profile and again and route == "mxfp4"
                profile = cProfile.Profile() if last else None
                start = time.perf_counter()
                if profile:
                    profile.enable()
                got = meshinit.safetensors.load(plan, source, names=names, progress=False)
                jax.block_until_ready(list(got.values()))
                times[route].append(time.perf_counter() - start)
                if profile:
                    profile.disable()
                    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
                if route == "mxfp4":
                    mx_read = read[0]
                loaded[route] = got
        differ = sum(
            int((np.asarray(loaded["mxfp4"][k]).view(np.uint16)
                 != np.asarray(loaded["bf16"][k]).view(np.uint16)).sum())
            for k in shapes
        )  # fmt: skip
    mx, bf = times["mxfp4"], times["bf16"]
    print(f"{args.layers} layers of gpt-oss-20b's experts / {args.divide}, {stored / 2**30:.2f} "
          f"GiB MXFP4, on {jax.devices()[0].platform} {grid}")  # fmt: skip
    print("| measure | value |\n|---|---|")
    print(f"| bytes read / stored MXFP4 bytes | {mx_read / stored:.4f} |")
    print(f"| mxfp4 load, first (compiles) / again | {mx[0]:.2f} s / {mx[1]:.2f} s |")
    print(f"| bf16 load, first / again | {bf[0]:.2f} s / {bf[1]:.2f} s |")
    print(f"| mxfp4 / bf16, again | {mx[1] / bf[1]:.2f} |")
    print(f"| elements differing from the bf16 copy | {differ} |")
    if differ:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
