"""Issues 58 and 67: ``meshinit.safetensors.load``'s fan-out against every process
reading what it holds, on ``--processes`` x 2 CPU devices (gloo) and a capped S3 server.

A mixed plan on a ``(data, tensor)`` mesh of the devices in process order (``--mesh
RxC``; by default a process a row, ``(data=4, tensor=2)``): per layer a sharded
``attn`` ``P('data', 'tensor')``, ``up`` and ``down`` replicated over ``data``
(``P(None, 'tensor')``, ``P('tensor', None)``), a replicated ``norm`` ``P()``, plus a
sharded ``embed``; ``--dtype`` f32, bf16 or f16, two files a depth, in moto's S3
(tests/storage_servers.S3Server, ``fast_reads``) in a separate process, behind a
forwarder (benchmarks/throttle.py) capping all clients at ``--bandwidth-mib`` MiB/s.
Each load signs with its own access key id, so the server counts each one's bytes.

Fresh workers for each depth load with ``fan_out=False`` and ``fan_out=None``,
``--repeats`` times each, caches cleared before a mode's first load (compiles counted
with a ``jax.monitoring`` listener). Per load: the time (after a barrier), the bytes
their TCP sockets to the other workers sent (``ss -tinpH`` of their PID before and
after, S3 and coordinator connections left out), ``bytes_read`` and
``bytes_from_peers``, each shard checked bit for bit and each sharding against the
plan. Measures (``unique``: the checkpoint's data bytes, every tensor once):

- store: data bytes the server sent / unique (header reads, from byte 0, apart);
- busiest: the bytes of the process that fetched most / the mean;
- due: bytes the peer sockets sent / the bytes due, ``bytes_from_peers`` summed (what
  each process holds and did not fetch, each distinct block once);
- between: the same / the all-gather bound, over blocks (R - 1) x its bytes, R the
  processes holding it. Where an axis crossing processes splits columns (``--mesh
  2x3``), fan-out reads whole rows and moves them back: that exchange is not in it;
- time: the slowest process's load at the cap / (unique / cap), first and best repeat;
- compiles added by fan-out: a mode's first load's compiles, None minus False.

``--quick``: a small plan, no cap, one load a mode; it asserts the structural goals
(values exact, bytes ratios, compiles equal at both depths) and exits non-zero if one
is missed. A meshinit without ``fan_out`` is measured as it is and said so.

Run: python benchmarks/fanout.py [--quick] [--layers 8 32] [--d 256] [--ffn 512]
     [--processes 4] [--mesh RxC] [--dtype float32] [--bandwidth-mib 16]
     [--repeats 1] [--timeout S] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bench"
MiB = 1 << 20
MODES = {"False": False, "None": None}
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fanout_goals import (  # noqa: E402
    LOCAL,
    PROCESSES,
    check_quick,
    goals,
    grid,
    layout,
    summarize,
)

EVENT = "/jax/core/compile/backend_compile_duration"
SECRET = "testing"


def write(folder: Path, layers: int, d: int, ffn: int, vocab: int, dtype: str) -> None:
    """The checkpoint of ``layers`` layers in two files, random values of ``dtype``."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(layers)
    items = list(layout(layers, d, ffn, vocab).items())
    folder.mkdir(parents=True)
    half = len(items) // 2
    kind = getattr(ml_dtypes, dtype, None) or np.dtype(dtype)
    for k, part in enumerate((items[:half], items[half:])):
        values = {n: rng.standard_normal(s).astype(kind) for n, (s, _) in part}
        save_file(values, str(folder / f"model-0000{k + 1}-of-00002.safetensors"))


# ------------------------------------------------------------------------ the server


