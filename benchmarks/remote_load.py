"""``meshinit.safetensors.load`` from S3 against its floor and a download (issue 43).

A checkpoint of ``--tensors`` f32 tensors of ``--rows`` x ``--cols`` (default 16 of
2048 x 8192: 1 GiB, in two files) is stored in moto's S3, served on 127.0.0.1 by
tests/storage_servers.py in a separate process, behind its counting proxy with
``fast_reads`` (moto itself copies the whole object on every ranged GET). Each
recipe runs in fresh processes onto ``P('fsdp', 'tensor')`` of a (2, 4) mesh of 8
simulated CPU devices (one process owns every block):

- ``meshinit``: ``meshinit.safetensors.load(plan, "s3://bench/ckpt/")``, every check
  on, ``max_inflight_bytes`` as given (``--inflight-mib``);
- ``floor``: the same client (obstore) fetching exactly the owned byte ranges, 16 at
  a time, into memory: no listing of the index, no checks, no placement;
- ``download``: the same client downloading the files whole, then
  ``meshinit.safetensors.load`` of the local copies;
- anchors: ``orbax-v1`` (``--anchors``): ``ocp.load("s3://...", abstract)`` under
  orbax's v1 safetensors layout (it reads s3:// through fsspec's s3fs); ``runai``
  (``--runai-python``, an interpreter with ``runai-model-streamer[s3]`` and torch):
  Run:ai's ``SafetensorsStreamer`` streaming every tensor into host memory.

Each process loads ``--repeats`` + 1 times; the time is the best after its first,
and each recipe runs in ``--rounds`` processes, the recipes taking turns. The peak RSS
increase is the largest first load's (over the process after jax's runtime is set
up); bytes are what the server sent for data (after each object's header reads) and
what meshinit reports it fetched (``/meshinit/safetensors/bytes_read``).

Goals: meshinit within 1.2x the floor and at most 0.5x the download; fetched /
owned <= 1.05; peak RSS <= max_inflight_bytes + 1.2x the owned bytes.

``--column-block F`` reads, instead of each tensor, a middle block of 1/F of its
columns (``Tensor(name, index=np.s_[:, a:b])``): what a host owns of a transposed
weight whose columns are split between F hosts, a short run of every stored row.
The floor then fetches exactly those runs, one request each; meshinit reads through
the gaps (``fetch.READ_THROUGH``). ``--latency-ms`` makes the server wait that long
before each answer, as an object store's time to first byte (tens of ms) does.

Run: python benchmarks/remote_load.py [--tensors N] [--rounds R] [--inflight-mib M]
     [--column-block F] [--latency-ms L]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKET, PREFIX = "bench", "ckpt"
MiB = 1 << 20


def serve(folder: str, latency: float) -> None:
    """The S3 server with the checkpoint stored; then ``stats``, ``reset``, ``quit``
    on stdin, one per line."""
    sys.path.insert(0, str(ROOT / "tests"))
    from storage_servers import S3Server

    server = S3Server(fast_reads=True)
    server.latency = latency
    server.bucket(BUCKET)
    for f in sorted(Path(folder).glob("*.safetensors")):
        server.put(f"{BUCKET}/{PREFIX}/{f.name}", f.read_bytes())
    print(json.dumps({"url": server.url, "env": server.env}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stats":
            log = [(r.method, r.path, r.status, r.sent, r.range) for r in server.counters.log]
            print(json.dumps(log), flush=True)
        elif cmd == "reset":
            server.counters.reset()
            print("[]", flush=True)
        elif cmd == "quit":
            break
    server.stop()


def runai_case(url: str, repeats: int) -> dict:
    """Run:ai's model streamer (``runai-model-streamer[s3]``, torch) streaming every
    tensor of the checkpoint into host memory: an anchor, in its own interpreter."""
    import resource as res

    from runai_model_streamer import SafetensorsStreamer, list_safetensors

    files = list_safetensors(url)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    times, peak, nbytes = [], 0, 0
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            got = {name: t for name, t in streamer.get_tensors()}
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
        del got
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            peak = res.getrusage(res.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "recipe": "runai",
        "seconds": min(times[1:]),
        "first": times[0],
        "rss_increase": peak,
        "owned": nbytes,
        "fetched": float(nbytes),
    }


def case(
    recipe: str, url: str, repeats: int, inflight: int, rank: int, port: int, block: int
) -> dict:
    import jax

    if port:  # one of two processes under jax.distributed, 4 devices each
        jax.config.update("jax_num_cpu_devices", 4)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    else:
        jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshinit
    from meshinit import safetensors as st

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    sharding = NamedSharding(mesh, P("fsdp", "tensor"))
    import obstore
    from obstore.store import from_url

    store = from_url(f"s3://{BUCKET}")
    metas = [m for batch in obstore.list(store, prefix=PREFIX) for m in batch]
    objects = sorted(m["path"] for m in metas if m["path"].endswith(".safetensors"))
    heads = {}
    for key in objects:  # the header of each file: the tensors' shapes and ranges
        n = int.from_bytes(bytes(obstore.get_range(store, key, start=0, end=8)), "little")
        header = json.loads(bytes(obstore.get_range(store, key, start=8, end=8 + n)))
        header.pop("__metadata__", None)
        heads[key] = (8 + n, header)
    stored = {name: tuple(i["shape"]) for _, h in heads.values() for name, i in h.items()}
    width = {n: c // block for n, (_, c) in stored.items()}  # the columns read
    first = {n: (block // 2) * width[n] for n in stored}  # from this stored column
    shapes = {n: (r, width[n]) for n, (r, _) in stored.items()}
    names = {n: st.Tensor(n, index=np.s_[:, first[n] : first[n] + width[n]]) for n in stored}
    init = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {n: meshinit.param(s, init, axes=("fsdp", "tensor"), mesh=mesh) for n, s in shapes.items()}
    )
    fetched = [0.0]

    def counted(event, value, **kwargs):
        if event == "/meshinit/safetensors/bytes_read":
            fetched[0] = value

    jax.monitoring.register_scalar_listener(counted)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    times, peak = [], 0

    def run() -> None:
        if recipe == "meshinit":
            arrays = st.load(plan, url, names=names, max_inflight_bytes=inflight)
            jax.block_until_ready(list(arrays.values()))
        elif recipe == "floor":
            import concurrent.futures

            ranges = owned_ranges(plan, heads, stored, first)
            pieces = [
                (key, lo, min(hi, lo + 16 * MiB))
                for key, a, hi in ranges
                for lo in range(a, hi, 16 * MiB)
            ]
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                got = list(
                    pool.map(lambda p: obstore.get_range(store, p[0], start=p[1], end=p[2]), pieces)
                )
            assert sum(len(g) for g in got) == sum(b - a for _, a, b in pieces)
            fetched[0] = sum(len(g) for g in got)
            del got
        elif recipe == "orbax-v1":  # orbax's v1 safetensors layout, reading s3:// itself
            import orbax.checkpoint.experimental.v1 as ocp

            abstract = {
                n: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
                for n, shape in shapes.items()
            }
            with ocp.Context(checkpoint_layout="safetensors"):
                arrays = ocp.load(url, abstract)
            jax.block_until_ready(list(arrays.values()))
        else:  # download, then a local load
            with tempfile.TemporaryDirectory() as d:
                for key in objects:
                    with open(Path(d) / key.rsplit("/", 1)[-1], "wb") as f:
                        for chunk in obstore.get(store, key).stream(min_chunk_size=16 * MiB):
                            f.write(chunk)
                arrays = st.load(plan, d, names=names)
                jax.block_until_ready(list(arrays.values()))
        if recipe != "floor":
            for name, a in arrays.items():  # every recipe places exactly
                assert a.sharding == sharding and a.shape == shapes[name]

    for _ in range(repeats + 1):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    owned = 0
    for e in plan.entries:  # this process's distinct blocks
        owned += sum(int(np.prod([b - a for a, b in blk])) * 4 for blk in blocks_of(e))
    return {
        "recipe": recipe,
        "seconds": min(times[1:]),
        "first": times[0],
        "rss_increase": peak,
        "owned": owned,
        "fetched": fetched[0],
    }


def write(folder: Path, tensors: int, rows: int, cols: int) -> None:
    """The checkpoint, in two files of half the tensors each, as a sharded one."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    half = tensors // 2
    for k, names in enumerate((range(half), range(half, tensors))):
        values = {f"t{i}": rng.standard_normal((rows, cols), np.float32) for i in names}
        save_file(values, str(folder / f"model-0000{k + 1}-of-00002.safetensors"))


