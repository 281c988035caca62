"""Issue 67's FP8 case of fan-out (benchmarks/fanout.py's companion, which it reuses:
the capped S3 server, the socket counts): FP8 parameters loaded dequantized under
``jax.distributed``, 4 processes x 2 CPU devices (gloo), with ``fan_out=None`` against
``fan_out=False``.

Per layer, on a ``(data=4, tensor=2)`` mesh whose ``data`` axis spans the processes: a
sharded ``attn`` (``P('data', 'tensor')``, held once), and ``up`` and ``down`` split over
``tensor`` and replicated over ``data`` (R = 4 processes hold each block), each stored
as DeepSeek publishes it (``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` per
128 x 128 block) and planned in bfloat16. Without fan-out each holder fetches its own
float8 blocks (the replicated ones 4 times); with it, the float8 bytes are fetched once
for the job, split among the processes, gathered on the devices, then dequantized.

Measures, as fanout.py's (``unique``: the checkpoint's data bytes, float8 and scales,
each once): store (data bytes the server sent / unique), busiest (the bytes of the
process that fetched most / the mean), between (bytes the peer sockets sent / the
all-gather bound in stored bytes), time (the slowest process's load at the cap / (unique
/ cap), the first load and the best repeat). Every shard is checked bit for bit against
DeepSeek's ``weight_dequant`` in numpy.

Run: python benchmarks/fanout_fp8.py [--quick] [--layers 8] [--d 512] [--ffn 1024]
     [--bandwidth-mib 16] [--repeats 2] [--json OUT]
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
MODES = base.MODES
BLOCK = 128


def layout(layers: int, d: int, ffn: int) -> dict[str, tuple[tuple, tuple]]:
    """Path (its tensor's name too) -> (shape, mesh axes)."""
    out: dict[str, tuple[tuple, tuple]] = {}
    for i in range(layers):
        out[f"layers.{i}.attn"] = ((d, d), ("data", "tensor"))
        out[f"layers.{i}.up"] = ((ffn, d), (None, "tensor"))
        out[f"layers.{i}.down"] = ((d, ffn), ("tensor", None))
    return out


def tensors(layers: int, d: int, ffn: int) -> dict:
    """The stored tensors, seeded: each weight in float8_e4m3fn, its scales in float32."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(layers)
    out = {}
    for name, (shape, _) in layout(layers, d, ffn).items():
        out[name] = (rng.standard_normal(shape) * 40).astype(ml_dtypes.float8_e4m3fn)
        grid = tuple(-(-n // BLOCK) for n in shape)
        out[f"{name}_scale_inv"] = rng.uniform(1e-4, 1e-2, grid).astype(np.float32)
    return out


def dequantized(stored: dict, name: str):
    """DeepSeek's ``weight_dequant`` of ``name``, as bfloat16 bits."""
    import ml_dtypes
    import numpy as np

    w, s = stored[name], stored[f"{name}_scale_inv"]
    wide = np.repeat(np.repeat(s, BLOCK, 0), BLOCK, 1)[: w.shape[0], : w.shape[1]]
    return (w.astype(np.float32) * wide).astype(ml_dtypes.bfloat16).view(np.uint16)


def write(folder: Path, layers: int, d: int, ffn: int) -> int:
    """The checkpoint in two files; its data bytes."""
    from safetensors.numpy import save_file

    items = list(tensors(layers, d, ffn).items())
    folder.mkdir(parents=True)
    half = len(items) // 2 // 2 * 2  # a weight and its scales in one file
    for k, part in enumerate((items[:half], items[half:])):
        save_file(dict(part), str(folder / f"model-0000{k + 1}-of-00002.safetensors"))
    return sum(v.nbytes for _, v in items)


def worker(rank: int, port: int, url: str, s3_port: int, args) -> list[dict]:
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
    seen: dict = {"compiles": 0}

    def count(event, *a, **k):
        if event == base.EVENT:
            seen["compiles"] += 1

    def scalar(event, value, **k):
        if event.startswith("/meshinit/safetensors/"):
            seen[event.rsplit("/", 1)[1]] = value

    jax.monitoring.register_event_duration_secs_listener(count)
    jax.monitoring.register_scalar_listener(scalar)
    skip = {port, s3_port}
    options = {"secret_access_key": base.SECRET, "region": "us-east-1"}
    shapes = layout(args.layers[0], args.d, args.ffn)
    stored = tensors(args.layers[0], args.d, args.ffn)
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {
            p: meshinit.param(s, zeros, dtype=jnp.bfloat16, axes=a, mesh=mesh)
            for p, (s, a) in shapes.items()
        }
    )
    results = []
    for mode, fan_out in MODES.items():
        jax.clear_caches()
        meshinit.clear_cache()
        for rep in range(args.repeats):
            key = f"r{rank}m{mode}n{rep}"
            multihost_utils.sync_global_devices(key[key.index("m") :])
            seen.update(compiles=0, bytes_read=None, bytes_from_peers=None)
            before = base.peer_bytes(os.getpid(), skip)
            start = time.perf_counter()
            arrays = st.load(
                plan,
                f"{url}L{args.layers[0]}/",
                storage_options={**options, "access_key_id": key},
                fan_out=fan_out,
            )
            jax.block_until_ready(list(arrays.values()))
            seconds = time.perf_counter() - start
            sent, received = base.moved(before, base.peer_bytes(os.getpid(), skip))
            wrong = []
            for path, a in arrays.items():
                want = dequantized(stored, path)
                for shard in a.addressable_shards:
                    if not (np.asarray(shard.data).view(np.uint16) == want[shard.index]).all():
                        wrong.append(f"{path}{shard.index}: differs from weight_dequant")
                a.delete()
            results.append(
                dict(mode=mode, rep=rep, key=key, seconds=seconds, peer_sent=sent,
                     peer_received=received, wrong=wrong[:5], **seen)
            )  # fmt: skip
    multihost_utils.sync_global_devices("done")
    return results