def serve(folder: str, rate: float) -> None:
    """The S3 server with every depth's checkpoint, behind the throttle; then ``stats``
    (access key id -> [data bytes, header bytes] the files' GETs sent it) or ``quit``
    on stdin."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
    from storage_servers import S3Server
    from throttle import Throttle

    server = S3Server(fast_reads=True)
    server.bucket(BUCKET)
    data_from = {}
    for f in sorted(Path(folder).glob("*/*.safetensors")):
        key = f"{BUCKET}/{f.parent.name}/{f.name}"
        server.put(key, f.read_bytes())
        with open(f, "rb") as fh:
            data_from[key] = 8 + int.from_bytes(fh.read(8), "little")
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    throttle = Throttle(host, int(port), rate)
    env = {**server.env, "AWS_ENDPOINT_URL": throttle.url}
    print(json.dumps({"url": throttle.url, "env": env, "port": throttle.port}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            out: dict[str, list[int]] = {}
            for r in server.counters.log:
                if r.span is None or r.path not in data_from:
                    continue  # listings and errors carry no data
                start, stop = r.span
                # a read from byte 0 is a header read (its guess may run past the
                # header); in any other, the bytes before the data are header bytes
                data = 0 if start == 0 else max(0, stop - max(start, data_from[r.path]))
                got = out.setdefault(r.client, [0, 0])
                got[0] += data
                got[1] += stop - start - data
            print(json.dumps(out), flush=True)
        elif line.strip() == "quit":
            break
    throttle.stop()
    server.stop()


# ----------------------------------------------------------------------- the workers


def peer_bytes(pid: int, skip: set[int]) -> dict[tuple[str, str], tuple[int, int]]:
    """(local, peer) -> (bytes_sent, bytes_received) of ``pid``'s TCP sockets to other
    processes: not those with a port in ``skip`` at either end (the S3 and coordinator
    ones), nor those whose both ends are ``pid``'s own."""
    ss = shutil.which("ss", path=f"{os.defpath}:/usr/sbin:/sbin")  # PATH may be empty
    if ss is None:
        raise RuntimeError("fanout: `ss` (iproute2) not found: it counts the peer bytes")
    text = subprocess.run([ss, "-tinpH"], capture_output=True, text=True, check=True).stdout
    found, current = {}, None
    for line in text.splitlines():
        if not line[:1].isspace():  # a socket's first line: state, queues, ends, users
            fields = line.split()
            mine = f"pid={pid}," in line and len(fields) >= 5
            current = (fields[3], fields[4]) if mine else None
        elif current is not None:
            sent = re.search(r"bytes_sent:(\d+)", line)
            got = re.search(r"bytes_received:(\d+)", line)
            found[current] = (int(sent[1]) if sent else 0, int(got[1]) if got else 0)
    own = {local for local, _ in found}
    return {
        (local, peer): v
        for (local, peer), v in found.items()
        if peer not in own and not {int(e.rsplit(":", 1)[1]) for e in (local, peer)} & skip
    }


def moved(before: dict, after: dict) -> tuple[int, int]:
    """Bytes sent and received between two :func:`peer_bytes` snapshots."""
    sent = got = 0
    for ends, (s, r) in after.items():
        s0, r0 = before.get(ends, (0, 0))
        sent, got = sent + s - s0, got + r - r0
    return sent, got


