"""``meshinit.safetensors.save`` (issue 66's goals) against the gather-to-process-0
route, on 4 processes x 2 CPU devices (gloo) with a capped S3 server and a local
folder; ``--tpu``: 2 GiB from one chip's HBM to a local folder (benchmarks/export_tpu.py).

The model: a Llama-like stack, scanned (every per-layer weight one array with a
leading layer axis), bf16: ``embed`` (vocab, d), per layer ``q`` (d, heads x head_dim),
``k`` and ``v`` (d, kv x head_dim), ``o``, ``gate``, ``up`` (d, ffn), ``down`` and the two
norms, then ``norm`` and ``head`` (d, vocab). Placed on a ``(data=4, tensor=2)`` mesh
whose ``data`` axis spans the processes (each process's two devices are one row):
matrices ``P(None, 'data', 'tensor')`` (``o``, ``down`` the other way round), norms
replicated. At the defaults (d=1024, ffn=4096, 8 heads and 2 kv heads of 128, vocab
8192) it holds 264 MiB at 8 layers and 960 MiB at 32: the second is about 4x the
first, so the two depths are both the compile check and the memory check. Exported
with ``names=`` Hugging Face's Llama names, a ``Stack`` per scanned array (each layer's
matrix transposed, as HF stores ``(out, in)``).

Cases, each in 4 fresh worker processes (``jax.distributed`` on 127.0.0.1), per depth:

- ``meshinit/local``, ``meshinit/s3``: ``meshinit.safetensors.save(arrays, dest,
  names=..., max_inflight_bytes=--inflight-mib)``, to a folder on the local disk or to
  ``s3://bench/<case>/``;
- ``gather/local``, ``gather/s3``: levanter's route: ``multihost_utils.process_allgather``
  of each array (every process gets the whole array on its host), then on process 0
  the per-layer, transposed tensors and ``safetensors.numpy.save_file`` of one
  ``model.safetensors`` (to the folder; for S3 to a temporary file that obstore then
  uploads, multipart, signed by process 0). Its time ends when process 0 is done (the
  others wait in a barrier). The fsync that meshinit's files get is timed apart.

The S3 server (tests/storage_servers.S3Server, moto behind its counting proxy) runs in
its own process behind benchmarks/throttle.py's forwarder, one token bucket of
``--bandwidth-mib`` MiB/s for every connection and both directions (the store's link).
Each process signs with its own access key id (``proc-<i>-<case>``), so the proxy's
log (``Served.client``, ``Served.received``: request body bytes) gives each process's
upload; the files it holds are listed straight from moto afterwards.

Per process and case: the time from a barrier until ``save`` returns; the peak RSS
increase over the process just before (VmHWM reset through ``/proc/self/clear_refs``,
and VmRSS sampled every 5 ms in a thread: the larger is reported); the compiles
(``jax.monitoring``'s backend compile events, and the export's program cache,
``meshinit._checkpoint.write.programs.programs``); the bytes its TCP sockets to the
other workers sent (``ss -tinpH`` of its PID, as benchmarks/fanout.py). meshinit's
local export is checked against the arrays (first and last layer of ``q``, ``embed``,
``head``, read back with ``safe_open``) outside the timing.

Run: python benchmarks/export.py [--layers 8 32] [--bandwidth-mib 32] [--inflight-mib 128]
         [--cases meshinit/local meshinit/s3 gather/local gather/s3] [--repeats 2]
         [--json OUT]
     python benchmarks/export.py --from-json OUT   # the tables again, nothing measured
     python benchmarks/export.py --quick    # 2 and 4 layers at d=256, no cap; ~2 min
     python benchmarks/export.py --tpu [--mib 2048] [--repeats 3]   # see export_tpu.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import fanout  # benchmarks/ is this script's first sys.path entry
from export_model import hf_tensors, make, model_bytes, names

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bench"
MiB = 1 << 20
PROCESSES, LOCAL = 4, 2
EVENT = "/jax/core/compile/backend_compile_duration"
SECRET = "testing"
CASES = ("meshinit/local", "meshinit/s3", "gather/local", "gather/s3")


def serve(rate: float) -> None:
    """The S3 server behind the throttle; then on stdin ``stats PREFIX`` (bytes each
    access key id sent in request bodies, requests, the objects under PREFIX and their
    sizes; the objects are then deleted) or ``quit``."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
    from storage_servers import S3Server
    from throttle import Throttle

    server = S3Server()
    server.bucket(BUCKET)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    throttle = Throttle(host, int(port), rate)
    env = {**server.env, "AWS_ENDPOINT_URL": throttle.url}
    print(json.dumps({"env": env, "port": throttle.port}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["stats"]:
            prefix = f"{BUCKET}/{words[1]}/"
            clients: dict[str, list[int]] = {}
            for s in server.counters.log:
                if s.path.startswith(prefix) and s.client is not None:
                    got = clients.setdefault(s.client, [0, 0, 0])
                    got[0] += s.received
                    got[1] += 1
                    got[2] += s.status >= 300
            listed = server.client.list_objects_v2(Bucket=BUCKET, Prefix=words[1] + "/")
            objects = {o["Key"]: o["Size"] for o in listed.get("Contents", [])}
            for key in objects:
                server.client.delete_object(Bucket=BUCKET, Key=key)
            print(json.dumps({"clients": clients, "objects": objects}), flush=True)
        elif words[:1] == ["quit"]:
            break
    throttle.stop()
    server.stop()


# ----------------------------------------------------------------------- the workers


class Peak:
    """This process's peak RSS over a stretch: VmHWM after a reset, and VmRSS sampled
    every 5 ms, each less VmRSS at the start."""

    def __init__(self) -> None:
        self.base = self.top = rss("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to VmRSS
            self.hwm = True
        except OSError:
            self.hwm = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.top = max(self.top, rss("VmRSS"))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        hwm = rss("VmHWM") - self.base if self.hwm else None
        sampled = self.top - self.base
        return {"base": self.base, "hwm": hwm, "sampled": sampled, "peak": max(hwm or 0, sampled)}


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def options(key: str) -> dict:
    return {"access_key_id": key, "secret_access_key": SECRET, "region": "us-east-1"}


def gather_route(arrays: dict, layers: int, dest: str, key: str, scratch: str) -> dict:
    """levanter's: every array gathered to every host, then one file from process 0."""
    import jax
    from jax.experimental import multihost_utils
    from safetensors.numpy import save_file

    parts: dict = {}
    start = time.perf_counter()
    whole = {p: multihost_utils.process_allgather(a, tiled=True) for p, a in arrays.items()}
    parts["gather"] = time.perf_counter() - start
    if jax.process_index() == 0:
        at = time.perf_counter()
        tensors = hf_tensors(whole, layers)
        folder = dest if not dest.startswith("s3://") else scratch
        file = os.path.join(folder, "model.safetensors")
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, file, metadata={"format": "pt"})
        parts["save_file"] = time.perf_counter() - at
        del tensors
        if dest.startswith("s3://"):
            import obstore
            from obstore.store import S3Store

            at = time.perf_counter()
            bucket, _, prefix = dest.removeprefix("s3://").partition("/")
            store = S3Store(
                bucket,
                endpoint=os.environ["AWS_ENDPOINT_URL"],
                client_options={"allow_http": True},
                **options(key),
            )
            obstore.put(store, prefix + "model.safetensors", Path(file))
            parts["upload"] = time.perf_counter() - at
            os.unlink(file)
        else:
            at = time.perf_counter()
            fd = os.open(file, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            parts["fsync_after"] = time.perf_counter() - at
    del whole
    parts["done"] = time.perf_counter() - start
    return parts


def check(arrays: dict, folder: str, layers: int) -> list[str]:
    """meshinit's local files against the arrays: embed, head, q's first and last
    layer (every process takes part in the gathers; process 0 compares)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from safetensors import safe_open

    want = {
        "model.embed_tokens.weight": arrays["embed"],
        "lm_head.weight": arrays["head"],
        "model.layers.0.self_attn.q_proj.weight": arrays["layers.q"],
    }
    whole = {n: multihost_utils.process_allgather(a, tiled=True) for n, a in want.items()}
    whole["lm_head.weight"] = whole["lm_head.weight"].T
    q = whole["model.layers.0.self_attn.q_proj.weight"]
    whole["model.layers.0.self_attn.q_proj.weight"] = q[0].T
    whole[f"model.layers.{layers - 1}.self_attn.q_proj.weight"] = q[-1].T
    if jax.process_index():
        return []
    index = json.loads(Path(folder, "model.safetensors.index.json").read_text())["weight_map"]
    wrong = []
    for name, value in whole.items():
        with safe_open(os.path.join(folder, index[name]), "flax") as f:
            got = np.asarray(f.get_tensor(name))
        if got.shape != value.shape or got.tobytes() != np.ascontiguousarray(value).tobytes():
            wrong.append(f"{name}: the file's tensor differs from the array")
    return wrong


def worker(rank: int, port: int, case: str, where: str, skip: int, a) -> dict:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's, on a hang
    sys.path.insert(0, str(ROOT / "tests"))
    import helpers

    helpers.join_cpu_job(rank, port, PROCESSES, LOCAL)
    import jax
    import numpy as np
    from fanout import moved, peer_bytes
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    import meshinit
    from meshinit._checkpoint.write import programs

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(PROCESSES, LOCAL), ("data", "tensor"))
    arrays = make(a, mesh)
    jax.block_until_ready(list(arrays.values()))
    compiles = {"count": 0, "seconds": 0.0}

    def count(event, seconds, **kwargs):
        if event == EVENT:
            compiles["count"] += 1
            compiles["seconds"] += seconds

    jax.monitoring.register_event_duration_secs_listener(count)
    out: dict = {"rank": rank, "case": case, "layers": a.layers, "runs": []}
    for rep in range(a.repeats):
        tag = f"L{a.layers}-{case.replace('/', '-')}-r{rep}"
        key = f"proc-{rank}-{tag}"
        dest = f"s3://{BUCKET}/{tag}/" if case.endswith("/s3") else os.path.join(where, tag)
        jax.clear_caches()
        meshinit.clear_cache()
        multihost_utils.sync_global_devices(f"{tag}/{rep}")
        print(f"{time.strftime('%X')} {tag} #{rep}", file=sys.stderr, flush=True)
        compiles.update(count=0, seconds=0.0)
        before = peer_bytes(os.getpid(), {port, skip})
        peak = Peak()
        start = time.perf_counter()
        if case.startswith("meshinit"):
            report = meshinit.safetensors.save(
                arrays,
                dest,
                names=names(a.layers),
                storage_options=options(key) if dest.startswith("s3://") else None,
                max_inflight_bytes=int(a.inflight_mib * MiB),
            )
            seconds = time.perf_counter() - start
            parts = {"bytes_by_process": list(report.bytes_by_process), "files": len(report.files)}
        else:
            parts = gather_route(arrays, a.layers, dest, key, os.path.join(where, f"{tag}-tmp"))
            multihost_utils.sync_global_devices(f"{tag}/{rep}/end")
            seconds = time.perf_counter() - start
        memory = peak.stop()
        sent, received = moved(before, peer_bytes(os.getpid(), {port, skip}))
        run = dict(tag=tag, key=key, seconds=seconds, rss=memory, peer_sent=sent,
                   peer_received=received, compiles=dict(compiles),
                   programs=len(programs.programs), **parts)  # fmt: skip
        if case == "meshinit/local":
            run["wrong"] = check(arrays, dest, a.layers)
        multihost_utils.sync_global_devices(f"{tag}/checked")
        if rank == 0 and not dest.startswith("s3://"):
            shutil.rmtree(dest, ignore_errors=True)
        out["runs"].append(run)
    multihost_utils.sync_global_devices(f"L{a.layers}-{case}/done")
    return out


# ------------------------------------------------------------------------ the driver


MODEL_FLAGS = ("d", "ffn", "heads", "kv_heads", "head_dim", "vocab", "inflight_mib", "repeats")


def spawn(case: str, layers: int, where: str, skip: int, a, env: dict) -> list[dict]:
    """One case at one depth on 4 fresh workers; each one's result."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in MODEL_FLAGS]
    tail = [case, where, str(skip), f"--layers={layers}", *flags]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port), *tail], **pipes)
        for r in range(PROCESSES)
    ]
    return fanout.collect(procs, a.timeout, f"export: {case} at {layers} layers")


