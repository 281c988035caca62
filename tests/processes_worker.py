"""One process of ``tests/guarantees/test_processes.py`` (issue 64); not collected by
pytest.

Run: python tests/processes_worker.py PROCESS_ID PORT FOLDER SCENARIO [SOURCE]

Each process joins ``jax.distributed`` on 127.0.0.1 with 2 CPU devices (4 processes,
gloo), then runs the loads of :data:`SCENARIOS` ``[SCENARIO]`` in turn from
``FOLDER/model.safetensors`` (or ``SOURCE/model.safetensors``, an ``s3://`` prefix where
each process signs with its own access key id ``proc-<id>``): 32 parameters of 2 KiB,
each replicated across the processes (so fan-out stages every one, asked for with
``fan_out=True`` where the files are local, and its reshard
messages are a few hundred bytes, an agreement's size under the old protocol), half on
an Auto mesh, half on an Explicit one (``jax.make_mesh``). One process (:data:`FAILING`,
or 0 where the scenario kills the coordinator) has a fault injected into one load; the
others do not. After each load every process checks every shard it holds against the
stored tensors, bit for bit, and prints a line ``STEP {json}`` at once (a process that
jax aborts later keeps what it printed): the load's outcome (``ok``, or the exception's
type and message), the shards that differ, the arrays it left alive, and when it started
and ended (``time.time()``). The injected process prints ``INJECTED {time}`` when its
fault fires. At the end: ``DONE``, and the process leaves without jax's shutdown
barrier.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import helpers
import jax
import numpy as np
from jax.sharding import Mesh

import meshinit
from meshinit._checkpoint.layout import host
from meshinit._checkpoint.read import reshard

NUM_PROCESSES = 4
LOCAL_DEVICES = 2
FAILING = 2
COUNT = 32
SHAPE = (16, 32)  # float32: 2 KiB
NTH = 3  # the fault fires at this call of the function it is injected into
SMALL = 8192  # max_inflight_bytes: two parameters a batch, 16 batches


def stored_values(seed: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.standard_normal(SHAPE).astype(np.float32) for i in range(COUNT)}


def meshes() -> list[Mesh]:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(NUM_PROCESSES, LOCAL_DEVICES)
    explicit = jax.make_mesh((4, 2), ("data", "tensor"), devices=list(grid.flat))
    return [Mesh(grid, ("data", "tensor")), explicit]


def plan() -> meshinit.Plan:
    auto, explicit = meshes()
    zeros = jax.nn.initializers.zeros
    return meshinit.plan(
        {
            f"p{i}": meshinit.param(
                SHAPE, zeros, axes=(None, "tensor"), mesh=(auto, explicit)[i % 2]
            )
            for i in range(COUNT)
        }
    )


class Fault:
    """Replaces ``owner.name`` on one process: the ``NTH`` call runs ``fault`` (which
    may raise, signal or kill) before or after the original, as ``when`` says."""

    def __init__(self, owner: Any, name: str, fault: Callable[[], None], when: str = "before"):
        self.owner, self.name, self.fault, self.when = owner, name, fault, when
        self.original = getattr(owner, name)
        self.calls = 0

    def __enter__(self) -> None:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            fire = self.calls == NTH
            if fire and self.when == "before":
                self.fire()
            out = self.original(*args, **kwargs)
            if fire and self.when == "after":
                self.fire()
            return out

        setattr(self.owner, self.name, wrapped)

    def fire(self) -> None:
        print(f"INJECTED {time.time()}", flush=True)
        self.fault()

    def __exit__(self, *exc: Any) -> None:
        setattr(self.owner, self.name, self.original)


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def interrupt() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C


def fail() -> None:
    raise RuntimeError("injected failure")


def cannot_start(*args: Any) -> Any:
    raise RuntimeError("injected: the reshard could not start")


# A step: (label, the failing process's load arguments and fault, the others' arguments).
# A fault: (owner, attribute, what fires, "before" or "after" the original), or
# (owner, attribute, replacement) to replace it from the NTH call on.
Step = tuple[str, dict[str, Any], Any, dict[str, Any]]
OK: Step = ("ok", {}, None, {})
SCENARIOS: dict[str, list[Step]] = {
    "soft": [
        ("ok", {"max_inflight_bytes": SMALL}, None, {"max_inflight_bytes": SMALL}),
        ("bad argument", {"fan_out": "yes"}, None, {}),
        ("fan_out True here, False elsewhere", {"fan_out": True}, None, {"fan_out": False}),
        ("fan_out False here, True elsewhere", {"fan_out": False}, None, {"fan_out": True}),
        ("max_inflight_bytes", {"max_inflight_bytes": 1 << 20}, None, {}),
        OK,
        (
            "Ctrl-C entering a reshard",
            {"max_inflight_bytes": SMALL},
            (reshard, "enter", interrupt, "before"),
            {"max_inflight_bytes": SMALL},
        ),
        OK,
        (
            "a raise after a reshard",
            {"max_inflight_bytes": SMALL},
            (reshard, "finish", fail, "before"),
            {"max_inflight_bytes": SMALL},
        ),
        OK,
        (
            "a reshard that cannot start",
            {"max_inflight_bytes": SMALL},
            (reshard, "enter", fail, "before"),
            {"max_inflight_bytes": SMALL},
        ),
        ("after the collectives broke", {}, None, {}),
    ],
    "kill fetching": [
        OK,
        ("killed reading", {"max_inflight_bytes": SMALL}, (host.Part, "block", kill, "before"), {}),
    ],
    "kill entering": [
        OK,
        (
            "killed entering a reshard",
            {"max_inflight_bytes": SMALL},
            (reshard, "enter", kill, "before"),
            {},
        ),
    ],
    "kill inside": [
        OK,
        (
            "killed inside a reshard",
            {"max_inflight_bytes": SMALL},
            (reshard, "enter", kill, "after"),
            {},
        ),
    ],
    "kill coordinator": [
        OK,
        (
            "coordinator killed",
            {"max_inflight_bytes": SMALL},
            (reshard, "enter", kill, "after"),
            {},
        ),
    ],
}
for _steps in SCENARIOS.values():  # the others pass the failing one's budget
    for _i, (_label, _mine, _fault, _theirs) in enumerate(_steps):
        if _fault is not None and "max_inflight_bytes" in _mine:
            _steps[_i] = (_label, _mine, _fault, {**_theirs, **_mine})
HEARTBEAT_S = {"kill fetching": 10}  # jax aborts the survivors waiting at an agreement


def injected(scenario: str) -> int:
    """The process a scenario's fault is injected into."""
    return 0 if scenario == "kill coordinator" else FAILING


