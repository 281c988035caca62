"""Fan-out (issue 58) under jax.distributed: 4 processes x 2 CPU devices, gloo on
127.0.0.1, loading from a local S3 server and from local files.

The test writes one safetensors object per case of ``fanout_worker.CASES`` (seeded
random values) and the numpy value of each plan parameter, then spawns the four
workers once per storage kind. Each worker runs every case in turn and checks each of
its shards bit for bit against those values. Here the bytes are checked: at the
server, per process (each signs with its own access key id, ``proc-<id>``), and as
each process's load records them (``/meshinit/safetensors/bytes_read`` and
``bytes_from_peers``). A block that R processes hold is fetched once for the whole
job, about 1/R of its rows by each; ``fan_out=False`` keeps today's reads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import time
from pathlib import Path

import fanout_worker as worker
import helpers
import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
# Once one worker fails, its peers wait in a barrier or a collective: stop them soon.
PEER_GRACE_S = 10
KINDS = ("files", "s3")


MAXTEXT = importlib.util.find_spec("maxtext") is not None


def maxtext_expected(folder: Path) -> dict[str, np.ndarray]:
    """MaxText's tiny Llama checkpoint in ``folder`` (``fanout_worker``), and this
    process's load of it (one process, 8 devices, MaxText's mesh): what each worker's
    shards must equal (``maxtext/<path>``)."""
    import meshinit.maxtext

    worker.write_maxtext_checkpoint(str(folder))
    config = worker.maxtext_config()
    plan = worker.maxtext_plan(config)
    names = meshinit.maxtext.names(config)
    loaded = meshinit.safetensors.load(plan, folder, names=names)
    out = {f"maxtext/{path}": np.asarray(a) for path, a in loaded.items()}
    for a in loaded.values():
        a.delete()
    return out


def spawn(folder: Path, source: str, env: dict[str, str]) -> list[dict]:
    args = (folder, source)
    return helpers.run_workers(
        worker.__file__, worker.NUM_PROCESSES, args, folder / "logs", env, TIMEOUT_S, PEER_GRACE_S
    )


@pytest.fixture(scope="module", params=KINDS)
def run(request, tmp_path_factory) -> dict:
    """One spawn of the four workers for a storage kind: their results, and for S3 the
    server's log, the bucket and each object's header length."""
    kind = request.param
    folder = tmp_path_factory.mktemp(f"fanout-{kind}")
    expected = maxtext_expected(folder / "maxtext") if kind == "files" and MAXTEXT else {}
    headers = helpers.write_fanout_objects(worker, folder, expected)
    out: dict = {"kind": kind, "headers": headers, "folder": folder}
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if kind == "files":
            out["workers"] = spawn(folder, str(folder), {})
        else:
            pytest.importorskip("obstore")
            from storage_servers import S3Server

            server = stack.enter_context(S3Server())
            bucket = server.bucket()
            for obj in headers:
                name = f"{obj}.safetensors"
                server.put(f"{bucket}/{name}", (folder / name).read_bytes())
            server.reset()
            server.fail(
                f"{bucket}/fail.safetensors",
                503,
                times=1 << 30,
                after=1,  # its header read passes
                client=f"proc-{worker.FAILING_PROCESS}",
            )
            out["workers"] = spawn(folder, f"s3://{bucket}", server.env)
            out["counters"] = server.counters
            out["bucket"] = bucket
    print(f"{kind}: 4 workers {time.monotonic() - start:.1f} s")
    return out


describe = helpers.describe_worker


def results(run: dict) -> list[dict]:
    """Each process's results, in process order (the test fails on a worker that did
    not finish)."""
    out = []
    for i, r in enumerate(run["workers"]):
        lines = [line for line in r["stdout"].splitlines() if line.startswith("RESULT ")]
        assert r["returncode"] == 0 and len(lines) == 1, describe(i, r)
        result = json.loads(lines[0].removeprefix("RESULT "))
        assert result["process"] == i
        out.append(result["results"])
    return out


def unique_bytes(case: worker.Case) -> int:
    """The bytes of the tensors the case's plan reads, each once."""
    itemsize = {"float32": 4, "bfloat16": 2}
    return sum(
        round(worker.LAYOUT_READS.get(p.layout, 1) * len(p.tensors) * math.prod(p.shape))
        * itemsize[p.dtype]
        for p in case.params.values()
    )


def store_bytes(run: dict, obj: str) -> dict[str | None, int]:
    """The tensor data of ``obj`` the S3 server sent each access key id: not the
    header reads (which start at 0 and, the objects being small, run on over all of
    their data)."""
    path = f"{run['bucket']}/{obj}.safetensors"
    return run["counters"].bytes_by_client({path: run["headers"][obj]}, header_reads=False)