def spawn(url: str, s3_port: int, argv: list[str], env: dict, timeout: float) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), str(port), url, str(s3_port), *argv],
            **pipes,
        )
        for r in range(PROCESSES)
    ]
    return base.collect(procs, timeout, "fanout_fp8")


def measure(args, argv: list[str]) -> dict:
    layers = args.layers[0]
    with tempfile.TemporaryDirectory() as d:
        unique = write(Path(d, f"L{layers}"), layers, args.d, args.ffn)
        server = subprocess.Popen(
            [sys.executable, base.__file__, "--serve", d, f"--bandwidth-mib={args.bandwidth_mib}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            hello = json.loads(server.stdout.readline())
            env = {**os.environ, **hello["env"], "JAX_PLATFORMS": "cpu"}
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(base.ROOT), env.get("PYTHONPATH")])
            )
            env.pop("AWS_ACCESS_KEY_ID", None)
            url = f"s3://{base.BUCKET}/"
            loads = spawn(url, hello["port"], argv, env, args.timeout)
            server.stdin.write("stats\n")
            server.stdin.flush()
            served = json.loads(server.stdout.readline())
        finally:
            server.stdin.write("quit\n")
            server.stdin.close()
            server.wait(timeout=60)
    return summarize(args, loads, served, unique)


def summarize(args, loads: list[dict], served: dict, unique: int) -> dict:
    # the all-gather bound: (R - 1) x each replicated block's stored bytes
    low = sum(
        (PROCESSES - 1) * s[0] * s[1]
        for s, axes in layout(args.layers[0], args.d, args.ffn).values()
        if "data" not in axes
    )
    at = unique / (args.bandwidth_mib * MiB) if args.bandwidth_mib else None
    out: dict = {"config": vars(args), "unique": unique, "bound": low}
    for mode in MODES:
        per_rep = []
        for rep in range(args.repeats):
            rows = sorted(
                (r for r in loads if r["mode"] == mode and r["rep"] == rep),
                key=lambda r: r["rank"],
            )
            data = [served.get(r["key"], (0, 0))[0] for r in rows]
            per_rep.append(
                {
                    "seconds": max(r["seconds"] for r in rows),
                    "per_process": data,
                    "peer_sent": sum(r["peer_sent"] for r in rows),
                    "bytes_read": [r["bytes_read"] for r in rows],
                    "from_peers": [r["bytes_from_peers"] for r in rows],
                    "compiles": max(r["compiles"] for r in rows),
                    "wrong": [w for r in rows for w in r["wrong"]],
                }
            )
        first = per_rep[0]
        data = first["per_process"]
        out[mode] = {
            "loads": per_rep,
            "store": sum(data) / unique,
            "busiest": max(data) / (sum(data) / len(data)),
            "between": first["peer_sent"] / low,
            "time_first": first["seconds"] / at if at else None,
            "time_best": min(p["seconds"] for p in per_rep[1:]) / at
            if at and len(per_rep) > 1
            else None,
            "wrong": [w for p in per_rep for w in p["wrong"]],
        }
    return out


GOALS = (
    ("data bytes served by the store / unique", "store", 1.02),
    ("bytes fetched: busiest process / mean", "busiest", 1.10),
    ("bytes between processes / all-gather bound", "between", 1.05),
    ("load time at the cap / (unique / cap), first", "time_first", 1.3),
    ("load time at the cap / (unique / cap), repeat", "time_best", 1.3),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, nargs=1, default=[8])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--bandwidth-mib", type=float, default=16.0, help="the cap; 0: none")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json")
    ap.add_argument("--worker", nargs=4)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.d, args.ffn, args.bandwidth_mib, args.repeats = [2], 256, 512, 0, 1
        args.timeout = min(args.timeout, 240)
    argv = [f"--layers={args.layers[0]}", f"--d={args.d}", f"--ffn={args.ffn}"]
    argv += [f"--repeats={args.repeats}"]
    if args.worker:
        rank, port, url, s3_port = args.worker
        print(json.dumps(worker(int(rank), int(port), url, int(s3_port), args)), flush=True)
        import jax

        jax.distributed.shutdown()
        return
    found = measure(args, argv)
    print(
        f"{PROCESSES} processes x {LOCAL} CPU devices (gloo), mesh (data=4, tensor=2); "
        f"FP8 plan of {args.layers[0]} layers, d={args.d}, ffn={args.ffn}, into bfloat16; "
        f"unique {found['unique'] / MiB:.2f} MiB"
        + (f"; server capped at {args.bandwidth_mib:g} MiB/s" if args.bandwidth_mib else "")
    )
    print("| measure | goal | fan_out=None | fan_out=False | met? |\n|---|---|---|---|---|")
    for what, key, limit in GOALS:
        on, off = found["None"][key], found["False"][key]
        cells = ["n/a" if x is None else f"{x:.3f}" for x in (on, off)]
        met = "n/a" if on is None else "met" if on <= limit else "NOT met"
        print(f"| {what} | <= {limit:.2f} | {cells[0]} | {cells[1]} | {met} |")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))
    wrong = found["None"]["wrong"] + found["False"]["wrong"]
    missed = [k for _, k, limit in GOALS[:3] if found["None"][k] > limit]
    if wrong or (args.quick and missed):
        print("NOT met:", wrong[:5], missed)
        sys.exit(1)


if __name__ == "__main__":
    main()