def worker(rank: int, port: int, url: str, s3_port: int, folder: str, args) -> list[dict]:
    import faulthandler
    import inspect

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's, on a hang

    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=args.processes, process_id=rank)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    from safetensors.numpy import load_file

    import meshinit
    from meshinit import safetensors as st

    has_fan_out = "fan_out" in inspect.signature(st.load).parameters
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(grid(args)), ("data", "tensor"))
    seen = {"compiles": 0, "bytes_read": None, "bytes_from_peers": None}

    def count(event, *args, **kwargs):
        if event == EVENT:
            seen["compiles"] += 1

    def scalar(event, value, **kwargs):
        if event.startswith("/meshinit/safetensors/"):
            seen[event.rsplit("/", 1)[1]] = value

    jax.monitoring.register_event_duration_secs_listener(count)
    jax.monitoring.register_scalar_listener(scalar)
    skip = {port, s3_port}
    options = {"secret_access_key": SECRET, "region": "us-east-1"}
    results = []
    for layers in args.layers:
        shapes = layout(layers, args.d, args.ffn, args.vocab)
        zeros = jax.nn.initializers.zeros
        plan = meshinit.plan(
            {
                p: meshinit.param(s, zeros, axes=a, mesh=mesh, dtype=args.dtype)
                for p, (s, a) in shapes.items()
            }
        )
        planned = {e.path: e.sharding for e in plan.entries}
        stored: dict = {}
        for f in sorted(Path(folder, f"L{layers}").glob("*.safetensors")):
            stored.update(load_file(str(f)))
        for mode, fan_out in MODES.items():
            jax.clear_caches()
            meshinit.clear_cache()
            for rep in range(args.repeats):
                key = f"r{rank}L{layers}m{mode}n{rep}"
                kwargs = {"fan_out": fan_out} if has_fan_out else {}
                multihost_utils.sync_global_devices(key[key.index("L") :])
                print(f"{time.strftime('%X')} load {key}", file=sys.stderr, flush=True)
                seen.update(compiles=0, bytes_read=None, bytes_from_peers=None)
                before = peer_bytes(os.getpid(), skip)
                start = time.perf_counter()
                arrays = st.load(
                    plan,
                    f"{url}L{layers}/",
                    storage_options={**options, "access_key_id": key},
                    **kwargs,
                )
                jax.block_until_ready(list(arrays.values()))
                seconds = time.perf_counter() - start
                sent, received = moved(before, peer_bytes(os.getpid(), skip))
                wrong = []
                for path, a in arrays.items():
                    want = planned[path]
                    if a.sharding != want:
                        wrong.append(f"{path}: placed {a.sharding}, planned {want}")
                    for shard in a.addressable_shards:
                        got = np.asarray(shard.data)
                        if got.tobytes() != stored[path][shard.index].tobytes():
                            wrong.append(f"{path}{shard.index}: values differ from the file")
                for a in arrays.values():
                    a.delete()
                results.append(
                    dict(layers=layers, mode=mode, rep=rep, key=key, seconds=seconds,
                         peer_sent=sent, peer_received=received, wrong=wrong[:5],
                         fan_out_supported=has_fan_out, **seen)
                )  # fmt: skip
    multihost_utils.sync_global_devices("done")
    return results


# ------------------------------------------------------------------------ the driver


def spawn(
    url: str, s3_port: int, folder: str, argv: list[str], env: dict, timeout: float
) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, __file__, "--worker"]
    tail = [url, str(s3_port), folder, *argv]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    count = int(next(a for a in argv if a.startswith("--processes=")).split("=")[1])
    procs = [subprocess.Popen([*cmd, str(r), str(port), *tail], **pipes) for r in range(count)]
    return collect(procs, timeout, "fanout")


def collect(procs: list[subprocess.Popen], timeout: float, what: str) -> list[dict]:
    """The workers' results (each worker's last line of output, JSON: a list of results
    or one), each with its rank; a worker's failure raised with the tail of its stderr.
    Past ``timeout`` each worker prints its threads' stacks (faulthandler, on SIGUSR1)
    before it is killed."""
    results, failed = [], []
    deadline = time.monotonic() + timeout
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.send_signal(signal.SIGUSR1)
                time.sleep(2)
                for p in procs:
                    p.kill()
                text = "\n".join(p.communicate()[1][-4000:] for p in procs)
                raise RuntimeError(f"{what}: the workers ran past {timeout} s:\n{text}") from None
            if proc.returncode:
                failed.append(f"worker {rank} exited {proc.returncode}:\n{err[-3000:]}")
            else:
                got = json.loads(out.strip().splitlines()[-1])
                results += [dict(r, rank=rank) for r in (got if isinstance(got, list) else [got])]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if failed:
        raise RuntimeError(f"{what} failed:\n" + "\n".join(failed))
    return results


