"""Issue 67's MXFP4 case of fan-out (benchmarks/fanout.py's companion, whose socket
counts it reuses): gpt-oss's MXFP4 experts loaded dequantized under
``jax.distributed``, 4 processes x 2 CPU devices (gloo), with ``fan_out=True`` against
``fan_out=False``.

MXFP4 is read from local files only (meshinit refuses remote ones), so this runs
without fanout.py's S3 server: "store" is what the loads read from the files, the
load's own ``/meshinit/safetensors/bytes_read`` of each process. On one host the page
cache serves every process anyway (``fan_out=None`` therefore lets each holder read
local files); fan-out pays where the processes run on several hosts over a shared
file system, which these counts stand for.

Per layer, on a ``(data=4, tensor=2)`` mesh whose ``data`` axis spans the processes,
each stored as gpt-oss publishes it (``X_blocks`` uint8 ``[E, R, K/32, 16]``, ``X_scales``
uint8 ``[E, R, K/32]``) and planned in bfloat16 as transformers' ``X`` ``[E, K, R]``:
``gate_up`` with its experts split over ``tensor``, ``down`` with K split over
``tensor`` (both replicated over ``data``: R = 4 processes hold each block), and a
``router``-sized ``sharded`` one split over both (held once).

Measures (``unique``: the _blocks and _scales bytes, each once): store (bytes read by
all processes / unique), busiest (bytes of the process that read most / the mean),
between (bytes the peer sockets sent / the all-gather bound in stored bytes), time
(the slowest process's load with fan-out / without, first load and best repeat).
Every shard is checked bit for bit against transformers' ``convert_moe_packed_tensors``
in numpy.

Run: python benchmarks/fanout_mxfp4.py [--quick] [--layers 4] [--experts 8] [--d 512]
     [--ffn 512] [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fanout as base  # benchmarks/ is this script's first sys.path entry

MiB = base.MiB
PROCESSES, LOCAL = base.PROCESSES, base.LOCAL
MODES = {"True": True, "False": False}
GROUP = 32
TABLE = (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6)


def layout(args) -> dict[str, tuple[tuple, tuple]]:
    """Path (its tensors' stem too) -> (``X``'s shape ``[E, K, R]``, mesh axes)."""
    e, d, f = args.experts, args.d, args.ffn
    out: dict[str, tuple[tuple, tuple]] = {}
    for i in range(args.layers):
        out[f"layers.{i}.gate_up"] = ((e, d, 2 * f), ("tensor", None, None))
        out[f"layers.{i}.down"] = ((e, f, d), (None, "tensor", None))
        out[f"layers.{i}.sharded"] = ((e, d, f // 4), ("data", "tensor", None))
    return out


def tensors(args) -> dict:
    """The stored tensors, seeded: every nibble, exponents about 2^+-10."""
    import numpy as np

    rng = np.random.default_rng(args.layers)
    out = {}
    for name, ((e, k, r), _) in layout(args).items():
        out[f"{name}_blocks"] = rng.integers(0, 256, (e, r, k // GROUP, 16), dtype=np.uint8)
        out[f"{name}_scales"] = rng.integers(117, 137, (e, r, k // GROUP), dtype=np.uint8)
    return out


def dequantized(stored: dict, name: str):
    """transformers' ``convert_moe_packed_tensors`` of ``name`` in bfloat16, as bits."""
    import ml_dtypes
    import numpy as np

    blocks, scales = stored[f"{name}_blocks"], stored[f"{name}_scales"]
    table = np.array(TABLE)
    values = np.stack([table[blocks & 0x0F], table[blocks >> 4]], axis=-1)
    values = np.ldexp(values, scales.astype(np.int32)[..., None, None] - 127)
    e, r, g, b = blocks.shape
    values = values.astype(ml_dtypes.bfloat16).reshape(e, r, g * 2 * b).swapaxes(1, 2)
    return values.view(np.uint16)


def write(folder: Path, args) -> int:
    """The checkpoint in two files, its config declaring MXFP4; its data bytes."""
    from safetensors.numpy import save_file

    items = list(tensors(args).items())
    folder.mkdir(parents=True)
    half = len(items) // 2 // 2 * 2  # a _blocks and its _scales in one file
    for k, part in enumerate((items[:half], items[half:])):
        save_file(dict(part), str(folder / f"model-0000{k + 1}-of-00002.safetensors"))
    config = {"quantization_config": {"quant_method": "mxfp4"}}
    (folder / "config.json").write_text(json.dumps(config))
    return sum(v.nbytes for _, v in items)


