"""FP8 and MXFP4 parameters through fan-out (issue 67): under jax.distributed (4 and
3 processes x 2 CPU devices, gloo on 127.0.0.1), a quantized parameter whose blocks
devices of several processes hold is read as a plain one is: its stored bytes (the
float8 weights; MXFP4's _blocks and _scales) fetched once for the whole job, split
among the processes, gathered on the devices, then dequantized by the program the
load runs without fan-out.

The test writes one FP8 checkpoint (``fanout_quant_worker.PARAMS``: replicated,
stacked experts, transposed, concatenated, and split) and DeepSeek's ``weight_dequant``
of each weight, and an MXFP4 checkpoint (``MX_PARAMS``: replicated, stacked layers,
transposed, split, and one whose blocks cut a group) with transformers' values; each
worker loads them with fan-out and without, checks its shards bit for bit, and
reports the bytes each load read (``/meshinit/safetensors/bytes_read``) and got from
peers.
"""

from __future__ import annotations

import json
import math

import fanout_quant_worker as worker
import helpers
import numpy as np
import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 300
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
PEER_GRACE_S = 10
MXFP4 = {"quant_method": "mxfp4"}


@pytest.fixture(scope="module", params=[4, 3], ids=["4 processes", "3 processes"])
def run(request, tmp_path_factory) -> tuple[int, list[dict]]:
    processes = request.param
    folder = tmp_path_factory.mktemp(f"fanout-quant-{processes}")
    tensors = worker.checkpoint()
    helpers.quantized_folder(folder, tensors, FP8)
    np.savez(folder / "expected.npz", **worker.dequantized(tensors))
    mx = worker.mx_checkpoint()
    helpers.quantized_folder(folder / "mxfp4", mx, MXFP4)
    np.savez(folder / "mxfp4" / "expected.npz", **worker.mx_dequantized(mx))
    ran = helpers.run_workers(
        worker.__file__, processes, (folder, processes), folder / "logs", {},
        TIMEOUT_S, PEER_GRACE_S,
    )  # fmt: skip
    out = []
    for i, r in enumerate(ran):
        lines = [line for line in r["stdout"].splitlines() if line.startswith("RESULT ")]
        assert r["returncode"] == 0 and len(lines) == 1, helpers.describe_worker(i, r)
        out.append(json.loads(lines[0].removeprefix("RESULT "))["results"])
    return processes, out


UNIQUE = sum(len(p.tensors) * math.prod(p.shape) for p in worker.PARAMS.values())
SCALES = sum(worker.scale_bytes(p) for p in worker.PARAMS.values())


@pytest.mark.parametrize("mode", ["fan_out", "no_fan_out"])
def test_every_shard_has_weight_dequants_bits_on_every_process(run, mode):
    _, got = run
    for me, one in enumerate(got):
        assert one[mode]["wrong"] == [], (me, one[mode]["wrong"][:10])


def test_the_float8_bytes_are_fetched_once_for_the_whole_job(run):
    processes, got = run
    reads = [one["fan_out"]["read"][0] for one in got]
    # the stored float8 bytes once, and each process's scales (read whole: 1/16384)
    assert UNIQUE <= sum(reads) <= UNIQUE + processes * SCALES, (reads, UNIQUE)
    assert sum(reads) <= 1.02 * UNIQUE
    # without fan-out each holder reads its own blocks: the replicated ones P times
    before = [one["no_fan_out"]["read"][0] for one in got]
    owned = [sum(one["no_fan_out"]["owned"].values()) + one["no_fan_out"]["scales"] for one in got]
    assert before == owned
    assert sum(before) > 2 * UNIQUE


def test_each_process_fetches_its_share_and_gets_the_rest_from_its_peers(run):
    processes, got = run
    reads = [one["fan_out"]["read"][0] for one in got]
    assert max(reads) <= 1.10 * (sum(reads) / processes), reads
    for me, one in enumerate(got):
        mine = one["fan_out"]
        fetched = mine["read"][0] - mine["scales"]  # its float8 bytes
        # each block on one local device: what it did not fetch came from peers, in
        # stored bytes (one an element), not the planned bfloat16's two
        assert mine["from_peers"] == [sum(mine["owned"].values()) - fetched], (me, mine)
        assert one["no_fan_out"]["from_peers"] == [0], (me, one["no_fan_out"])


MX_UNIQUE = sum(worker.mx_bytes(p) for p in worker.MX_PARAMS.values())
MX_CUT = worker.mx_bytes(worker.MX_PARAMS["mx_cut"])
# mx_cut is read by each holder (its blocks of 48 values cut a group of 32): every
# process reads 2 groups of 17 bytes for each of its two blocks, of every (E, R) row
CUT_READ = 12 * 16 * 2 * 2 * 17


def shared_owned(one):
    return sum(n for path, n in one["owned"].items() if path != "mx_cut")


def test_every_mxfp4_shard_has_transformers_bits_through_fan_out_on_every_process(run):
    _, got = run
    for me, one in enumerate(got):
        for mode in ("mx_fan_out", "mx_no_fan_out"):
            assert one[mode]["wrong"] == [], (me, mode, one[mode]["wrong"][:10])
        # through the staged path: its replicated blocks came from its peers' reads
        assert one["mx_fan_out"]["from_peers"][0] > 0, (me, one["mx_fan_out"])


def test_the_mxfp4_bytes_are_fetched_once_for_the_whole_job(run):
    processes, got = run
    reads = [one["mx_fan_out"]["read"][0] for one in got]
    # each stored byte of _blocks and _scales once, but mx_cut's: each holder's own
    assert sum(reads) == MX_UNIQUE - MX_CUT + processes * CUT_READ, (reads, MX_UNIQUE)
    shared = [r - CUT_READ for r in reads]
    assert max(shared) <= 1.10 * (sum(shared) / processes), shared
    # without fan-out each holder reads its own blocks: the replicated ones P times
    before = [one["mx_no_fan_out"]["read"][0] for one in got]
    assert before == [shared_owned(one["mx_no_fan_out"]) + CUT_READ for one in got]
    assert sum(before) > 2 * MX_UNIQUE


def test_each_process_gets_the_rest_of_its_mxfp4_blocks_from_its_peers(run):
    for me, one in enumerate(run[1]):
        mine = one["mx_fan_out"]
        # stored bytes (17 a 32 values), not the planned bfloat16's 64
        assert mine["from_peers"][0] > 0, (me, mine)
        assert mine["from_peers"] == [shared_owned(mine) - (mine["read"][0] - CUT_READ)], (me, mine)
        assert one["mx_no_fan_out"]["from_peers"] == [0], (me, one["mx_no_fan_out"])
