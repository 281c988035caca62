"""Fan-out on one machine: 2 processes load one checkpoint, each block read once.

Run: python examples/fanout_two_processes.py

This file is both the launcher and the worker. The launcher writes a small
safetensors checkpoint into a temporary folder, picks a free port on 127.0.0.1 and
starts itself twice (``--worker ID PORT FOLDER``). Each worker joins one
``jax.distributed`` job as one of 2 processes with 4 CPU devices each (gloo's
collectives between them), builds a (data=2, tensor=4) mesh whose rows are the two
processes, and loads the same checkpoint:

- ``embed`` is replicated over ``data``: both processes hold every block of it. With
  fan-out, each fetches half of it from the files and gets the other half from its
  peer through one all-gather;
- ``layers.N.w`` are split over ``data``: each process reads only its own rows, as
  without fan-out.

Each worker checks its shards against the file bit for bit, then loads again with
``fan_out=False`` and prints what each load fetched: the bytes read from the files and
the bytes received from its peer (the ``jax.monitoring`` scalars
``/meshinit/safetensors/bytes_read`` and ``bytes_from_peers``). If a worker fails, the
launcher stops the other one and exits non-zero.

On one machine, the page cache already serves both processes: fan-out pays where
processes on several hosts read from object storage or a shared file system, and is
shown here on one host only because it needs no cluster. The same worker code runs
on many hosts with the coordinator's address in place of 127.0.0.1.
"""

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROCESSES, LOCAL_DEVICES = 2, 4
VOCAB, D, LAYERS = 1024, 256, 2
TIMEOUT_S, GRACE_S = 180, 10  # the whole job; a peer's wait once one worker failed
READ, FROM_PEERS = "/meshinit/safetensors/bytes_read", "/meshinit/safetensors/bytes_from_peers"


# ----------------------------------------------------------------------------- worker


def worker(process_id: int, port: int, folder: Path) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=PROCESSES,
        process_id=process_id,
        initialization_timeout=60,
    )
    import numpy as np
    from jax.sharding import Mesh
    from safetensors.numpy import load_file

    import meshinit
    import meshinit.safetensors

    # jax.devices() lists process 0's devices first: each row of the mesh is a process.
    mesh = Mesh(np.array(jax.devices()).reshape(PROCESSES, LOCAL_DEVICES), ("data", "tensor"))
    init = jax.nn.initializers.zeros
    with meshinit.defaults(mesh=mesh):
        specs = {
            "embed": meshinit.param((VOCAB, D), init, axes=(None, "tensor")),  # replicated
            "layers": [meshinit.param((D, D), init, axes=("data", "tensor"))] * LAYERS,
        }
    plan = meshinit.plan(specs)
    names = [(r"embed", "model.embed_tokens.weight"), (r"layers\.(\d+)", r"model.layers.\1.w")]
    stored = load_file(folder / "model.safetensors")

    recorded: dict[str, float] = {}

    def on_scalar(event: str, value: float, **kwargs) -> None:
        if event in (READ, FROM_PEERS):
            recorded[event] = recorded.get(event, 0) + value

    jax.monitoring.register_scalar_listener(on_scalar)
    devices = sorted(d.id for d in jax.local_devices())
    for fan_out in (True, False):
        recorded.clear()
        params = meshinit.safetensors.load(plan, folder, names=names, fan_out=fan_out)
        held = 0
        for path, array in params.items():
            name = "model.embed_tokens.weight" if path == "embed" else f"model.{path}.w"
            for shard in array.addressable_shards:  # each of this process's blocks
                assert np.array_equal(np.asarray(shard.data), stored[name][shard.index]), path
            blocks = {str(s.index): s.data.nbytes for s in array.addressable_shards}
            held += sum(blocks.values())  # each distinct block once
        print(
            f"process {process_id} (devices {devices}), fan_out={fan_out}: read "
            f"{int(recorded.get(READ, 0)):,} bytes from the files, "
            f"{int(recorded.get(FROM_PEERS, 0)):,} from its peer; its shards hold "
            f"{held:,} distinct bytes, bit for bit as stored",
            flush=True,
        )
        for array in params.values():
            array.delete()


def worker_main(args: list[str]) -> None:
    try:
        worker(int(args[0]), int(args[1]), Path(args[2]))
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # at once: jax.distributed's shutdown would wait for the peer
    import jax

    jax.distributed.shutdown()


# ----------------------------------------------------------------------------- launcher


def write_checkpoint(folder: Path) -> int:
    """A small Hugging Face style checkpoint; returns its bytes of tensors."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, D), np.float32)}
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.w"] = rng.standard_normal((D, D), np.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return sum(t.nbytes for t in tensors.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(folder: Path) -> int:
    """Starts the workers, waits for them (stopping the rest once one fails or the
    time is up), prints what each printed; returns 0 if every worker succeeded."""
    import meshinit

    total = write_checkpoint(folder)
    print(f"checkpoint: {total:,} bytes of tensors in {folder / 'model.safetensors'}")
    # the workers import the meshinit this launcher imports
    here = str(Path(meshinit.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
    }
    env["JAX_PLATFORMS"] = "cpu"
    port = free_port()
    procs, logs = [], []
    try:
        for i in range(PROCESSES):
            log = open(folder / f"worker-{i}.log", "w+")  # closed below
            logs.append(log)
            command = [sys.executable, __file__, "--worker", str(i), str(port), str(folder)]
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):  # one failed: the rest wait
                deadline = min(deadline, time.monotonic() + GRACE_S)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:  # still running: timed out, or its peer failed
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    for i, p in enumerate(procs):
        output = (folder / f"worker-{i}.log").read_text()
        status = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode})"
        shown = (
            output
            if p.returncode
            else "\n".join(line for line in output.splitlines() if line.startswith("process "))
        )
        print(f"--- worker {i}: {status}\n{shown.rstrip()}")
    if any(p.returncode for p in procs):
        return 1
    for fan_out in ("True", "False"):  # what the files served the whole job
        lines = [(folder / f"worker-{i}.log").read_text() for i in range(PROCESSES)]
        found = re.findall(rf"fan_out={fan_out}: read ([\d,]+) bytes", "".join(lines))
        served = sum(int(n.replace(",", "")) for n in found)
        print(
            f"fan_out={fan_out}: the files served {served:,} bytes, "
            f"{served / total:.2f}x the checkpoint"
        )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker_main(sys.argv[2:])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            sys.exit(launch(Path(tmp)))
