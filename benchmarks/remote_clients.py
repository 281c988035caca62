"""Which client fetches a process's byte ranges of a remote object fastest (issue 43).

One object of ``--mib`` MiB (default 256) of random bytes is stored in moto's S3 and as
a file of a Hub-like repo, both served on 127.0.0.1 by tests/storage_servers.py in a
separate process (so the servers' Python does not share this process's GIL), moto
behind its counting proxy with ``fast_reads`` (moto itself copies the whole object on
every ranged GET; ``--moto-too`` adds one row of moto's own answers). A process of a
(2, 4) mesh owns every 8th ``--block-mib`` MiB block (``--layout blocks``: 1/8 of the
bytes, in many ranges) or the first half of each 16 MiB tensor (``--layout half``), and
each client fetches exactly those ranges concurrently into memory, or the whole object:

- S3: s3fs ``cat_ranges`` (fsspec's async gather), obstore ``get_ranges`` (merges
  ranges under 1 MiB apart, 10 requests at a time), obstore ``get_range_async`` x
  ``--concurrency`` under asyncio; whole: s3fs ``cat_file``, obstore ``get``, and
  obstore ``get_range_async`` of 16 MiB pieces, ``--concurrency`` at a time;
- HTTP / the Hub (``/{repo}/resolve/main/{file}``): ``HfFileSystem.cat_ranges`` (its
  files read ahead 5 MiB blocks), ``HfFileSystem.cat_file`` per range with
  ``cache_type="none"`` (exact, one after another), fsspec's
  ``HTTPFileSystem.cat_ranges``, obstore's ``HTTPStore`` ``get_ranges``.

Each is timed ``--rounds`` times (best and median reported) after one untimed call that
lists or heads the object; every fetched byte is checked. Bytes and requests are what
the server counted: bytes / owned says how much a client read beyond what it needed.

Run: python benchmarks/remote_clients.py [--mib 256] [--layout blocks|half] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKET, KEY, REPO, FILE = "bench", "model/model.safetensors", "org/model", "model.safetensors"
MiB = 1 << 20


def payload(mib: int) -> bytes:
    import numpy as np

    return np.random.default_rng(0).bytes(mib * MiB)


# --- the server process -------------------------------------------------------------


def serve(mib: int, folder: str) -> None:
    """Start the servers, store the object, then answer commands on stdin, one per
    line: ``stats`` (the counters as JSON), ``reset``, ``quit``."""
    sys.path.insert(0, str(ROOT / "tests"))
    from storage_servers import FileServer, S3Server

    data = payload(mib)
    fast = S3Server(fast_reads=True)
    moto = S3Server()  # the same moto backend (process-global), moto's own answers
    fast.bucket(BUCKET)
    fast.put(f"{BUCKET}/{KEY}", data)
    files = FileServer(folder)
    files.put(f"{REPO}/{FILE}", data)
    del data
    servers = {"s3": fast, "moto": moto, "http": files}
    print(json.dumps({k: s.url for k, s in servers.items()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stats":
            out = {}
            for name, s in servers.items():
                c = s.counters
                out[name] = {"bytes": c.bytes_sent, "requests": c.requests}
            print(json.dumps(out), flush=True)
        elif cmd == "reset":
            for s in servers.values():
                s.counters.reset()
            print("{}", flush=True)
        elif cmd == "quit":
            break
    for s in servers.values():
        s.stop()


class Servers:
    def __init__(self, mib: int, folder: str):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--mib", str(mib), "--dir", folder],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.urls = json.loads(self.proc.stdout.readline())

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --- the clients --------------------------------------------------------------------


def s3_options(url):
    return {"endpoint_url": url, "key": "testing", "secret": "testing"}


def obstore_s3(url):
    from obstore.store import S3Store

    return S3Store(
        BUCKET, endpoint=url, access_key_id="testing", secret_access_key="testing",
        region="us-east-1", client_options={"allow_http": True},
    )  # fmt: skip


def cases(urls: dict, starts: list[int], ends: list[int], size: int, concurrency: int):
    """``{name: (server, setup() -> fetch() -> list of buffers, whole?)}``."""
    import fsspec
    import obstore
    import s3fs
    from huggingface_hub import HfFileSystem
    from obstore.store import HTTPStore

    path = f"{BUCKET}/{KEY}"
    pieces = list(range(0, size, 16 * MiB))

    def s3fs_fs(url):
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options(url))
        fs.info(path)
        return fs

    def s3fs_ranges(url):
        fs = s3fs_fs(url)
        return lambda: fs.cat_ranges([path] * len(starts), starts, ends)

    def obstore_ranges(url):
        store = obstore_s3(url)
        obstore.head(store, KEY)
        return lambda: obstore.get_ranges(store, KEY, starts=starts, ends=ends)

    def gathered(store, key, starts, ends):
        async def run():
            gate = asyncio.Semaphore(concurrency)

            async def one(s, e):
                async with gate:
                    return await obstore.get_range_async(store, key, start=s, end=e)

            return await asyncio.gather(*(one(s, e) for s, e in zip(starts, ends, strict=True)))

        # one loop for every call: asyncio.run per call cost ~0.8 s each here (obstore
        # 0.12.1, the time goes in closing the loop), whatever the request
        loop = asyncio.new_event_loop()
        return lambda: loop.run_until_complete(run())

    def obstore_async(url):
        store = obstore_s3(url)
        obstore.head(store, KEY)
        return gathered(store, KEY, starts, ends)

    def s3fs_whole(url):
        fs = s3fs_fs(url)
        return lambda: [fs.cat_file(path)]

    def obstore_whole(url):
        store = obstore_s3(url)
        obstore.head(store, KEY)
        return lambda: [obstore.get(store, KEY).bytes()]

    def obstore_pieces(url):
        store = obstore_s3(url)
        obstore.head(store, KEY)
        return gathered(store, KEY, pieces, [min(p + 16 * MiB, size) for p in pieces])

    def hf_ranges(url):
        fs = HfFileSystem(skip_instance_cache=True, endpoint=url, token=False)
        fs.info(f"{REPO}/{FILE}")
        return lambda: fs.cat_ranges([f"{REPO}/{FILE}"] * len(starts), starts, ends)

    def hf_exact(url):
        fs = HfFileSystem(skip_instance_cache=True, endpoint=url, token=False)
        fs.info(f"{REPO}/{FILE}")
        target = f"{REPO}/{FILE}"
        return lambda: [
            fs.cat_file(target, s, e, cache_type="none") for s, e in zip(starts, ends, strict=True)
        ]

    def http_ranges(url):
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        target = f"{url}/{REPO}/resolve/main/{FILE}"
        fs.info(target)
        return lambda: fs.cat_ranges([target] * len(starts), starts, ends)

    def obstore_http(url):
        store = HTTPStore.from_url(url, client_options={"allow_http": True})
        target = f"{REPO}/resolve/main/{FILE}"
        obstore.head(store, target)
        return lambda: obstore.get_ranges(store, target, starts=starts, ends=ends)

    return {
        "s3 | s3fs cat_ranges": ("s3", s3fs_ranges, False),
        "s3 | obstore get_ranges": ("s3", obstore_ranges, False),
        f"s3 | obstore get_range_async x{concurrency}": ("s3", obstore_async, False),
        "s3 | moto's own answers: obstore get_ranges": ("moto", obstore_ranges, False),
        "s3 | whole: s3fs cat_file": ("s3", s3fs_whole, True),
        "s3 | whole: obstore get": ("s3", obstore_whole, True),
        f"s3 | whole: obstore 16 MiB ranges x{concurrency}": ("s3", obstore_pieces, True),
        "hf | HfFileSystem cat_ranges": ("http", hf_ranges, False),
        "hf | HfFileSystem cat_file, cache_type=none": ("http", hf_exact, False),
        "https | fsspec HTTPFileSystem cat_ranges": ("http", http_ranges, False),
        "https | obstore HTTPStore get_ranges": ("http", obstore_http, False),
    }


def owned(layout: str, size: int, block: int) -> tuple[list[int], list[int]]:
    if layout == "blocks":  # device 0 of 8: every 8th block
        starts = list(range(0, size, 8 * block))
        return starts, [min(s + block, size) for s in starts]
    tensor = 16 * MiB  # process 0 of 2: the first half of each tensor
    starts = list(range(0, size, tensor))
    return starts, [s + tensor // 2 for s in starts]


def measure(args) -> list[dict]:
    size = args.mib * MiB
    starts, ends = owned(args.layout, size, args.block_mib * MiB)
    want = sum(e - s for s, e in zip(starts, ends, strict=True))
    data = payload(args.mib)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        servers = Servers(args.mib, folder)
        try:
            table = cases(servers.urls, starts, ends, size, args.concurrency)
            for name, (server, setup, whole) in table.items():
                if args.only and not any(o in name for o in args.only):
                    continue
                if server == "moto" and not args.moto_too:
                    continue
                fetch = setup(servers.urls[server])
                times, counted = [], None
                for _ in range(1 if server == "moto" else args.rounds):
                    servers.ask("reset")
                    t = time.perf_counter()
                    got = fetch()
                    times.append(time.perf_counter() - t)
                    counted = servers.ask("stats")[server]
                    spans = [(0, size)] if whole else list(zip(starts, ends, strict=True))
                    if whole and len(got) > 1:  # the 16 MiB pieces
                        spans = [(p, min(p + 16 * MiB, size)) for p in range(0, size, 16 * MiB)]
                    assert [bytes(g) for g in got] == [data[s:e] for s, e in spans], name
                    del got
                moved = size if whole else want
                rows.append({
                    "case": name, "best_s": min(times), "median_s": statistics.median(times),
                    "MB/s": moved / min(times) / 1e6, "server_bytes": counted["bytes"],
                    "bytes/owned": counted["bytes"] / want, "requests": counted["requests"],
                })  # fmt: skip
                print(format_row(rows[-1]), flush=True)
        finally:
            servers.close()
    return rows


def format_row(r: dict) -> str:
    return (
        f"{r['case']:<48} {r['best_s']:8.3f} {r['median_s']:8.3f} {r['MB/s']:9.0f} "
        f"{r['server_bytes'] / MiB:10.1f} {r['bytes/owned']:8.2f} {r['requests']:6d}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="object size in MiB")
    p.add_argument("--layout", choices=["blocks", "half"], default="blocks")
    p.add_argument("--block-mib", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--moto-too", action="store_true", help="one round of moto's own answers")
    p.add_argument("--only", nargs="*", help="cases whose name contains one of these")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.mib, args.dir)
        return 0
    size = args.mib * MiB
    starts, ends = owned(args.layout, size, args.block_mib * MiB)
    want = sum(e - s for s, e in zip(starts, ends, strict=True))
    print(f"{args.mib} MiB object, layout {args.layout}: {len(starts)} ranges, "
          f"{want / MiB:.0f} MiB owned; Python {sys.version.split()[0]}")  # fmt: skip
    print(f"{'case':<48} {'best s':>8} {'median':>8} {'MB/s':>9} "
          f"{'sent MiB':>10} {'/owned':>8} {'reqs':>6}")  # fmt: skip
    rows = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