def worker(rank: int, port: int, folder: str, args) -> list[dict]:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=PROCESSES, process_id=rank)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    import meshinit
    from meshinit import safetensors as st

    mesh = Mesh(np.array(jax.devices()).reshape(PROCESSES, LOCAL), ("data", "tensor"))
    seen: dict = {}

    def scalar(event, value, **k):
        if event.startswith("/meshinit/safetensors/"):
            seen[event.rsplit("/", 1)[1]] = value

    jax.monitoring.register_scalar_listener(scalar)
    stored = tensors(args)
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {
            p: meshinit.param(s, zeros, dtype=jnp.bfloat16, axes=a, mesh=mesh)
            for p, (s, a) in layout(args).items()
        }
    )
    results = []
    for mode, fan_out in MODES.items():
        jax.clear_caches()
        meshinit.clear_cache()
        for rep in range(args.repeats):
            multihost_utils.sync_global_devices(f"m{mode}n{rep}")
            seen.update(bytes_read=None, bytes_from_peers=None)
            before = base.peer_bytes(os.getpid(), {port})
            start = time.perf_counter()
            arrays = st.load(plan, folder, fan_out=fan_out, progress=False)
            jax.block_until_ready(list(arrays.values()))
            seconds = time.perf_counter() - start
            sent, received = base.moved(before, base.peer_bytes(os.getpid(), {port}))
            wrong = []
            for path, a in arrays.items():
                want = dequantized(stored, path)
                for shard in a.addressable_shards:
                    if not (np.asarray(shard.data).view(np.uint16) == want[shard.index]).all():
                        wrong.append(f"{path}{shard.index}: differs from transformers'")
                a.delete()
            results.append(
                dict(mode=mode, rep=rep, seconds=seconds, peer_sent=sent,
                     peer_received=received, wrong=wrong[:5], **seen)
            )  # fmt: skip
    multihost_utils.sync_global_devices("done")
    return results


def spawn(folder: str, argv: list[str], timeout: float) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(base.ROOT), env.get("PYTHONPATH")]))
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), str(port), folder, *argv], **pipes
        )
        for r in range(PROCESSES)
    ]
    return base.collect(procs, timeout, "fanout_mxfp4")


def summarize(args, loads: list[dict], unique: int) -> dict:
    # the all-gather bound: (R - 1) x each replicated block's stored bytes (17 a 32)
    low = sum(
        (PROCESSES - 1) * e * k * r * 17 // 32
        for (e, k, r), axes in layout(args).values()
        if "data" not in axes
    )
    out: dict = {"config": vars(args), "unique": unique, "bound": low}
    for mode in MODES:
        per_rep = []
        for rep in range(args.repeats):
            rows = sorted(
                (r for r in loads if r["mode"] == mode and r["rep"] == rep),
                key=lambda r: r["rank"],
            )
            per_rep.append(
                {
                    "seconds": max(r["seconds"] for r in rows),
                    "bytes_read": [r["bytes_read"] for r in rows],
                    "from_peers": [r["bytes_from_peers"] for r in rows],
                    "peer_sent": sum(r["peer_sent"] for r in rows),
                    "wrong": [w for r in rows for w in r["wrong"]],
                }
            )
        data = per_rep[0]["bytes_read"]
        out[mode] = {
            "loads": per_rep,
            "store": sum(data) / unique,
            "busiest": max(data) / (sum(data) / len(data)),
            "between": per_rep[0]["peer_sent"] / low,
            "seconds_first": per_rep[0]["seconds"],
            "seconds_best": min(p["seconds"] for p in per_rep),
            "wrong": [w for p in per_rep for w in p["wrong"]],
        }
    for key in ("first", "best"):  # fan-out's time against the load without it
        out["True"][f"time_{key}"] = out["True"][f"seconds_{key}"] / out["False"][f"seconds_{key}"]
        out["False"][f"time_{key}"] = 1.0
    return out


GOALS = (
    ("bytes read from the files / unique", "store", 1.02),
    ("bytes read: busiest process / mean", "busiest", 1.10),
    ("bytes between processes / all-gather bound", "between", 1.05),
)
TIMES = (
    ("load time / fan_out=False's, first", "time_first"),
    ("load time / fan_out=False's, best repeat", "time_best"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json")
    ap.add_argument("--worker", nargs=3)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.experts, args.d, args.ffn, args.repeats = 2, 8, 256, 256, 1
        args.timeout = min(args.timeout, 240)
    argv = [f"--layers={args.layers}", f"--experts={args.experts}", f"--d={args.d}"]
    argv += [f"--ffn={args.ffn}", f"--repeats={args.repeats}"]
    if args.worker:
        rank, port, folder = args.worker
        print(json.dumps(worker(int(rank), int(port), folder, args)), flush=True)
        import jax

        jax.distributed.shutdown()
        return
    with tempfile.TemporaryDirectory() as d:
        unique = write(Path(d, "ckpt"), args)
        found = summarize(args, spawn(str(Path(d, "ckpt")), argv, args.timeout), unique)
    print(
        f"{PROCESSES} processes x {LOCAL} CPU devices (gloo), mesh (data=4, tensor=2); "
        f"MXFP4 plan of {args.layers} layers, {args.experts} experts, d={args.d}, "
        f"ffn={args.ffn}, into bfloat16; unique {found['unique'] / MiB:.2f} MiB, local files"
    )
    print("| measure | goal | fan_out=True | fan_out=False | met? |\n|---|---|---|---|---|")
    for what, key, limit in GOALS:
        on, off = found["True"][key], found["False"][key]
        met = "met" if on <= limit else "NOT met"
        print(f"| {what} | <= {limit:.2f} | {on:.3f} | {off:.3f} | {met} |")
    for what, key in TIMES:
        print(f"| {what} | | {found['True'][key]:.2f} | 1.00 | |")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))
    wrong = found["True"]["wrong"] + found["False"]["wrong"]
    missed = [k for _, k, limit in GOALS if found["True"][k] > limit]
    if wrong or (args.quick and missed):
        print("NOT met:", wrong[:5], missed)
        sys.exit(1)


if __name__ == "__main__":
    main()
