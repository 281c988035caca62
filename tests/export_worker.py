"""One process of ``tests/guarantees/test_export.py`` (issue 66); not collected by
pytest.

Run: python tests/export_worker.py PROCESS_ID PORT DEST SCENARIO

Each process joins ``jax.distributed`` on 127.0.0.1 with 2 CPU devices (4 processes,
gloo) and exports :func:`arrays` to ``DEST`` (a shared local folder, or an ``s3://``
prefix where each process signs with its own access key id ``proc-<id>``): parameters
sharded by rows across the processes, by columns within them, replicated everywhere,
and the layers of a scanned one, on an Auto and an Explicit mesh. Scenario ``ok``
exports once; ``fail`` has :data:`FAILING`'s writes fail (an OSError on a local folder;
on S3 the server answers its uploads 503, set by the test). Each process prints ``STEP
{json}``: the outcome (``ok``, or the exception's type and message), the report's
bytes per process, and the arrays left alive; then ``DONE``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import helpers
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

NUM_PROCESSES = 4
LOCAL_DEVICES = 2
FAILING = 2
LAYERS = 4


def values() -> dict[str, np.ndarray]:
    """What each parameter holds, the same on every process."""
    rng = np.random.default_rng(66)
    out = {
        "embed": rng.standard_normal((64, 32)).astype(np.float32),
        "up": rng.standard_normal((32, 48)).astype(np.float32),
        "norm": rng.standard_normal((32,)).astype(np.float32),
        "layers": rng.standard_normal((LAYERS, 16, 24)).astype(np.float32),
    }
    return {k: v.astype(np.dtype("bfloat16")) if k == "layers" else v for k, v in out.items()}


def arrays() -> dict[str, jax.Array]:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(NUM_PROCESSES, LOCAL_DEVICES)
    auto = Mesh(grid, ("data", "tensor"))
    explicit = jax.make_mesh((4, 2), ("data", "tensor"), devices=list(grid.flat))
    specs = {
        "embed": (auto, P("data", "tensor")),
        "up": (explicit, P("tensor", "data")),  # columns across the processes
        "norm": (auto, P()),
        "layers": (explicit, P(None, "data", "tensor")),
    }
    out = {}
    for name, x in values().items():
        mesh, spec = specs[name]
        out[name] = jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, spec), lambda i, x=x: x[i]
        )
    return out


NAMES = {
    "embed": "model.embed_tokens.weight",
    "up": meshinit.safetensors.Tensor("model.mlp.up_proj.weight", permute=(1, 0)),
    "norm": "model.norm.weight",
    "layers": meshinit.safetensors.Stack([f"model.layers.{i}.w" for i in range(LAYERS)], axis=0),
}


def expected() -> dict[str, np.ndarray]:
    v = values()
    out = {
        "model.embed_tokens.weight": v["embed"],
        "model.mlp.up_proj.weight": v["up"].T.copy(),
        "model.norm.weight": v["norm"],
    }
    out.update({f"model.layers.{i}.w": v["layers"][i] for i in range(LAYERS)})
    return out


def main(process_id: int, port: int, dest: str, scenario: str) -> int:
    helpers.join_cpu_job(process_id, port, NUM_PROCESSES, LOCAL_DEVICES)
    from meshinit._checkpoint.store import sink

    given = arrays()
    options = None
    if dest.startswith("s3://"):
        secret = os.environ["AWS_SECRET_ACCESS_KEY"]
        options = {"access_key_id": f"proc-{process_id}", "secret_access_key": secret}
    if scenario == "fail" and process_id == FAILING and not dest.startswith("s3://"):

        def broken(self: Any, data: Any) -> None:
            raise OSError(28, "No space left on device (injected)")

        sink.Upload.write = broken  # type: ignore[method-assign]
    for array in given.values():  # the inputs' own single-device buffers, made once read
        [shard.data for shard in array.addressable_shards]
    before = len(jax.live_arrays())
    step: dict[str, Any] = {"label": scenario, "started": time.time()}
    try:
        report = meshinit.safetensors.save(
            given,
            dest,
            names=NAMES,
            storage_options=options,
            max_inflight_bytes=16384,
            config={"model_type": "test"},
        )
        step["outcome"] = "ok"
        step["bytes_by_process"] = list(report.bytes_by_process)
        step["files"] = list(report.files)
    except Exception as e:
        step["outcome"] = f"{type(e).__name__}: {e}"[:3000]
    step["ended"] = time.time()
    step["leaked"] = len(jax.live_arrays()) - before
    print("STEP " + json.dumps(step), flush=True)
    print("DONE", flush=True)
    helpers.leave_last("export_worker", process_id, range(NUM_PROCESSES))
    return 0


if __name__ == "__main__":
    helpers.worker_exit(main, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
