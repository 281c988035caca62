"""One process of the 3-process fan-out test in
``tests/guarantees/test_fanout_three.py`` (issue 67); not collected by pytest.

Run: python tests/fanout_three_worker.py PROCESS_ID PORT FOLDER SOURCE

Each process joins ``jax.distributed`` with 2 CPU devices (3 processes), then loads
each case of :data:`CASES` from ``SOURCE/<case>.safetensors`` (an ``s3://`` prefix,
each process signing with its own access key id) with ``fan_out`` left to its
default, checks every shard bit for bit, and reports what the load recorded, as
:mod:`fanout_worker` does (whose :class:`~fanout_worker.Runner` it runs). Two meshes of
the 6 devices in process order: ``rows`` is ``(data=3, tensor=2)``, a process a row;
``cols`` is ``(data=2, tensor=3)``, where ``tensor`` crosses processes and process 1
sits in both rows (its blocks are pieces of rows that other processes' pieces sit
beside). It prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import fanout_worker as base
import helpers
import jax
import numpy as np
from fanout_worker import Case, Param
from jax.sharding import AxisType, Mesh

NUM_PROCESSES = 3
LOCAL_DEVICES = 2

CASES: dict[str, Case] = {
    # a process a row: each column half held by all three; a norm by every device
    "rows": Case(
        {
            "up": Param("auto", (None, "tensor"), ("up",), (96, 32), holders=3),
            "norm": Param("explicit", (None,), ("norm",), (96,), holders=3),
            "attn": Param("auto", ("data", "tensor"), ("attn",), (96, 32), holders=1),
            "v": Param("explicit", (None, "tensor"), ("v",), (48, 16), 3, "bfloat16"),
        }
    ),
    # tensor across processes: the sharded blocks of process 1 are pieces of rows in
    # both halves (192 rows: more runs than the fetch reads byte for byte)
    "cols_sharded": Case(
        {
            "attn": Param("cols", ("data", "tensor"), ("attn",), (192, 48), holders=1),
            "embed": Param("cols_explicit", ("data", "tensor"), ("embed",), (192, 48), 1),
        }
    ),
    "cols_replicated": Case(
        {
            "up": Param("cols", (None, "tensor"), ("up",), (192, 48), holders=2),
            "down": Param("cols_explicit", ("tensor", None), ("down",), (192, 48), 2),
            "norm": Param("cols", (None,), ("norm",), (192,), holders=3),
            "b": Param("cols_explicit", (None, "tensor"), ("b",), (96, 48), 2, "bfloat16"),
        }
    ),
}


def meshes() -> dict[str, Mesh]:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    explicit = (AxisType.Explicit, AxisType.Explicit)
    rows = np.array(devices).reshape(NUM_PROCESSES, LOCAL_DEVICES)
    cols = np.array(devices).reshape(LOCAL_DEVICES, NUM_PROCESSES)
    return {
        "auto": Mesh(rows, ("data", "tensor")),
        "explicit": Mesh(rows, ("data", "tensor"), axis_types=explicit),
        "cols": Mesh(cols, ("data", "tensor")),
        "cols_explicit": Mesh(cols, ("data", "tensor"), axis_types=explicit),
    }


def objects() -> dict[str, dict[str, Param]]:
    return {name: dict(case.params) for name, case in CASES.items()}


def stored_tensors(seed: int = 67) -> dict[str, dict[str, np.ndarray]]:
    """Each case's stored tensors: seeded random values (bf16 through ml_dtypes)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, np.ndarray]] = {}
    for obj, params in objects().items():
        out[obj] = {}
        for p in params.values():
            dtype = ml_dtypes.bfloat16 if p.dtype == "bfloat16" else np.dtype(p.dtype)
            out[obj][p.tensors[0]] = rng.standard_normal(p.shape).astype(dtype)
    return out


class Runner(base.Runner):
    def __init__(self, process_id: int, folder: str, source: str) -> None:
        self.me = process_id
        self.folder = folder
        self.source = source
        self.named = meshes()
        self.expected = np.load(os.path.join(folder, "expected.npz"))


def main(process_id: int, port: int, folder: str, source: str) -> int:
    helpers.join_cpu_job(process_id, port, NUM_PROCESSES, LOCAL_DEVICES)
    runner = Runner(process_id, folder, source)
    results: dict[str, Any] = {}
    timing: dict[str, float] = {}
    for name, case in CASES.items():
        start = time.monotonic()
        results[name] = runner.run_case(name, case)
        timing[name] = round(time.monotonic() - start, 2)
    results["timing"] = timing
    print("RESULT " + json.dumps({"process": process_id, "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    helpers.finish_worker(
        lambda: main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    )