def spawn(recipe: str, url: str, args: argparse.Namespace, env: dict) -> dict:
    """One recipe in fresh processes (two under jax.distributed with --processes 2):
    the slowest process's time and memory, the bytes of both."""
    python = args.runai_python if recipe == "runai" else sys.executable
    if recipe == "runai":  # path-style requests, as the local server takes them
        env = {**env, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
    cmd = [python, __file__, "--case", recipe, url]
    cmd += [f"--repeats={args.repeats}", f"--inflight-mib={args.inflight_mib}"]
    cmd += [f"--column-block={args.column_block}"]
    port = 0
    if args.processes == 2:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    procs = [
        subprocess.Popen(
            [*cmd, f"--rank={rank}", f"--port={port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(args.processes)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode:
            raise RuntimeError(err[-3000:])
        results.append(json.loads(out.strip().splitlines()[-1]))
    got = max(results, key=lambda r: r["seconds"])
    got["rss_increase"] = max(r["rss_increase"] for r in results)
    got["per_process"] = [(r["fetched"], r["owned"]) for r in results]
    return got


def blocks_of(entry) -> set:
    """This process's distinct blocks of a plan entry, as (start, stop) per axis."""
    shape = entry.spec.shape
    indices = entry.sharding.addressable_devices_indices_map(shape).values()
    return {tuple(sl.indices(n)[:2] for sl, n in zip(i, shape, strict=True)) for i in indices}


def owned_ranges(plan, heads: dict, stored: dict, first: dict) -> list[tuple[str, int, int]]:
    """The byte ranges of this process's blocks in the files (row-major f32, the
    plan's column 0 at stored column ``first``), merged: what the floor fetches."""
    where = {n: (key, start + i["data_offsets"][0]) for key, (start, h) in heads.items()
             for n, i in h.items()}  # fmt: skip
    spans: dict[str, list[tuple[int, int]]] = {}
    for e in plan.entries:
        key, begin = where[e.path]
        cols = stored[e.path][1]
        for (r0, r1), (c0, c1) in blocks_of(e):
            c0, c1 = c0 + first[e.path], c1 + first[e.path]
            for r in range(r0, r1):
                spans.setdefault(key, []).append(
                    (begin + 4 * (r * cols + c0), begin + 4 * (r * cols + c1))
                )
    out = []
    for key, found in spans.items():
        found.sort()
        merged = [list(found[0])]
        for a, b in found[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out += [(key, a, b) for a, b in merged]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--inflight-mib", type=int, default=1024)
    ap.add_argument("--json")
    ap.add_argument("--serve")
    ap.add_argument("--case", nargs=2)
    ap.add_argument("--processes", type=int, choices=(1, 2), default=1)
    ap.add_argument(
        "--runai-python", help="an interpreter with runai-model-streamer[s3] (and torch)"
    )
    ap.add_argument("--anchors", action="store_true", help="orbax v1 too (needs s3fs)")
    ap.add_argument("--column-block", type=int, default=1, help="read 1/F of the columns")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="the server's, per answer")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.latency_ms / 1000)
        return
    if args.case:
        recipe, url = args.case
        if recipe == "runai":
            print(json.dumps(runai_case(url, args.repeats)), flush=True)
            return
        got = case(
            recipe, url, args.repeats, args.inflight_mib * MiB, args.rank, args.port,
            args.column_block,
        )  # fmt: skip
        print(json.dumps(got), flush=True)
        if args.port:
            import jax

            jax.distributed.shutdown()
        return
    with tempfile.TemporaryDirectory() as d:
        write(Path(d), args.tensors, args.rows, args.cols)
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", d, f"--latency-ms={args.latency_ms}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            hello = json.loads(server.stdout.readline())
            env = {**os.environ, **hello["env"], "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
            url = f"s3://{BUCKET}/{PREFIX}/"
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                recipes = ["floor", "meshinit", "download"]
                whole = args.processes == 1 and args.column_block == 1  # what anchors read
                if args.anchors and whole:
                    recipes.append("orbax-v1")
                if args.runai_python and whole:
                    recipes.append("runai")
                for recipe in recipes:
                    server.stdin.write("reset\n")
                    server.stdin.flush()
                    server.stdout.readline()
                    got = spawn(recipe, url, args, env)
                    server.stdin.write("stats\n")
                    server.stdin.flush()
                    log = json.loads(server.stdout.readline())
                    data = [e for e in log if e[0] == "GET" and e[2] in (200, 206)]
                    headers = [e for e in data if e[4] and e[4][0] == 0]  # header reads
                    got["sent_per_load"] = (
                        sum(e[3] for e in data) - sum(e[3] for e in headers)
                    ) / (args.repeats + 1)
                    kept = best.setdefault(recipe, got)
                    kept["seconds"] = min(kept["seconds"], got["seconds"])
                    kept["rss_increase"] = max(kept["rss_increase"], got["rss_increase"])
        finally:
            server.stdin.write("quit\n")
            server.stdin.close()
            server.wait(timeout=60)
    floor = best["floor"]["seconds"]
    size = args.tensors * args.rows * args.cols * 4
    m, dl = best["meshinit"], best["download"]
    owned = sum(o for _, o in m["per_process"])  # every process's, each block once
    print(
        f"checkpoint: {args.tensors} x ({args.rows}, {args.cols}) f32, {size / 2**30:.2f} GiB; "
        f"{args.processes} process(es); 1/{args.column_block} of the columns; server "
        f"latency {args.latency_ms:g} ms"
    )
    print("| recipe | seconds | vs floor | peak RSS increase | sent / owned |")
    print("|---|---|---|---|---|")
    for name, r in best.items():
        print(
            f"| {name} | {r['seconds']:.3f} | {r['seconds'] / floor:.2f}x | "
            f"{r['rss_increase'] / 2**30:.2f} GiB | {r['sent_per_load'] / owned:.3f} |"
        )
    mine = max(o for _, o in m["per_process"])
    bound = args.inflight_mib * MiB + 1.2 * mine
    each = ", ".join(f"{f / o:.3f}" for f, o in m["per_process"])
    print(
        f"goals: meshinit / floor {m['seconds'] / floor:.2f}x (<= 1.2x), meshinit / download "
        f"{m['seconds'] / dl['seconds']:.2f}x (<= 0.5x), fetched / owned per process {each} "
        f"reported, {m['sent_per_load'] / owned:.3f} at the server (<= 1.05), peak RSS "
        f"{m['rss_increase'] / 2**30:.2f} GiB (<= {bound / 2**30:.2f} GiB)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(best, indent=1))


if __name__ == "__main__":
    main()
