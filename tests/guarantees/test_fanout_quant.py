"""FP8 parameters through fan-out (issue 67): under jax.distributed (4 and 3
processes x 2 CPU devices, gloo on 127.0.0.1), an FP8 parameter whose blocks devices
of several processes hold is read as a plain one is: its stored float8 bytes fetched
once for the whole job, split among the processes, gathered on the devices, then
dequantized by the program the load runs without fan-out.

The test writes one FP8 checkpoint (``fanout_quant_worker.PARAMS``: replicated,
stacked experts, transposed, concatenated, and split) and DeepSeek's ``weight_dequant``
of each weight; each worker loads it with fan-out and without, checks its shards bit
for bit, and reports the bytes each load read (``/meshinit/safetensors/bytes_read``)
and got from peers.
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


@pytest.fixture(scope="module", params=[4, 3], ids=["4 processes", "3 processes"])
def run(request, tmp_path_factory) -> tuple[int, list[dict]]:
    processes = request.param
    folder = tmp_path_factory.mktemp(f"fanout-quant-{processes}")
    tensors = worker.checkpoint()
    helpers.quantized_folder(folder, tensors, FP8)
    np.savez(folder / "expected.npz", **worker.dequantized(tensors))
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
