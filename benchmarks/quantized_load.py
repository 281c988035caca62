"""FP8 block-scaled checkpoints loaded dequantized (issue 59), against the bf16 copy and
the two-step route.

A DeepSeek-V3-shaped layer stack is written as DeepSeek publishes it: per layer the
attention projections (q_a, q_b, kv_a_with_mqa, kv_b, o) and ``--experts`` experts'
gate/up/down, ``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` per 128x128 block
(``kv_a_proj_with_mqa``'s 576 rows ragged), one file per layer, and config.json's
``quantization_config``. Shapes are the real ones (``--divide`` makes them smaller).
Each projection is one stacked parameter ``[layers, out, in]`` (experts
``[experts, layers, out, in]``) on ``P(..., 'x', 'y')`` of a (2, 4) mesh of 8
simulated CPU devices, loaded in a fresh process per route:

- ``fp8``: ``meshinit.safetensors.load`` of the FP8 files into bfloat16 (dequantized on
  the devices);
- ``bf16``: the same model from a bf16 checkpoint (DeepSeek's ``weight_dequant`` of the
  FP8 files, written beforehand, not timed);
- ``two-step``: the route users take today: a numpy port of ``weight_dequant`` writes
  the bf16 checkpoint file by file (as ``fp8_cast_bf16.py`` does), then it is loaded;
  timed and measured whole.

Reported: time, peak RSS increase over the process before the route (VmHWM), bytes
read / (fp8 bytes + scale bytes) (one process owns every block here), and the compiles
of the fp8 load at ``--layers`` and at half as many. The files are read once first, so
the page cache is warm for every route.

``QUANTIZED_PROFILE=fp8`` (or another route) prints that route's cProfile (by own
time). With ``--check``, the fp8 load's arrays are compared bit for bit with the bf16 copy's
(after the timing), and a difference exits 1.

``--tpu``: on the one chip of a TPU machine (mesh (1, 1), the arrays in its memory, so
peak RSS is host memory alone); each route's process opens the chip in turn.

``--fused``: the experts' gate and up as one parameter ``experts.gate_up`` ``[experts,
layers, 2 * out, in]``, each expert's layer a ``Concat([gate, up], axis=0)`` (the fused
``gate_up_proj`` of many frameworks), so its blocks go through the tiles' program
(``encodings/fp8/joins.py``) rather than the stacked one.

``--ahead 4 2 1``: the fp8 route once per value of ``AHEAD`` (``meshinit._checkpoint.read.
ahead``: how many dequantized parameters compile and run on worker threads at once),
each ``--repeats`` times, interleaved, against the two-step route: its time and peak RSS.
``--slice-mib 64 4096`` does the same for ``SLICE_BYTES`` (``encodings/fp8/slices.py``:
a dequantized block larger than this is read and placed in slices), in MiB.

Run: python benchmarks/quantized_load.py [--layers 4] [--experts 8] [--divide 1] [--dir DIR]
[--check] [--tpu] [--fused] [--ahead N ... | --slice-mib N ...] [--repeats 1]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATTENTION = {  # DeepSeek-V3's (out, in)
    "self_attn.q_a_proj": (1536, 7168),
    "self_attn.q_b_proj": (24576, 1536),
    "self_attn.kv_a_proj_with_mqa": (576, 7168),
    "self_attn.kv_b_proj": (32768, 512),
    "self_attn.o_proj": (7168, 16384),
}
EXPERT = {"gate_proj": (2048, 7168), "up_proj": (2048, 7168), "down_proj": (7168, 2048)}


def shapes(divide: int) -> tuple[dict, dict]:
    def small(s):
        return tuple(n // divide for n in s)

    return {k: small(s) for k, s in ATTENTION.items()}, {k: small(s) for k, s in EXPERT.items()}


def names(layer: int, experts: int, divide: int) -> dict[str, tuple[int, int]]:
    attention, expert = shapes(divide)
    out = {f"model.layers.{layer}.{k}.weight": s for k, s in attention.items()}
    for e in range(experts):
        for k, s in expert.items():
            out[f"model.layers.{layer}.mlp.experts.{e}.{k}.weight"] = s
    return out


def dequant(w, s):
    """DeepSeek's ``weight_dequant``, ported: float32(w) * float32(s[i//128, j//128]),
    stored in bfloat16 (its default dtype)."""
    import ml_dtypes
    import numpy as np

    rows, cols = w.shape
    wide = np.repeat(np.repeat(s.astype(np.float32), 128, 0), 128, 1)[:rows, :cols]
    return (w.astype(np.float32) * wide).astype(ml_dtypes.bfloat16)


def write(directory: Path, layers: int, experts: int, divide: int) -> int:
    """The FP8 files and, beside them in ``bf16/``, weight_dequant's bf16 copy; returns
    the fp8 + scale bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    (directory / "bf16").mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"quantization_config": quantization}))
    total = 0
    for layer in range(layers):
        fp8, bf16 = {}, {}
        for name, (rows, cols) in names(layer, experts, divide).items():
            codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
            w = codes.view(ml_dtypes.float8_e4m3fn)
            s = rng.uniform(1e-4, 1e-2, (-(-rows // 128), -(-cols // 128))).astype(np.float32)
            fp8[name], fp8[name + "_scale_inv"] = w, s
            bf16[name] = dequant(w, s)
            total += w.nbytes + s.nbytes
        save_file(fp8, str(directory / f"model-{layer:05d}.safetensors"))
        save_file(bf16, str(directory / "bf16" / f"model-{layer:05d}.safetensors"))
    return total


def table(layers: int, experts: int, divide: int, fused: bool = False) -> dict:
    """plan path -> (shape, names= target, spec)."""
    from meshinit.safetensors import Concat, Stack

    attention, expert = shapes(divide)
    out = {}
    for k, (rows, cols) in attention.items():
        parts = [f"model.layers.{i}.{k}.weight" for i in range(layers)]
        out[k] = ((layers, rows, cols), Stack(parts, axis=0), (None, "x", "y"))
    for k, (rows, cols) in expert.items():
        per = [
            Stack([f"model.layers.{i}.mlp.experts.{e}.{k}.weight" for i in range(layers)], axis=0)
            for e in range(experts)
        ]
        out[f"experts.{k}"] = ((experts, layers, rows, cols), Stack(per, 0), (None, None, "x", "y"))
    if fused:  # gate and up joined along their rows, per expert and layer
        (rows, cols), name = expert["gate_proj"], "model.layers.{}.mlp.experts.{}.{}.weight"
        per = [
            Stack([Concat([name.format(i, e, "gate_proj"), name.format(i, e, "up_proj")], axis=0)
                   for i in range(layers)], axis=0)
            for e in range(experts)
        ]  # fmt: skip
        del out["experts.gate_proj"], out["experts.up_proj"]
        spec = (None, None, "x", "y")
        out["experts.gate_up"] = ((experts, layers, 2 * rows, cols), Stack(per, 0), spec)
    return out


def child(route: str, directory: Path, layers: int, experts: int, divide: int, check: bool,
          tpu: bool = False, knob: tuple[str, float] | None = None, fused: bool = False,
          ) -> None:  # fmt: skip
    """One route in this process (the fp8 route with ``knob``: ``("ahead", n)`` for
    ``AHEAD = n``, ``("slice-mib", n)`` for ``SLICE_BYTES = n MiB``); prints its JSON."""
    import jax

    if knob and knob[0] == "ahead":  # private constants, set for this probe alone
        from meshinit._checkpoint.read import ahead as _ahead

        _ahead.AHEAD = int(knob[1])
    elif knob:
        from meshinit._checkpoint.encodings.fp8 import slices as _slices

        _slices.SLICE_BYTES = int(knob[1] * 2**20)

    if not tpu:
        jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import meshinit

    compiles, read, compiling = [0], [0.0], [0.0]

    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1
            compiling[0] += duration

    def on_scalar(event, value, **kw):
        if event == "/meshinit/safetensors/bytes_read":
            read[0] += value

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_scalar_listener(on_scalar)
    grid = (1, 1) if tpu else (2, 4)
    mesh = Mesh(np.array(jax.devices()[: grid[0] * grid[1]]).reshape(grid), ("x", "y"))
    rows = table(layers, experts, divide, fused)
    zeros = jax.nn.initializers.zeros
    made = {
        p: meshinit.param(s, zeros, dtype=jnp.bfloat16, axes=a, mesh=mesh)
        for p, (s, _, a) in rows.items()
    }  # noqa: E501
    plan = meshinit.plan(made)
    targets = {p: t for p, (_, t, _) in rows.items()}
    baseline = peak_rss()
    profile = cProfile.Profile() if os.environ.get("QUANTIZED_PROFILE") == route else None
    start = time.perf_counter()
    if profile:
        profile.enable()
    if route == "two-step":
        two_step(directory)
    source = directory if route == "fp8" else directory / ("bf16" if route == "bf16" else "step")
    loaded = meshinit.safetensors.load(plan, source, names=targets, progress=False)
    jax.block_until_ready(list(loaded.values()))
    seconds = time.perf_counter() - start
    if profile:
        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(14)
    peak = peak_rss() - baseline
    done = {"seconds": seconds, "rss": peak, "read": read[0], "compiles": compiles[0]}
    done["compile_seconds"] = compiling[0]
    if check and route == "fp8":  # the bits of weight_dequant's copy, or exit 1
        copy = meshinit.safetensors.load(plan, directory / "bf16", names=targets, progress=False)
        for path, array in loaded.items():
            same = np.asarray(array).view(np.uint16) == np.asarray(copy[path]).view(np.uint16)
            if not same.all():
                raise SystemExit(f"{path}: {(~same).sum()} elements differ from weight_dequant")
    print(json.dumps(done))


def peak_rss() -> int:
    """This process's peak resident bytes (VmHWM: unlike ``ru_maxrss``, not inherited
    from the parent that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def two_step(directory: Path) -> None:
    """The FP8 files dequantized by the numpy port into ``step/``, file by file (whole
    tensors in host memory, as DeepSeek's ``fp8_cast_bf16.py``)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    (directory / "step").mkdir(exist_ok=True)
    for path in sorted(directory.glob("model-*.safetensors")):
        out = {}
        with open(path, "rb") as raw:
            size = int.from_bytes(raw.read(8), "little")
            index = json.loads(raw.read(size))
            data = np.fromfile(raw, np.uint8)
        index.pop("__metadata__", None)
        for name, meta in index.items():
            if name.endswith("_scale_inv"):
                continue
            lo, hi = meta["data_offsets"]
            w = data[lo:hi].view(ml_dtypes.float8_e4m3fn).reshape(meta["shape"])
            slo, shi = index[name + "_scale_inv"]["data_offsets"]
            s = data[slo:shi].view(np.float32).reshape(index[name + "_scale_inv"]["shape"])
            out[name] = dequant(w, s)
        save_file(out, str(directory / "step" / path.name))
        del data, out


def run(route: str, args, layers: int | None = None, knob: tuple[str, float] | None = None) -> dict:
    command = [sys.executable, __file__, "--child", route, "--dir", str(args.dir)]
    command += [] if knob is None else ["--knob-child", knob[0], str(knob[1])]
    command += ["--fused"] * args.fused
    command += ["--layers", str(layers or args.layers), "--experts", str(args.experts)]
    command += ["--divide", str(args.divide)] + ["--check"] * args.check + ["--tpu"] * args.tpu
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path} | ({} if args.tpu else {"JAX_PLATFORMS": "cpu"})
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if os.environ.get("QUANTIZED_PROFILE") == route and not layers:
        print(done.stderr[-4000:])
    if done.returncode:
        raise SystemExit(f"{route} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--divide", type=int, default=1, help="shapes divided by this")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--child", default=None)
    parser.add_argument("--check", action="store_true", help="compare the fp8 load's bits")
    parser.add_argument("--tpu", action="store_true", help="the one chip (mesh (1, 1))")
    parser.add_argument("--fused", action="store_true", help="experts' gate and up fused")
    knobs = parser.add_mutually_exclusive_group()
    knobs.add_argument("--ahead", type=int, nargs="+", help="AHEAD values to compare")
    knobs.add_argument("--slice-mib", type=float, nargs="+", help="SLICE_BYTES values, MiB")
    parser.add_argument("--repeats", type=int, default=1, help="of each compared value")
    parser.add_argument("--json", default=None, help="the compared rows, as JSON")
    parser.add_argument("--knob-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        knob = args.knob_child and (args.knob_child[0], float(args.knob_child[1]))
        child(args.child, args.dir, args.layers, args.experts, args.divide, args.check, args.tpu,
              knob, args.fused)  # fmt: skip
        return
    with tempfile.TemporaryDirectory() as scratch:
        args.dir = args.dir or Path(scratch)
        owned = write(args.dir, args.layers, args.experts, args.divide)
        for path in args.dir.rglob("*.safetensors"):  # the page cache warm for every route
            path.read_bytes()
        if args.ahead or args.slice_mib:
            return compare(args, owned)
        got = {route: run(route, args) for route in ("fp8", "bf16", "two-step")}
        half = run("fp8", args, max(1, args.layers // 2))
    fp8, bf16, step = got["fp8"], got["bf16"], got["two-step"]
    t, mib = fp8["seconds"], 2**20
    print(f"{args.layers} layers, {args.experts} experts, shapes / {args.divide}: ", end="")
    print(f"{owned / 2**30:.2f} GiB fp8 + scales")
    rows = [
        ("bytes read / (fp8 + scale bytes)", f"{fp8['read'] / owned:.4f}", "<= 1.02"),
        ("time: fp8 load / bf16 load", f"{t / bf16['seconds']:.2f} ({t:.2f} s / "
         f"{bf16['seconds']:.2f} s)", "<= 0.8"),
        ("  its compiles: seconds, summed over the threads compiling at once",
         f"{fp8['compile_seconds']:.2f} s", ""),
        ("time: fp8 load / two-step", f"{t / step['seconds']:.2f} ({step['seconds']:.2f} s)",
         "<= 0.25"),
        ("peak RSS: fp8 load / two-step", f"{fp8['rss'] / max(step['rss'], 1):.2f} "
         f"({fp8['rss'] / mib:.0f} / {step['rss'] / mib:.0f} MiB)", "<= 0.5"),
        (f"compiles at {args.layers} / {max(1, args.layers // 2)} layers",
         f"{fp8['compiles']} / {half['compiles']}", "equal"),
    ]  # fmt: skip
    print("| measure | value | goal |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def compare(args, owned: int) -> None:
    """The fp8 route at each ``--ahead`` (or ``--slice-mib``) value, interleaved, against
    the two-step route (run once per repeat too): the median time and peak RSS of each,
    and their ratios."""
    name, values = ("ahead", args.ahead) if args.ahead else ("slice-mib", args.slice_mib)
    found: dict = {n: [] for n in values}
    steps = []
    for _ in range(args.repeats):
        for n in values:
            found[n].append(run("fp8", args, knob=(name, n)))
        steps.append(run("two-step", args))
        shutil.rmtree(args.dir / "step", ignore_errors=True)

    def median(rows: list[dict], key: str) -> float:
        return sorted(r[key] for r in rows)[len(rows) // 2]

    t0, r0 = median(steps, "seconds"), median(steps, "rss")
    mib = 2**20
    print(f"{args.layers} layers, {args.experts} experts, shapes / {args.divide}: "
          f"{owned / 2**30:.2f} GiB fp8 + scales; median of {args.repeats}; two-step "
          f"{t0:.2f} s, {r0 / mib:.0f} MiB")  # fmt: skip
    head = "AHEAD" if name == "ahead" else "SLICE_BYTES, MiB"
    print(f"| {head} | time | / two-step | peak RSS | / two-step | compile s (threads summed) |")
    print("|---|---|---|---|---|---|")
    for n, rows in found.items():
        t, r = median(rows, "seconds"), median(rows, "rss")
        c = median(rows, "compile_seconds")
        print(f"| {n} | {t:.2f} s | {t / t0:.2f} | {r / mib:.0f} MiB | {r / r0:.2f} | {c:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({name: found, "two-step": steps}, indent=1))


if __name__ == "__main__":
    main()