def measure(a) -> dict:
    """Every case at every depth; the S3 server's counts for each S3 run."""
    found: dict = {"config": vars(a) | {"processes": PROCESSES, "local_devices": LOCAL}}
    s3 = any(c.endswith("/s3") for c in a.cases)
    with tempfile.TemporaryDirectory(dir=a.scratch) as where:
        server = None
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        skip = 0
        if s3:
            cmd = [sys.executable, __file__, "--serve", f"--bandwidth-mib={a.bandwidth_mib}"]
            server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            hello = json.loads(server.stdout.readline())
            env.update(hello["env"])
            env.pop("AWS_ACCESS_KEY_ID", None)  # each process signs with its own
            skip = hello["port"]
        try:
            for layers in a.layers:
                for case in a.cases:
                    print(f"{time.strftime('%X')} {case}, {layers} layers", flush=True)
                    workers = spawn(case, layers, where, skip, a, env)
                    stored = []
                    for rep in range(a.repeats):
                        if case.endswith("/s3"):
                            server.stdin.write(f"stats {workers[0]['runs'][rep]['tag']}\n")
                            server.stdin.flush()
                            stored.append(json.loads(server.stdout.readline()))
                    found[f"{layers}/{case}"] = {"workers": workers, "store": stored}
        finally:
            if server is not None:
                server.stdin.write("quit\n")
                server.stdin.close()
                server.wait(timeout=60)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--inflight-mib", type=float, default=128)
    ap.add_argument("--bandwidth-mib", type=float, default=32.0, help="the cap; 0: none")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per case")
    ap.add_argument("--scratch", default=None, help="where the local folders go")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--from-json", help="print the tables of an earlier --json; measure nothing")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--worker", nargs=5)
    ap.add_argument("--tpu", action="store_true")
    if "--tpu" in sys.argv[1:]:  # its own flags (--repeats, --json, ... too)
        import export_tpu

        sys.exit(export_tpu.main([x for x in sys.argv[1:] if x != "--tpu"]))
    a = ap.parse_args()
    if a.quick:
        a.layers, a.d, a.ffn, a.vocab, a.bandwidth_mib = [2, 4], 256, 512, 1024, 0
        a.inflight_mib = 4
    if a.serve:
        serve(a.bandwidth_mib * MiB)
        return
    if a.worker:
        rank, port, case, where, skip = a.worker
        a.layers = a.layers[0]
        got = worker(int(rank), int(port), case, where, int(skip), a)
        print(json.dumps(got), flush=True)
        import jax

        jax.distributed.shutdown()
        return
    started = time.time()
    if a.from_json:
        found = json.loads(Path(a.from_json).read_text())["raw"]
        keep = ("layers", "repeats", "cases", "d", "ffn", "vocab", "heads", "kv_heads",
                "head_dim", "inflight_mib", "bandwidth_mib")  # fmt: skip
        vars(a).update({k: found["config"][k] for k in keep})
    else:
        found = measure(a)
    from export_report import details, goals, summarize, table

    s = summarize(a, found)
    sizes = ", ".join(
        f"{model_bytes(argparse.Namespace(**{**vars(a), 'layers': n})) / MiB:.0f} MiB at {n} layers"
        for n in a.layers
    )
    print(
        f"\n{PROCESSES} processes x {LOCAL} CPU devices (gloo), mesh (data=4, tensor=2); "
        f"bf16 Llama-like stack d={a.d}, ffn={a.ffn}, vocab={a.vocab}: {sizes}; "
        f"max_inflight_bytes {a.inflight_mib:g} MiB; "
        + (f"S3 capped at {a.bandwidth_mib:g} MiB/s" if a.bandwidth_mib else "S3 uncapped")
        + ("" if a.from_json else f"; {time.time() - started:.0f} s")
        + "\n"
    )
    print(table(["measure", "goal", "value", "met?"], goals(a, s)))
    print()
    head = ["depth, case", "rep", "time", "peak RSS increase per process (MiB)",
            "socket bytes between processes / model", "export programs (compiles, s)",
            "gather route on process 0"]  # fmt: skip
    print(table(head, details(a, s)))
    wrong = [w for v in s.values() for r in v["reps"] for w in r["wrong"]]
    if wrong:
        print("WRONG: " + "; ".join(wrong[:10]))
    if a.json and not a.from_json:
        Path(a.json).write_text(json.dumps({"raw": found, "summary": s}, indent=1))
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