def check(arrays: dict[str, jax.Array], want: dict[str, np.ndarray]) -> list[str]:
    wrong = []
    for path, array in arrays.items():
        for s in array.addressable_shards:
            got = np.asarray(s.data)
            if got.tobytes() != np.ascontiguousarray(want[path][s.index]).tobytes():
                bad = int((got != want[path][s.index]).sum())
                wrong.append(f"{path} shard {s.index} on device {s.device.id}: {bad} differ")
    return wrong


def main(process_id: int, port: int, folder: str, scenario: str, source: str) -> int:
    # Ctrl-C as at a terminal, though pytest ran in a background job (which starts with
    # SIGINT ignored, and Python leaves an inherited SIG_IGN as it is)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    heartbeat = HEARTBEAT_S.get(scenario, 100)
    helpers.join_cpu_job(process_id, port, NUM_PROCESSES, LOCAL_DEVICES, heartbeat_s=heartbeat)
    from meshinit import safetensors as st

    the_plan = plan()
    want = stored_values()
    path = os.path.join(source or folder, "model.safetensors")
    options = None
    if source.startswith("s3://"):
        path = f"{source}/model.safetensors"
        secret = os.environ["AWS_SECRET_ACCESS_KEY"]
        options = {"access_key_id": f"proc-{process_id}", "secret_access_key": secret}
    me_failing = process_id == injected(scenario)
    for label, mine, fault, theirs in SCENARIOS[scenario]:
        kwargs = {**(mine if me_failing else theirs), "storage_options": options}
        if options is None:  # local files on one host: fan-out only where asked for
            kwargs.setdefault("fan_out", True)
        before = len(jax.live_arrays())
        step: dict[str, Any] = {"label": label, "started": time.time(), "wrong": []}
        try:
            if me_failing and fault is not None:
                with Fault(*fault):
                    arrays = st.load(the_plan, path, **kwargs)
            else:
                arrays = st.load(the_plan, path, **kwargs)
            step["outcome"] = "ok"
            step["wrong"] = check(arrays, want)
            step["shards"] = sum(len(a.addressable_shards) for a in arrays.values())
            for array in arrays.values():
                array.delete()
            del arrays
        except (Exception, KeyboardInterrupt) as e:
            step["outcome"] = f"{type(e).__name__}: {e}"[:3000]
        step["ended"] = time.time()
        step["leaked"] = len(jax.live_arrays()) - before
        print("STEP " + json.dumps(step), flush=True)
    print("DONE", flush=True)
    # process 0 serves the coordination: it leaves once every other process that is
    # still alive is done
    alive = set(range(NUM_PROCESSES)) - ({FAILING} if scenario.startswith("kill") else set())
    helpers.leave_last("processes_worker", process_id, alive)
    return 0


if __name__ == "__main__":
    source = sys.argv[5] if len(sys.argv) > 5 else ""
    helpers.worker_exit(main, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], source)
