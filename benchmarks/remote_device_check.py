"""The remote loading path on an accelerator, where no socket opens (issue 48).

The device machines this project borrows open no sockets, so no store can be served
there. This runs everything of ``meshinit.safetensors.load("s3://...")`` but the
listing and the bytes on the wire: the objects are listed from a local folder, and
each ranged read is answered from the local file (``remote.fetch`` stubbed, on the
same event loop, after an optional delay). Each parameter is compared bit for bit
with the local load of the same files, and both are timed (best of ``--repeats``).

Before the fix, a 64 MiB float32 parameter loaded this way on a TPU v5e came back as
all zeros in 3 of 3 loads: the fetched pages were released while the device was
still copying from them.

    python benchmarks/remote_device_check.py [--mib 64] [--tensors 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64, help="MiB per tensor (float32)")
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=1024, help="max_inflight_bytes")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="before each ranged read")
    ap.add_argument("--cpu-devices", type=int, default=0, help="simulate N CPU devices")
    args = ap.parse_args()
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    from safetensors.numpy import save_file

    import meshinit
    from meshinit import safetensors as st
    from meshinit._checkpoint.store import remote as _remote

    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    cols = 4096
    rows = args.mib * (1 << 20) // (4 * cols)
    rows -= rows % len(devices)
    folder = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    want = {}
    for i in range(args.tensors):
        want[f"t{i}"] = rng.standard_normal((rows, cols), dtype=np.float32)
        save_file({f"t{i}": want[f"t{i}"]}, str(folder / f"m-{i}.safetensors"))
    zeros = jax.nn.initializers.zeros
    layouts = {"rows": ("d", None), "replicated": (None, None), "columns": (None, "d")}

    class Stub:  # an object store answered from the local folder
        pass

    def listing(url, options):
        found = []
        for path in sorted(folder.glob("*.safetensors")):
            meta = {"size": path.stat().st_size, "e_tag": f'"{path.name}"'}
            found.append(_remote._remote(f"s3://stub/{path.name}", path.name, meta, Stub()))
        return _remote.Folder(found, None, [])

    async def fetch(obj, start, end):
        if args.delay_ms:
            await asyncio.sleep(args.delay_ms / 1000)
        with open(folder / obj.key, "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    print(
        f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}; "
        f"{args.tensors} x ({rows}, {cols}) float32 ({args.mib} MiB each)"
    )
    failures = 0
    for name, axes in layouts.items():
        plan = meshinit.plan(
            {n: meshinit.param(v.shape, zeros, axes=axes, mesh=mesh) for n, v in want.items()}
        )
        times = {"local": [], "remote (stubbed wire)": []}
        for _ in range(args.repeats):
            for recipe in times:
                with contextlib.ExitStack() as stack:
                    if recipe != "local":
                        stack.enter_context(_patch(_remote, "listing", listing))
                        stack.enter_context(_patch(_remote, "fetch", fetch))
                    source = str(folder) if recipe == "local" else "s3://stub/"
                    start = time.perf_counter()
                    got = st.load(plan, source, max_inflight_bytes=args.budget_mib << 20)
                    jax.block_until_ready(list(got.values()))
                    times[recipe].append(time.perf_counter() - start)
                bad = [n for n, v in want.items() if not np.array_equal(np.asarray(got[n]), v)]
                failures += len(bad)
                if bad:
                    zero = [n for n in bad if not np.asarray(got[n]).any()]
                    print(f"  {name} {recipe}: WRONG {bad} (all zeros: {zero})")
                del got
        line = ", ".join(f"{r} {min(t):.3f} s" for r, t in times.items())
        ratio = min(times["remote (stubbed wire)"]) / min(times["local"])
        print(f"{name:>10}: {line}; remote / local {ratio:.2f}")
    print("every parameter exact" if not failures else f"{failures} parameters WRONG")
    raise SystemExit(1 if failures else 0)


@contextlib.contextmanager
def _patch(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


if __name__ == "__main__":
    main()