def measure(args, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        for layers in args.layers:
            write(Path(d, f"L{layers}"), layers, args.d, args.ffn, args.vocab, args.dtype)
        rate = args.bandwidth_mib * MiB
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", d, f"--bandwidth-mib={args.bandwidth_mib}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            hello = json.loads(server.stdout.readline())
            env = {**os.environ, **hello["env"], "JAX_PLATFORMS": "cpu"}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            env.pop("AWS_ACCESS_KEY_ID", None)  # each load gives its own
            loads = []
            for n in args.layers:  # fresh workers per depth: each depth's compiles alone
                each = ["--layers", str(n), *argv]
                loads += spawn(f"s3://{BUCKET}/", hello["port"], d, each, env, args.timeout)
            server.stdin.write("stats\n")
            server.stdin.flush()
            served = json.loads(server.stdout.readline())  # by each load's access key id
        finally:
            server.stdin.write("quit\n")
            server.stdin.close()
            server.wait(timeout=60)
    return summarize(args, loads, served, rate)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--bandwidth-mib", type=float, default=16.0, help="the cap; 0: none")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900, help="seconds for all the loads")
    ap.add_argument("--processes", type=int, default=PROCESSES)
    ap.add_argument("--mesh", help="the (data, tensor) mesh as RxC; default: processes x 2")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--json")
    ap.add_argument("--serve")
    ap.add_argument("--worker", nargs=5)
    args = ap.parse_args()
    if args.quick:
        # large enough that the collectives' fixed bytes per entry (about 8 KB here)
        # stay under 5% of the bound
        unit = math.lcm(*grid(args))  # every mesh axis divides each size
        wide = 2 if args.dtype in ("bfloat16", "float16") else 1  # as many bytes
        args.d, args.ffn, args.vocab = (-(-n // unit) * unit for n in (128, 256 * wide, 512))
        args.bandwidth_mib, args.repeats = 0, 1
        args.timeout = min(args.timeout, 240)
    argv = [f"--d={args.d}", f"--ffn={args.ffn}", f"--vocab={args.vocab}"]
    argv += [f"--repeats={args.repeats}", f"--processes={args.processes}"]
    argv += [f"--dtype={args.dtype}"] + ([f"--mesh={args.mesh}"] if args.mesh else [])
    if args.serve:
        serve(args.serve, args.bandwidth_mib * MiB)
        return
    if args.worker:
        rank, port, url, s3_port, folder = args.worker
        got = worker(int(rank), int(port), url, int(s3_port), folder, args)
        print(json.dumps(got), flush=True)
        import jax

        jax.distributed.shutdown()
        return
    found = measure(args, argv)
    n = args.layers
    unique = {k: found[f"{k}/None"]["unique"] for k in n}
    rows, cols = grid(args)
    print(
        f"{args.processes} processes x {LOCAL} CPU devices (gloo), mesh (data={rows}, "
        f"tensor={cols}); mixed plan {args.dtype}, d={args.d}, ffn={args.ffn}, "
        f"vocab={args.vocab}; unique "
        + ", ".join(f"{unique[k] / MiB:.1f} MiB at {k} layers" for k in n)
        + (f"; server capped at {args.bandwidth_mib:g} MiB/s" if args.bandwidth_mib else "")
    )
    print("| measure | goal | fan_out=None | fan_out=False | met? |")
    print("|---|---|---|---|---|")
    for row in goals(found, n):
        print("| " + " | ".join(row) + " |")
    if not all(found[f"{k}/None"]["supported"] for k in n):
        print("fan_out=None: this meshinit's safetensors.load has no fan_out (today's reads)")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))
    if args.quick and (wrong := check_quick(found, n, grid(args)[0] == args.processes)):
        print("quick: NOT met:\n" + "\n".join(wrong))
        sys.exit(1)


if __name__ == "__main__":
    main()
