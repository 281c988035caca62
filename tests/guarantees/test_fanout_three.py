"""Fan-out (issue 67) on 3 processes x 2 CPU devices, gloo on 127.0.0.1, loading from a
local S3 server: a process a row of ``(data=3, tensor=2)``, and ``(data=2, tensor=3)``,
where ``tensor`` crosses processes and process 1 sits in both rows.

The test writes one safetensors object per case of ``fanout_three_worker.CASES``
(seeded random values) and the numpy value of each parameter, then spawns the three
workers once. Each checks each of its shards bit for bit; here the bytes are checked,
at the server per process (each signs with its own access key id) and as each load
records them: the store serves each byte once for the whole job, an equal share to
each process, and what a process holds but did not fetch comes from its peers.
"""

from __future__ import annotations

import json
import math

import fanout_three_worker as worker
import helpers
import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 300
PEER_GRACE_S = 10


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    pytest.importorskip("obstore")
    from storage_servers import S3Server

    folder = tmp_path_factory.mktemp("fanout-three")
    expected: dict = {}
    headers = helpers.write_fanout_objects(worker, folder, expected)
    with S3Server() as server:
        bucket = server.bucket()
        for obj in headers:
            name = f"{obj}.safetensors"
            server.put(f"{bucket}/{name}", (folder / name).read_bytes())
        server.reset()
        workers = helpers.run_workers(
            worker.__file__,
            worker.NUM_PROCESSES,
            (folder, f"s3://{bucket}"),
            folder / "logs",
            server.env,
            TIMEOUT_S,
            PEER_GRACE_S,
        )
        counters = server.counters
    return {"workers": workers, "counters": counters, "bucket": bucket, "headers": headers}


def results(run: dict) -> list[dict]:
    out = []
    for i, r in enumerate(run["workers"]):
        lines = [line for line in r["stdout"].splitlines() if line.startswith("RESULT ")]
        assert r["returncode"] == 0 and len(lines) == 1, helpers.describe_worker(i, r)
        out.append(json.loads(lines[0].removeprefix("RESULT "))["results"])
    return out


def unique_bytes(case: worker.Case) -> int:
    itemsize = {"float32": 4, "bfloat16": 2}
    return sum(math.prod(p.shape) * itemsize[p.dtype] for p in case.params.values())


@pytest.mark.parametrize("case", worker.CASES)
def test_every_shard_is_bit_identical_on_every_process(run, case):
    for me, got in enumerate(results(run)):
        one = got[case]
        assert one["wrong"] == [], one["wrong"][:10]
        assert one["shards"] == worker.LOCAL_DEVICES * len(worker.CASES[case].params), one
        assert one["leaked"] == 0, (me, one)
        for path, p in worker.CASES[case].params.items():
            assert one["holders"][path] == [p.holders, p.holders], (me, path, one)


@pytest.mark.parametrize("case", worker.CASES)
def test_the_store_serves_each_byte_once_an_equal_share_to_each_process(run, case):
    spec = worker.CASES[case]
    got = [r[case] for r in results(run)]
    reads = [one["read"][0] for one in got]
    unique = unique_bytes(spec)
    # every size here divides among the holders: each process fetches a third
    assert unique <= sum(reads) <= 1.02 * unique, (reads, unique)
    assert max(reads) <= 1.10 * sum(reads) / len(reads), reads
    path = f"{run['bucket']}/{case}.safetensors"  # and the server agrees, per process
    served = run["counters"].bytes_by_client({path: run["headers"][case]}, header_reads=False)
    for me in range(worker.NUM_PROCESSES):
        assert served.get(f"proc-{me}", 0) == reads[me], (me, served, reads)


@pytest.mark.parametrize("case", worker.CASES)
def test_what_a_process_holds_and_did_not_fetch_comes_from_its_peers(run, case):
    got = [r[case] for r in results(run)]
    for me, one in enumerate(got):
        owned, read, from_peers = sum(one["owned"].values()), one["read"][0], one["from_peers"][0]
        # each of its distinct blocks once: at least what it holds beyond what it
        # fetched, at most all it holds
        assert owned - read <= from_peers <= owned, (me, one)
    if case == "rows":  # a process a row: its reads are all within its blocks, and
        # it receives exactly the rest of them
        assert sum(one["from_peers"][0] for one in got) == sum(
            sum(one["owned"].values()) - one["read"][0] for one in got
        ), got