def busiest(case: worker.Case, owned: dict[str, int]) -> float:
    """The most bytes a process may fetch under fan-out: of each parameter's blocks
    (``owned``, its own distinct blocks), whole rows of the stored tensor split among
    the R processes that hold them, none more than ``ceil(rows / R)``."""
    return sum(
        owned[path] * -(-p.shape[0] // p.holders) / p.shape[0] for path, p in case.params.items()
    )


def check_from_peers(me: int, one: dict, exact: bool = True) -> None:
    """What a process did not fetch of its distinct blocks came from the other holders:
    ``bytes_from_peers`` counts each block once, however many of its devices hold it
    (the bytes due to the process, not to each device). Not ``exact``: a padded part's
    padding is neither fetched nor received, and where a mesh axis that crosses
    processes splits the columns ("replicas": tensor), each process reads whole rows,
    columns it does not hold included: there only the bounds."""
    read, from_peers = one["read"][0], one["from_peers"][0]
    owned = sum(one["owned"].values())
    assert from_peers <= owned, (me, one)
    if exact:
        assert from_peers == owned - read, (me, one)
    elif not one.get("padded"):
        assert owned - read <= from_peers, (me, one)


def test_every_worker_runs_every_case(run):
    failed = sorted(
        (i for i, r in enumerate(run["workers"]) if r["returncode"] != 0),
        key=lambda i: run["workers"][i]["returncode"] == -9,
    )
    assert not failed, "\n\n".join(describe(i, run["workers"][i]) for i in failed)
    for got in results(run):
        assert set(worker.CASES) <= set(got), sorted(got)
        print(run["kind"], got["timing"])


@pytest.mark.parametrize("case", worker.CASES)
def test_every_shard_is_bit_identical_to_the_stored_values_on_every_process(run, case):
    for me, got in enumerate(results(run)):
        one = got[case]
        assert one["wrong"] == [], one["wrong"][:10]
        # a shard on each local device of each parameter, checked
        assert one["shards"] == worker.LOCAL_DEVICES * len(worker.CASES[case].params), one
        assert one["leaked"] == 0, (me, one)  # the arrays deleted, nothing else kept


@pytest.mark.parametrize("case", worker.CASES)
def test_each_process_fetches_its_share_of_the_blocks_it_holds(run, case):
    spec = worker.CASES[case]
    for me, got in enumerate(results(run)):
        one = got[case]
        for path, p in spec.params.items():  # the mesh is what the case says it is
            assert one["holders"][path] == [p.holders, p.holders], (me, path, one)
        owned = sum(one["owned"].values())
        assert len(one["read"]) == 1 and len(one["from_peers"]) == 1, one  # once a load
        read, from_peers = one["read"][0], one["from_peers"][0]
        if spec.fan_out is False or (spec.local_default and run["kind"] == "files"):
            # today's reads: each process fetches every block it holds, nothing from peers
            # (the default on local files, every process on one host: the page cache
            # serves them all)
            assert (read, from_peers) == (owned, 0), (me, one)
            continue
        if all(p.holders == 1 for p in spec.params.values()):
            # nothing shared: as many bytes as it holds (a block split across the
            # processes along its columns, "e", is read as whole rows and moved back)
            assert read == owned and from_peers <= owned, (me, one)
            continue
        assert read <= busiest(spec, one["owned"]), (me, busiest(spec, one["owned"]), one)
        padded = any(p.layout == "padded" for p in spec.params.values())
        moved = any(p.mesh == "replicas" for p in spec.params.values())
        check_from_peers(me, {**one, "padded": padded}, exact=not (padded or moved))


@pytest.mark.parametrize("case", worker.CASES)
def test_the_store_serves_each_byte_once_for_the_whole_job(run, case):
    spec = worker.CASES[case]
    got = [r[case] for r in results(run)]
    reads = [one["read"][0] for one in got]
    unique = unique_bytes(spec)
    if spec.fan_out is False or (spec.local_default and run["kind"] == "files"):
        # every holder reads its blocks: R copies
        want = sum(sum(one["owned"].values()) for one in got)
        assert sum(reads) == want, (reads, want, unique)
        replicated = any(p.holders > 1 for p in spec.params.values())
        assert (want > unique) == replicated, (want, unique)
    else:
        assert unique <= sum(reads) <= 1.02 * unique, (reads, unique)
    if run["kind"] == "s3":  # and the server agrees, process by process
        served = store_bytes(run, spec.object or case)
        # the case's object is read by more than one load (its fan_out=False twin):
        # compare the server's bytes with every load of the object
        twins = [n for n, c in worker.CASES.items() if (c.object or n) == (spec.object or case)]
        for me in range(worker.NUM_PROCESSES):
            want = sum(results(run)[me][n]["read"][0] for n in twins)
            if worker.AFTER in twins:  # read once more after the failure
                want += results(run)[me]["after"]["read"][0]
            assert served.get(f"proc-{me}", 0) == want, (me, served, twins)


def test_a_transposed_tensor_is_split_along_its_stored_rows(run):
    # Tensor("wt", permute=(1, 0)) onto P("tensor", None): each block is all 48 stored
    # rows by 16 of its columns. Split along the stored rows, a process reads 12 rows
    # of each of its two blocks (at most 24 of the 48); split along the plan's rows
    # (the stored columns), every process would read from all 48.
    if run["kind"] != "s3":
        pytest.skip("the server's log of ranges is S3's")
    stored = worker.stored_tensors()["transposed"]
    from safetensors.numpy import save

    data = save(stored)
    header = json.loads(data[8 : run["headers"]["transposed"]])
    start, stop = (run["headers"]["transposed"] + o for o in header["wt"]["data_offsets"])
    row = 32 * 4
    path = f"{run['bucket']}/transposed.safetensors"
    for me in range(worker.NUM_PROCESSES):
        touched = set()
        for p, a, b in run["counters"].spans(f"proc-{me}"):
            if p == path and a > 0 and a < stop and b > start:  # not a header read
                first, last = max(a, start) - start, min(b, stop) - start
                touched |= set(range(first // row, (last - 1) // row + 1))
        assert 0 < len(touched) <= 2 * 12, (me, sorted(touched))


def test_the_load_compiles_as_many_programs_at_either_depth(run):
    for me, got in enumerate(results(run)):
        compiles = got["compiles"]
        small, deep = compiles["fan_out"]
        assert small == deep, (me, worker.DEPTHS, compiles)
        # fan-out adds its reshard program (the layers share one signature), once
        added = [a - b for a, b in zip(compiles["fan_out"], compiles["no_fan_out"], strict=True)]
        assert added[0] == added[1] >= 1, (me, compiles)
        small, deep = compiles["stacked"]  # the layers as one Stack: one signature each
        assert small == deep, (me, worker.DEPTHS, compiles)
        assert compiles["wrong"] == [] and compiles["leaked"] == 0, (me, compiles)


def test_a_permanent_failure_on_one_process_fails_every_process_quickly(run):
    if run["kind"] != "s3":
        pytest.skip("the fault is the S3 server's, on one access key id")
    got = results(run)
    for me, one in enumerate(got):
        failing = one["failing"]
        if me == worker.FAILING_PROCESS:  # it names the object
            assert "fail.safetensors" in failing["outcome"], failing
            assert not failing["outcome"].startswith(("PeerFailure", "returned")), failing
        else:
            assert failing["outcome"].startswith("PeerFailure"), (me, failing)
            assert f"process {worker.FAILING_PROCESS}" in failing["outcome"], (me, failing)
        assert failing["seconds"] < 60, (me, failing)  # no process waits out a collective
        assert failing["leaked"] == 0, (me, failing)  # no array left alive
        # and the next load agrees again, bit for bit
        assert one["after"]["wrong"] == [] and one["after"]["leaked"] == 0, one["after"]


def test_a_maxtext_plan_loads_bit_identical_fetching_each_byte_once(run):
    # MaxText's own NNX Llama on its (data=4, tensor=2) mesh, through
    # meshinit.maxtext.names (Stack over the layers, transposes, the query's scale)
    if not MAXTEXT:
        pytest.skip("MaxText is not installed (it needs Python 3.12 and jax >= 0.11.1)")
    if run["kind"] != "files":
        pytest.skip("the MaxText case runs with the local files only (its import is slow)")
    got = [r["maxtext"] for r in results(run)]
    file = run["folder"] / "maxtext" / "model.safetensors"
    data = file.read_bytes()
    unique = len(data) - 8 - int.from_bytes(data[:8], "little")  # every tensor is loaded
    for me, one in enumerate(got):
        assert one["wrong"] == [] and one["leaked"] == 0, (me, one["wrong"][:10], one["leaked"])
        assert one["shards"] > 0 and max(h[1] for h in one["holders"].values()) > 1, one
        check_from_peers(me, one)
    reads = [one["read"][0] for one in got]
    # each block is held by several processes, and fetched once for them all
    assert sum(sum(one["owned"].values()) for one in got) > 2 * unique, got
    assert unique <= sum(reads) <= 1.02 * unique, (reads, unique)
